"""The synchronous compiled step equals torch DDP after every step (world size 2, gloo, real processes).

SGD cases must be bit-identical. Adam/AdamW cases are compared to 1e-6 relative
(largest difference over a tensor divided by its largest magnitude), because the
captured Adam evaluates its bias corrections in float32 tensors (capturable form)
where eager uses Python floats. The runs go in one process pair, in turn (tests/batched.py), and each test asserts
its own run's results.
"""

from __future__ import annotations

import json
import re

import pytest

from batched import Case, launch_cases
from models import CASES
from workers import capture_counts, compare_with_ddp

STEPS = 10
#: the tests that read each case's run of ``compare_with_ddp``
CASE_TESTS = ("test_matches_ddp_after_every_step", "test_one_graph_per_phase", "test_dump_describes_the_graph_that_ran")


@pytest.fixture(scope="module")
def dump_root(tmp_path_factory):
    return tmp_path_factory.mktemp("dumps")


@pytest.fixture(scope="module")
def outcome(request, dump_root):
    """The per-rank values of each run by key (a failed run fails the test that reads it): every case beside DDP,
    dumping its graphs under ``dump_root/<case>``, and the capture count of a tiny step."""
    listed = [Case(case, compare_with_ddp, (case, STEPS, str(dump_root / case)),
                   tests=tuple(f"{test}[{case}]" for test in CASE_TESTS)) for case in sorted(CASES)]
    listed.append(Case("capture counts", capture_counts, tests=("test_the_first_step_traces_once",)))
    return launch_cases(request, listed)


@pytest.fixture(params=sorted(CASES))
def case_report(request, outcome, dump_root):
    return request.param, outcome(request.param), dump_root / request.param


def test_matches_ddp_after_every_step(case_report):
    case, per_rank, _dump_dir = case_report
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
    """wfbp applies every update in its call, so the optimizer state is created before the first capture and every
    step runs the one steady graph (``optim_support.initialize_state``)."""
    _case, per_rank, _dump_dir = case_report
    for report in per_rank:
        assert report["traces"] == 1


def test_dump_describes_the_graph_that_ran(case_report):
    """The last dump of the steady graph is the code that ran, with one all-reduce per bucket."""
    _case, per_rank, dump_dir = case_report
    for rank, report in enumerate(per_rank):
        steady = dump_dir / f"rank{rank}" / "graph_00"
        passes = json.loads((steady / "passes.json").read_text())
        assert [p["pass"] for p in passes][0] == "captured"
        assert "schedule" in [p["pass"] for p in passes]
        allreduce_pass = next(p for p in passes if p["pass"] == "schedule")
        assert allreduce_pass["diff"]["_c10d_functional.all_reduce_.default"] == report["buckets"]
        assert "torch.ops.deft.gradient" not in (steady / passes[-1]["file"]).read_text()
        final = (steady / passes[-1]["file"]).read_text()
        assert final.count("torch.ops._c10d_functional.all_reduce_.default(") == report["buckets"]
        assert final.count("torch.ops._c10d_functional.wait_tensor.default(") == report["code"].count(
            "torch.ops._c10d_functional.wait_tensor.default("
        )
        assert _op_sequence(final) == _op_sequence(report["code"])


def _op_sequence(code: str) -> list[str]:
    return re.findall(r"torch\.ops\.[\w.]+(?=\()", code)


def test_the_first_step_traces_once(outcome):
    """Planning (profile, plan) and compiling the first step share one capture, and the graph is reused."""
    for counts in outcome("capture counts"):
        assert counts == [1, 1, 1]
