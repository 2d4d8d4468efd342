"""ByteScheduler, US-Byte and DeFT with staleness 0 change only timing: they equal torch DDP.

World size 2, gloo, real processes. Plans come from a synthetic (deterministic)
slow-link profile so the solvers really partition, reorder and defer updates.
A parameter whose update the plan defers to the next step's forward is
compared with DDP's previous step until ``flush()``; after ``flush()`` every
tensor must equal DDP's final state.
"""

from __future__ import annotations

import pytest

from deft_compile.tools.launcher import run_local_workers
from models import CASES
from workers import check_entry, compare_policy_with_ddp, policy_with_lr_schedule_beside_ddp

STEPS = 6
POLICIES = ["bytescheduler", "usbyte", "deft-sync"]


@pytest.fixture(scope="module", params=[(p, c) for p in POLICIES for c in sorted(CASES)], ids=lambda pc: f"{pc[0]}-{pc[1]}")
def policy_report(request):
    policy, case = request.param
    results = run_local_workers(compare_policy_with_ddp, 2, (case, STEPS, policy), timeout_s=240)
    return policy, case, [r.value for r in results]


def _check(entry, exact, where):
    check_entry(entry, exact, where, tolerance=1e-6)


def test_equals_ddp_every_step_and_after_flush(policy_report):
    policy, case, per_rank = policy_report
    exact = CASES[case][5]
    for rank, report in enumerate(per_rank):
        for entry in report["steps"]:
            _check(entry, exact, f"{policy}/{case} rank {rank} step {entry['step']}")
        _check(report["final"], exact, f"{policy}/{case} rank {rank} after flush")
        assert report["pending_after_flush"] == []


def test_defers_what_the_plan_says(policy_report):
    policy, case, per_rank = policy_report
    report = per_rank[0]
    if policy in ("bytescheduler", "usbyte"):
        assert all(entry["deferred"] > 0 for entry in report["steps"]), "per-layer updates move to the next forward"
    else:
        assert all(entry["deferred"] == 0 for entry in report["steps"]), "staleness 0 must keep every update in its step"


def test_collectives_match_the_plan_on_both_ranks(policy_report):
    _policy, _case, per_rank = policy_report
    assert per_rank[0]["plan_hash"] == per_rank[1]["plan_hash"]
    for rank_report in per_rank:
        steady = rank_report["steps"][-1]["collectives"]
        assert steady.count("all_reduce") == rank_report["items"]
        assert steady.count("wait_tensor") == steady.count("all_reduce") + steady.count("broadcast")
    assert per_rank[0]["steps"][-1]["collectives"] == per_rank[1]["steps"][-1]["collectives"]


def test_buffer_broadcast_runs_beside_the_all_reduces_not_behind_them(policy_report):
    """BatchNorm's broadcast goes on a group of its own: all-reduces carried over from the previous step are
    queued on the data-parallel group when the step starts, and the forward waits for the broadcast."""
    _policy, case, per_rank = policy_report
    for report in per_rank:
        groups = report["groups"]
        assert groups["all_reduce"], case
        if report["has_buffers"]:
            assert len(groups["broadcast"]) == 1 and not set(groups["broadcast"]) & set(groups["all_reduce"]), groups
        else:
            assert not groups["broadcast"], groups


@pytest.mark.parametrize("policy,case", [("bytescheduler", "mlp_dropout_sgd"), ("usbyte", "mlp_dropout_sgd"),
                                         ("bytescheduler", "transformer_tied_adamw_groups")])
def test_updates_moved_to_the_next_forward_keep_their_steps_learning_rate(policy, case):
    """An LR scheduler steps between calls, so call t+1 (or a flush after step t) runs with step t+1's rate; the
    update of step t that the plan moved there still applies step t's rate, as DDP's does. Flushes in the middle
    of training, and steps after them, too (SGD bit-identical; AdamW with two param groups, two rates)."""
    results = run_local_workers(policy_with_lr_schedule_beside_ddp, 2, (case, 7, policy, (2, 3)), timeout_s=240)
    exact = CASES[case][5]
    for rank, result in enumerate(results):
        report = result.value
        assert any(entry["deferred"] for entry in report["steps"]), "the plan must defer updates"
        for entry in report["steps"]:
            _check(entry, exact, f"{policy}/{case} rank {rank} step {entry['step']}"
                                 + (" after flush" if entry.get("flushed") else ""))
        _check(report["final"], exact, f"{policy}/{case} rank {rank} after the last flush")
        assert report["pending_after_flush"] == []
