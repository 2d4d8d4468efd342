"""The synchronous compiled step equals torch DDP after every step (world size 2, gloo, real processes).

SGD cases must be bit-identical. Adam/AdamW cases are compared to 1e-6 relative
(largest difference over a tensor divided by its largest magnitude), because the
captured Adam evaluates its bias corrections in float32 tensors (capturable form)
where eager uses Python floats.
"""

from __future__ import annotations

import pytest

from deft_compile.launcher import run_local_workers
from models import CASES
from workers import compare_with_ddp

STEPS = 10


@pytest.fixture(scope="module", params=sorted(CASES))
def case_report(request):
    results = run_local_workers(compare_with_ddp, 2, (request.param, STEPS), timeout_s=240)
    return request.param, [r.value for r in results]


def test_matches_ddp_after_every_step(case_report):
    case, per_rank = case_report
    exact = CASES[case][5]
    for rank, report in enumerate(per_rank):
        assert len(report["steps"]) == STEPS
        assert report["buckets"] >= 2, "the test bucket caps should split gradients into several buckets"
        for step in report["steps"]:
            assert step["missing"] == [], f"rank {rank} step {step['step']}: tensors present on one side only"
            assert step["compared"] > 0
            where = f"{case} rank {rank} step {step['step']} worst {step['worst']}"
            if exact:
                assert step["max_abs"] == 0.0, where
                assert step["loss_diff"] == 0.0, where
            else:
                assert step["max_rel"] <= 1e-6, where
                assert step["loss_diff"] <= 1e-5, where


def test_one_graph_per_phase(case_report):
    """The first step creates optimizer state (one graph), later steps reuse the steady graph."""
    _case, per_rank = case_report
    for report in per_rank:
        assert report["traces"] == 2
