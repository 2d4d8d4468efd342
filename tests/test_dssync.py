"""DS-Sync: each step averages within a small group that reshuffles; flush() restores one model (4 workers).

The 2-process runs go in one process pair, in turn (``CASE_LIST``, tests/batched.py), and each test asserts its own
run's results."""

from __future__ import annotations

import pytest
import torch

from batched import Case, launch_cases
from deft_compile.tools.launcher import run_local_workers
from deft_compile.planner.solvers import dssync_partition
from workers import dssync_buffer_groups, dssync_run

AVERAGES = ["gradients", "parameters"]
CASE_LIST = [Case(("buffer groups", average), dssync_buffer_groups, (average,),
                  tests=(f"test_dssync_broadcasts_buffers_in_its_own_groups_and_opens_no_buffer_group[{average}]",))
             for average in AVERAGES]


@pytest.fixture(scope="module")
def outcome(request):
    """The per-rank values of a run of ``CASE_LIST`` by key (a failed run fails the test that reads it)."""
    return launch_cases(request, CASE_LIST)


def test_partition_is_a_seeded_shuffle_of_disjoint_groups():
    for step in range(6):
        groups = dssync_partition(8, 2, step, seed=3)
        assert sorted(r for g in groups for r in g) == list(range(8))
        assert all(len(g) == 2 for g in groups)
        assert groups == dssync_partition(8, 2, step, seed=3)
    assert len({tuple(dssync_partition(8, 2, s, seed=3)) for s in range(6)}) > 1, "groupings reshuffle"
    assert dssync_partition(8, 2, 0, seed=3, shuffle_every=4) == dssync_partition(8, 2, 3, seed=3, shuffle_every=4)
    with pytest.raises(ValueError):
        dssync_partition(6, 4, 0)


@pytest.mark.parametrize("average", ["gradients", "parameters"])
def test_dssync_averages_within_the_planned_group_and_flush_restores_one_model(average):
    """Gradients: the graph's all-reduces use exactly the step's group. Parameters: the graph communicates
    nothing (gradients stay local) and the group's members hold one model after every step. Both equal an
    eager reference of the same semantics every step."""
    results = [r.value for r in run_local_workers(dssync_run, 4, (6, average), timeout_s=300)]
    for rank, report in enumerate(results):
        for entry in report["steps"]:
            assert entry["members"] == entry["expected"], f"rank {rank} step {entry['step']}: wrong group"
            assert entry["max_abs"] == 0.0, f"rank {rank} step {entry['step']}: differs from the reference"
        same = [entry["same_in_group"] for entry in report["steps"]]
        # gradient averaging: equal after the first step (same start, same gradient), then members differ
        assert all(same) if average == "parameters" else not all(same[1:]), same
    # Groups differ, so replicas differ before the global average ...
    assert any(
        not torch.equal(a, b) for a, b in zip(results[0]["before_flush"], results[1]["before_flush"])
    ) or any(not torch.equal(a, b) for a, b in zip(results[0]["before_flush"], results[2]["before_flush"]))
    # ... and are one model after it.
    for other in results[1:]:
        for a, b in zip(results[0]["after_flush"], other["after_flush"]):
            assert torch.equal(a, b)


@pytest.mark.parametrize("average", AVERAGES)
def test_dssync_broadcasts_buffers_in_its_own_groups_and_opens_no_buffer_group(outcome, average):
    """DS-Sync's buffers go within the step's group (its graph's collectives use no other group), so the step
    does not open the buffer broadcast's group that synchronous steps on the same model open."""
    for report in outcome(("buffer groups", average)):
        assert report["wfbp_buffer_group"] and not report["dssync_buffer_group"], report
        used = set(report["groups"]["all_reduce"]) | set(report["groups"]["broadcast"])
        assert used <= {report["step_group"]}, report
