"""ByteScheduler, US-Byte and DeFT with staleness 0 change only timing: they equal torch DDP.

World size 2, gloo, real processes. Plans come from a synthetic (deterministic)
slow-link profile so the solvers really partition, reorder and defer updates.
A parameter whose update the plan defers to the next step's forward is
compared with DDP's previous step until ``flush()``; after ``flush()`` every
tensor must equal DDP's final state. Every run of this file goes in one process pair, in turn (``cases``,
tests/batched.py), and each test asserts its own run's results.
"""

from __future__ import annotations

import pytest

from batched import Case, launch_cases
from models import CASES
from workers import check_entry, compare_policy_with_ddp, policy_with_lr_schedule_beside_ddp

STEPS = 6
POLICIES = ["bytescheduler", "usbyte", "deft-sync"]
PAIRS = [(p, c) for p in POLICIES for c in sorted(CASES)]
#: the tests that read each ``(policy, case)`` run of ``compare_policy_with_ddp``
PAIR_TESTS = ("test_equals_ddp_every_step_and_after_flush", "test_defers_what_the_plan_says",
              "test_collectives_match_the_plan_on_both_ranks",
              "test_buffer_broadcast_runs_beside_the_all_reduces_not_behind_them")
LR_SCHEDULE_PAIRS = [("bytescheduler", "mlp_dropout_sgd"), ("usbyte", "mlp_dropout_sgd"),
                     ("bytescheduler", "transformer_tied_adamw_groups")]


def _id(pair: tuple[str, str]) -> str:
    return f"{pair[0]}-{pair[1]}"


CASE_LIST = ([Case(("policy", policy, case), compare_policy_with_ddp, (case, STEPS, policy),
                   tests=tuple(f"{test}[{_id((policy, case))}]" for test in PAIR_TESTS)) for policy, case in PAIRS]
             + [Case(("lr schedule", policy, case), policy_with_lr_schedule_beside_ddp, (case, 7, policy, (2, 3)),
                     tests=(f"test_updates_moved_to_the_next_forward_keep_their_steps_learning_rate[{policy}-{case}]",))
                for policy, case in LR_SCHEDULE_PAIRS])


@pytest.fixture(scope="module")
def outcome(request):
    """The per-rank values of a run of ``CASE_LIST`` by key (a failed run fails the test that reads it)."""
    return launch_cases(request, CASE_LIST)


@pytest.fixture
def policy_report(outcome, pair):
    policy, case = pair
    return policy, case, outcome(("policy", policy, case))


each_pair = pytest.mark.parametrize("pair", PAIRS, ids=_id)


def _check(entry, exact, where):
    check_entry(entry, exact, where, tolerance=1e-6)


@each_pair
def test_equals_ddp_every_step_and_after_flush(policy_report):
    policy, case, per_rank = policy_report
    exact = CASES[case][5]
    for rank, report in enumerate(per_rank):
        for entry in report["steps"]:
            _check(entry, exact, f"{policy}/{case} rank {rank} step {entry['step']}")
        _check(report["final"], exact, f"{policy}/{case} rank {rank} after flush")
        assert report["pending_after_flush"] == []


@each_pair
def test_defers_what_the_plan_says(policy_report):
    policy, case, per_rank = policy_report
    report = per_rank[0]
    if policy in ("bytescheduler", "usbyte"):
        assert all(entry["deferred"] > 0 for entry in report["steps"]), "per-layer updates move to the next forward"
    else:
        assert all(entry["deferred"] == 0 for entry in report["steps"]), "staleness 0 must keep every update in its step"


@each_pair
def test_collectives_match_the_plan_on_both_ranks(policy_report):
    _policy, _case, per_rank = policy_report
    assert per_rank[0]["plan_hash"] == per_rank[1]["plan_hash"]
    for rank_report in per_rank:
        steady = rank_report["steps"][-1]["collectives"]
        assert steady.count("all_reduce") == rank_report["items"]
        assert steady.count("wait_tensor") == steady.count("all_reduce") + steady.count("broadcast")
    assert per_rank[0]["steps"][-1]["collectives"] == per_rank[1]["steps"][-1]["collectives"]


@each_pair
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


@pytest.mark.parametrize("policy,case", LR_SCHEDULE_PAIRS)
def test_updates_moved_to_the_next_forward_keep_their_steps_learning_rate(outcome, policy, case):
    """An LR scheduler steps between calls, so call t+1 (or a flush after step t) runs with step t+1's rate; the
    update of step t that the plan moved there still applies step t's rate, as DDP's does. Flushes in the middle
    of training, and steps after them, too (SGD bit-identical; AdamW with two param groups, two rates)."""
    exact = CASES[case][5]
    for rank, report in enumerate(outcome(("lr schedule", policy, case))):
        assert any(entry["deferred"] for entry in report["steps"]), "the plan must defer updates"
        for entry in report["steps"]:
            _check(entry, exact, f"{policy}/{case} rank {rank} step {entry['step']}"
                                 + (" after flush" if entry.get("flushed") else ""))
        _check(report["final"], exact, f"{policy}/{case} rank {rank} after the last flush")
        assert report["pending_after_flush"] == []
