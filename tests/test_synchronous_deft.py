"""deft whose plans are all synchronous trains as torch DDP does, whatever else runs around the step.

World size 2, gloo, the aten route, AdamW with two param groups and a learning rate that changes every step (a
``LambdaLR`` stepped after every call, as training loops do). Around the step: the closed loop's trials of
ByteScheduler's and US-Byte's plans (their updates run in the next call) and its switches, the Preserver's
staleness measurements (its synchronous start, on a profile whose unpriced plan delays, with a price that keeps
every delay out), forced plan switches and flushes in the middle of training. Parameters, gradients and
optimizer state are compared with DDP's after every step (a parameter whose update the plan moved into the next
call with DDP's previous step): within float32 round-off of the capturable update (1e-5 relative), where a
learning rate one step off moves AdamW's parameters by 3e-2 relative within two steps.
"""

from __future__ import annotations

from deft_compile.tools.launcher import run_local_workers
from workers import check_entry, synchronous_deft_beside_ddp

STEPS = 12


def _check(report: dict, where: str) -> None:
    assert report["stale_items"] == 0, f"{where}: a plan with delays or periods ran"
    for entry in report["steps"]:
        check_entry(entry, False, f"{where} step {entry['step']}", tolerance=1e-5)
    check_entry(report["final"], False, f"{where} after the last flush", tolerance=1e-5)
    assert report["deferred_steps"] >= 2, f"{where}: no plan moved updates into the next call"
    assert len(report["probes"]) >= 2, f"{where}: the Preserver measured no staleness"
    # a call that moved no weight (the first call of a priority plan) has nothing to measure: no price of zero
    assert all(share > 0 for share in report["largest_share"]), (where, report["probes"], report["largest_share"])


def test_closed_loop_trials_and_preserver_probes_leave_ddps_numbers():
    for rank, result in enumerate(run_local_workers(synchronous_deft_beside_ddp, 2, (STEPS, True, None, (7,)),
                                                    timeout_s=300)):
        report = result.value
        assert {"bytescheduler", "usbyte"} <= set(report["policies"]), report["history"]
        _check(report, f"rank {rank}")


def test_forced_switches_between_synchronous_plans_and_flushes_leave_ddps_numbers():
    switches = {3: "bytescheduler", 6: "usbyte", 9: "wfbp"}
    for rank, result in enumerate(run_local_workers(synchronous_deft_beside_ddp, 2, (STEPS, False, switches, (4, 7)),
                                                    timeout_s=300)):
        report = result.value
        assert report["switches"] == 3 and {"bytescheduler", "usbyte", "wfbp"} <= set(report["policies"])
        _check(report, f"rank {rank}")
