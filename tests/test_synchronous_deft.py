"""deft whose plans are all synchronous trains as torch DDP does, whatever else runs around the step.

World size 2, gloo, the aten route, AdamW with two param groups and a learning rate that changes every step (a
``LambdaLR`` stepped after every call, as training loops do). Around the step: the closed loop's trials of
ByteScheduler's and US-Byte's plans (their updates run in the next call) and its switches, the Preserver's
staleness measurements (its synchronous start, on a profile whose unpriced plan delays, with a price that keeps
every delay out), forced plan switches and flushes in the middle of training. Parameters, gradients and
optimizer state are compared with DDP's after every step (a parameter whose update the plan moved into the next
call with DDP's previous step): within float32 round-off of the capturable update (1e-5 relative), where a
learning rate one step off moves AdamW's parameters by 3e-2 relative within two steps. Both runs go in one process
pair, in turn (tests/batched.py), and each test asserts its own run's results.
"""

from __future__ import annotations

import pytest

from batched import Case, launch_cases
from workers import check_entry, synchronous_deft_beside_ddp

STEPS = 12
SWITCHES = {3: "bytescheduler", 6: "usbyte", 9: "wfbp"}
CASE_LIST = [Case("closed loop", synchronous_deft_beside_ddp, (STEPS, True, None, (7,)),
                  tests=("test_closed_loop_trials_and_preserver_probes_leave_ddps_numbers",)),
             Case("forced switches", synchronous_deft_beside_ddp, (STEPS, False, SWITCHES, (4, 7)),
                  tests=("test_forced_switches_between_synchronous_plans_and_flushes_leave_ddps_numbers",))]


@pytest.fixture(scope="module")
def outcome(request):
    """The per-rank values of a run of ``CASE_LIST`` by key (a failed run fails the test that reads it)."""
    return launch_cases(request, CASE_LIST)


def _check(report: dict, where: str) -> None:
    assert report["stale_items"] == 0, f"{where}: a plan with delays or periods ran"
    for entry in report["steps"]:
        check_entry(entry, False, f"{where} step {entry['step']}", tolerance=1e-5)
    check_entry(report["final"], False, f"{where} after the last flush", tolerance=1e-5)
    assert report["deferred_steps"] >= 2, f"{where}: no plan moved updates into the next call"
    assert len(report["probes"]) >= 2, f"{where}: the Preserver measured no staleness"
    # a call that moved no weight (the first call of a priority plan) has nothing to measure: no price of zero
    assert all(share > 0 for share in report["largest_share"]), (where, report["probes"], report["largest_share"])


def test_closed_loop_trials_and_preserver_probes_leave_ddps_numbers(outcome):
    for rank, report in enumerate(outcome("closed loop")):
        assert {"bytescheduler", "usbyte"} <= set(report["policies"]), report["history"]
        _check(report, f"rank {rank}")


def test_forced_switches_between_synchronous_plans_and_flushes_leave_ddps_numbers(outcome):
    for rank, report in enumerate(outcome("forced switches")):
        assert report["switches"] == 3 and {"bytescheduler", "usbyte", "wfbp"} <= set(report["policies"])
        _check(report, f"rank {rank}")
