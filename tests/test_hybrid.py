"""DeFT's delayed buckets with the synchronous rest on a priority schedule (``synchronous_schedule``).

The 2-process runs go in one process pair, in turn (``CASE_LIST``, tests/batched.py), and each test asserts its own
run's results."""

from __future__ import annotations

import dataclasses

import pytest

from deft_compile.planner.plan import BEFORE_FORWARD_PREFIX, UPDATE_AT_NEXT_STEP, LinkCost
from deft_compile.planner.solvers import solve, with_priority_synchronous
from deft_compile.planner.zoo_profiles import build_profile
from batched import Case, launch_cases
from workers import check_entry, closed_loop_hybrid_run, hybrid_vs_reference

HYBRID_CASES = [("mlp_dropout_sgd", "bytescheduler"), ("cnn_batchnorm_adam", "usbyte"),
                ("transformer_tied_adamw_groups", "bytescheduler")]
CASE_LIST = ([Case(("hybrid", case, schedule), hybrid_vs_reference, (case, 6, schedule),
                   tests=(f"test_numbers_are_the_delayed_semantics_and_ddps[{case}-{schedule}]",))
              for case, schedule in HYBRID_CASES]
             + [Case("closed loop", closed_loop_hybrid_run, (40,),
                     tests=("test_the_closed_loop_carries_a_later_plan_with_delays_on_the_fastest_priority_schedule",)),
                Case("closed loop without priority schedule", closed_loop_hybrid_run, (40, False),
                     tests=("test_without_priority_schedule_a_later_plan_with_delays_keeps_ddps_buckets",))])


@pytest.fixture(scope="module")
def outcome(request):
    """The per-rank values of a run of ``CASE_LIST`` by key (a failed run fails the test that reads it)."""
    return launch_cases(request, CASE_LIST)


def _profile():
    return build_profile("resnet101", inter_gbps=25)


@pytest.mark.parametrize("schedule", ["bytescheduler", "usbyte"])
def test_delayed_buckets_kept_and_every_other_parameter_on_the_priority_schedule(schedule):
    profile = _profile()
    deft = solve(profile, "deft", allow_period=False)
    stale = [item for item in deft.items if item.delay]
    assert stale, "the DeFT plan must delay buckets for the test to mean anything"
    hybrid = solve(profile, "deft", allow_period=False, synchronous_schedule=schedule)
    hybrid.validate(profile)  # every element carried exactly once, waits before first use
    assert hybrid.policy == "deft" and hybrid.options["synchronous_schedule"] == schedule
    # the delayed buckets: the same slices, window, delay and period, issued first
    kept = sorted(hybrid.items, key=lambda item: item.order)[: len(stale)]
    assert [(i.slices, i.window, i.delay, i.period, i.update_at) for i in kept] == [
        (i.slices, i.window, i.delay, i.period, i.update_at) for i in sorted(stale, key=lambda item: item.order)]
    # everything else: no delay, waited and applied before a layer's forward in the next step, in the priority
    # plan's order (restricted to the parameters DeFT left synchronous)
    rest = sorted(hybrid.items, key=lambda item: item.order)[len(stale):]
    assert rest and all(i.delay == 0 and i.update_at.startswith(BEFORE_FORWARD_PREFIX) for i in rest)
    stale_params = {s.param for item in stale for s in item.slices}
    priority = solve(profile, schedule)
    expected = [tuple(s for s in i.slices if s.param not in stale_params)
                for i in sorted(priority.items, key=lambda item: item.order)]
    assert [i.slices for i in rest] == [slices for slices in expected if slices]
    assert len({i.bucket for i in hybrid.items}) == len(hybrid.items)  # the Preserver prices buckets one by one
    assert solve(profile, "deft", allow_period=False, synchronous_schedule=schedule).hash() == hybrid.hash()


def test_without_delays_it_is_the_priority_plan():
    profile = _profile()
    hybrid = solve(profile, "deft", max_staleness=0, synchronous_schedule="usbyte")
    priority = solve(profile, "usbyte")
    assert [(i.slices, i.wait_at, i.update_at) for i in sorted(hybrid.items, key=lambda i: i.order)] == [
        (i.slices, i.wait_at, i.update_at) for i in sorted(priority.items, key=lambda i: i.order)]
    assert hybrid.predicted_iteration_ms == pytest.approx(priority.predicted_iteration_ms)


def test_periods_are_kept():
    profile = _profile()
    deft = solve(profile, "deft")
    assert any(item.period > 1 for item in deft.items), "the plan must have a period for the test to mean anything"
    hybrid = with_priority_synchronous(profile, deft, "bytescheduler")
    periodic = {(i.slices, i.period, i.period_offset) for i in deft.items if i.period > 1}
    assert periodic <= {(i.slices, i.period, i.period_offset) for i in hybrid.items}
    assert all(i.update_at == UPDATE_AT_NEXT_STEP for i in hybrid.items if i.delay)


def test_bad_schedules_and_several_links_are_refused():
    profile = _profile()
    with pytest.raises(ValueError, match="synchronous_schedule must be one of"):
        solve(profile, "deft", synchronous_schedule="wfbp")
    two_links = dataclasses.replace(profile, links=[profile.links[0], LinkCost("second", 0.05, 2e-6)])
    with pytest.raises(ValueError, match="plans one link"):
        solve(two_links, "deft", synchronous_schedule="bytescheduler")


@pytest.mark.parametrize("case,schedule", HYBRID_CASES)
def test_numbers_are_the_delayed_semantics_and_ddps(outcome, case, schedule):
    results = outcome(("hybrid", case, schedule))
    for rank, report in enumerate(results):
        assert report["options"]["synchronous_schedule"] == schedule
        assert report["delayed_items"] > 0 and report["next_forward_items"] > 0, report
        assert any(entry["deferred"] for entry in report["steps"]), "no update ever moved to the next forward"
        for entry in report["steps"]:
            check_entry(entry, False, f"rank {rank} step {entry['step']}", tolerance=1e-5)
        check_entry(report["final"], False, f"rank {rank} after flush", tolerance=1e-5)
        assert report["pending_after_flush"] == []


def test_the_closed_loop_carries_a_later_plan_with_delays_on_the_fastest_priority_schedule(outcome):
    results = outcome("closed loop")
    for report in results:
        settled = report["settled_policy"]
        assert settled in ("bytescheduler", "usbyte"), report["history"]
        replan = report["replan"]
        assert replan is not None and replan["delayed"] > 0, report["history"]
        assert replan["options"]["synchronous_schedule"] == settled == report["priority_schedule"]
        assert replan["applies"] == sorted([report["next_forward"], report["next_update"]]), replan
        # it still has to beat the priority plan in a duel: here it is 1 s slower and loses
        duel = report["history"][-1]["closed_loop"]["duel"]
        assert duel["stale_plan"] == replan["hash"] and duel["median_ratio"] > 1.0, duel
        assert report["state"] == "settled" and report["final_policy"] == settled
    assert results[0]["replan"]["hash"] == results[1]["replan"]["hash"]


def test_without_priority_schedule_a_later_plan_with_delays_keeps_ddps_buckets(outcome):
    for report in outcome("closed loop without priority schedule"):
        assert report["settled_policy"] in ("bytescheduler", "usbyte") and report["priority_schedule"] is None
        replan = report["replan"]
        assert replan["delayed"] > 0 and "synchronous_schedule" not in replan["options"], replan
        assert replan["applies"] == sorted(["this-step", report["next_update"]]), replan
