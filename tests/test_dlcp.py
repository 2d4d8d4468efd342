"""DLCP: prioritised chunks, deadline, bounded loss, error feedback (2 gloo workers; the runs go in one process pair,
in turn: tests/batched.py)."""

from __future__ import annotations

import pytest

from batched import Case, launch_cases
from workers import dlcp_run

BOUNDS = [(0.05, False), (0.5, True)]
CASE_LIST = ([Case("no deadline", dlcp_run, (None, 0.1, 5), tests=("test_without_a_deadline_it_equals_ddp",))]
             + [Case(("deadline", max_loss), dlcp_run, (0.5, max_loss, 6),
                     tests=(f"test_deadline_drops_within_the_bound_and_the_residual_is_exact[{max_loss}-{must_drop}]",))
                for max_loss, must_drop in BOUNDS])


@pytest.fixture(scope="module")
def outcome(request):
    """The per-rank values of a run of ``CASE_LIST`` by key (a failed run fails the test that reads it)."""
    return launch_cases(request, CASE_LIST)


def test_without_a_deadline_it_equals_ddp(outcome):
    for report in outcome("no deadline"):
        for entry in report["steps"]:
            assert entry["ddp_max_abs"] == 0.0, entry
            assert entry["stats"] is None, "no deadline: nothing is chunked or dropped"


@pytest.mark.parametrize("max_loss, must_drop", BOUNDS)
def test_deadline_drops_within_the_bound_and_the_residual_is_exact(outcome, max_loss, must_drop):
    """A tight bound may forbid any drop (then the deadline is missed rather than the bound); a loose one drops."""
    results = outcome(("deadline", max_loss))
    report = results[0]
    assert 0 < report["budget"] < report["chunks"], "the deadline must force drops for this test to mean anything"
    dropped_something = False
    for rank_report in results:
        for entry in rank_report["steps"]:
            sent, dropped_fraction = entry["stats"]
            assert sent >= report["budget"]
            assert dropped_fraction <= max_loss + 1e-12, entry
            dropped_something |= dropped_fraction > 0
            assert entry["conservation_error"] == 0.0, "applied average + residuals must equal the local gradients"
            assert entry["replicas_equal"], "every rank must drop the same chunks"
    if must_drop:
        assert dropped_something
    for rank_report in results:
        assert rank_report["had_residual"] and rank_report["carry_after_flush"] == [], "flush() applies the residual"
        assert rank_report["replicas_equal_after_flush"]
        # an all-zero residual (nothing dropped in the last step) must not cost an extra optimizer update
        assert rank_report["flush_moved_weights"] == rank_report["residual_nonzero_somewhere"], rank_report
    assert [e["stats"] for e in results[0]["steps"]] == [e["stats"] for e in results[1]["steps"]], "same decision on every rank"
