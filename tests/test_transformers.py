"""``transformers`` models (GPT-2, BERT, Llama from small configs, random weights, nothing downloaded): the step
takes their ``ModelOutput`` (``.loss``) without a loss_fn and, with ``wfbp`` and clipping, equals torch DDP. The
three families run in one process pair, in turn (tests/batched.py), and each test asserts its own family's results."""

from __future__ import annotations

import pytest

from batched import Case, launch_cases
from loop_workers import transformers_with_ddp
from workers import check_entry

import transformers  # noqa: F401  (a dev dependency: a missing install fails here, loudly)

FAMILIES = ["gpt2", "bert", "llama"]
CASE_LIST = [Case(family, transformers_with_ddp, (family, 3), tests=(f"test_transformers_model_equals_ddp[{family}]",))
             for family in FAMILIES]


@pytest.fixture(scope="module")
def outcome(request):
    """The per-rank values of a run of ``CASE_LIST`` by key (a failed run fails the test that reads it)."""
    return launch_cases(request, CASE_LIST)


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_model_equals_ddp(outcome, family: str) -> None:
    for rank, report in enumerate(outcome(family)):
        assert report["buckets"] >= 2
        for entry in report["steps"]:
            check_entry(entry, False, f"{family} rank {rank} step {entry['step']}", tolerance=1e-5)
            assert entry["loss_diff"] <= 1e-6
