"""The closed loop's rules (``deft_compile.planner.closed_loop``) and its refinement (``planner.refine``) as pure
functions: measured plans in, decisions out. No process, no torch."""

from __future__ import annotations

import ast
import dataclasses
import pathlib
from types import SimpleNamespace

from deft_compile.planner.closed_loop import (
    ClosedLoopConfig,
    Duel,
    MeasureAlone,
    REWIRED_DUEL,
    SYNCHRONOUS_DUEL,
    Settle,
    StartDuel,
    adjust_options,
    after_replan,
    choose_synchronous,
    decide,
    duel_block_steps,
    duel_verdict,
    fastest_synchronous,
    is_synchronous,
    measured_times,
    narrows_kept,
    priority_schedule_for,
    retire_for_replan,
    retired_by_wire,
    settle_between,
    synchronous_stand_in,
    trial_queue,
    wires,
)
from deft_compile.planner.refine import refine_profile, thread_ms_of
from deft_compile.planner.solvers import solve
from deft_compile.planner.zoo_profiles import build_profile
from wire_plans import kept_wire_plans, replan_keeping

CONFIG = ClosedLoopConfig()


class FakePlan:
    def __init__(self, name: str, policy: str = "deft", delay: int = 0, period: int = 1, options=None) -> None:
        self.name, self.policy, self.options = name, policy, dict(options or {})
        self.items = [SimpleNamespace(delay=delay, period=period, link=0)]
        self.predicted_iteration_ms = 0.0

    def hash(self) -> str:
        return self.name


def measured(*entries: tuple[FakePlan, float]) -> dict:
    return {plan.hash(): (plan, ms) for plan, ms in entries}


BUCKETS, PRIORITY = FakePlan("buckets", "wfbp"), FakePlan("priority", "bytescheduler")
STALE = FakePlan("stale", delay=1)


def test_synchronous_means_ddps_numbers_whatever_the_schedule():
    assert is_synchronous(BUCKETS) and is_synchronous(PRIORITY)
    assert not is_synchronous(STALE) and not is_synchronous(FakePlan("periodic", period=2))


def test_the_synchronous_plan_is_chosen_by_margin_or_by_duel():
    # not min_gain faster: DDP's buckets
    assert choose_synchronous(measured((BUCKETS, 100.0), (PRIORITY, 99.5)), is_synchronous, CONFIG) == "buckets"
    # faster by min_gain or more, however far (a change of load between windows can fake 25 %): a duel
    for challenger_ms in (90.0, 70.0, 40.0):
        choice = choose_synchronous(measured((BUCKETS, 100.0), (PRIORITY, challenger_ms)), is_synchronous, CONFIG)
        assert choice == StartDuel(PRIORITY, BUCKETS, SYNCHRONOUS_DUEL), challenger_ms
    # without duels, the sequential numbers decide
    no_duels = dataclasses.replace(CONFIG, duel_rounds=0)
    assert choose_synchronous(measured((BUCKETS, 100.0), (PRIORITY, 90.0)), is_synchronous, no_duels) == "priority"
    assert choose_synchronous(measured((BUCKETS, 100.0)), is_synchronous, CONFIG) is None  # one kind measured


def test_a_plan_with_delays_duels_when_close_and_settles_when_clearly_apart():
    close = measured((BUCKETS, 100.0), (STALE, 95.0))
    assert decide(close, is_synchronous, None, CONFIG) == StartDuel(STALE, BUCKETS, "settle")
    far = measured((BUCKETS, 100.0), (STALE, 140.0))
    assert decide(far, is_synchronous, None, CONFIG) == Settle(BUCKETS, 100.0, "fastest measured plan")
    no_duel = ClosedLoopConfig(duel_rounds=0)
    assert decide(close, is_synchronous, None, no_duel) == Settle(STALE, 95.0, "fastest measured plan")
    only_sync = measured((BUCKETS, 100.0), (PRIORITY, 90.0))
    assert decide(only_sync, is_synchronous, "buckets", CONFIG) == Settle(BUCKETS, 100.0, "fastest measured plan")
    assert fastest_synchronous(only_sync, is_synchronous, None) == (PRIORITY, 90.0)


def test_a_replan_after_settling_is_decided_from_what_was_measured():
    record = measured((BUCKETS, 100.0), (PRIORITY, 90.0))
    # unmeasured plan with delays: a duel (or a measurement alone without duels)
    assert after_replan(STALE, record, is_synchronous, "priority", CONFIG) == StartDuel(STALE, PRIORITY, "re-plan")
    assert after_replan(STALE, record, is_synchronous, "priority", ClosedLoopConfig(duel_rounds=0)) == MeasureAlone()
    # measured, not faster than the synchronous plan: back to it
    slow = {**record, **measured((STALE, 95.0))}
    decision = after_replan(STALE, slow, is_synchronous, "priority", CONFIG)
    assert isinstance(decision, Settle) and decision.plan is PRIORITY and "back to synchronous" in decision.why
    assert after_replan(STALE, {**record, **measured((STALE, 80.0))}, is_synchronous, "priority", CONFIG) is None
    # a synchronous re-plan runs as the fastest measured synchronous plan (same numbers)
    decision = after_replan(BUCKETS, record, is_synchronous, "priority", CONFIG)
    assert isinstance(decision, Settle) and decision.plan is PRIORITY
    assert decision.extra["replaced"]["plan_hash"] == "buckets"
    assert after_replan(STALE, measured((STALE, 80.0)), is_synchronous, None, CONFIG) is None  # nothing synchronous


def test_a_synchronous_replan_is_replaced_only_by_a_measured_plan_with_its_wire():
    """The Preserver sends a bucket back to float32 and the solver answers with DDP's buckets: the faster priority
    plan measured before, which sends that bucket in float16, is not a stand-in (other numbers); one with the
    re-plan's wire is."""
    def plan(name, policy, wire_of_second):
        fake = FakePlan(name, policy)
        fake.items = [SimpleNamespace(delay=0, period=1, link=0, wire_dtype="float16",
                                      slices=(SimpleNamespace(param=0),)),
                      SimpleNamespace(delay=0, period=1, link=0, wire_dtype=wire_of_second,
                                      slices=(SimpleNamespace(param=1),))]
        return fake

    narrow_priority, float32_buckets = plan("priority16", "usbyte", "float16"), plan("buckets32", "wfbp", "float32")
    assert wires(narrow_priority) != wires(float32_buckets)
    record = measured((plan("buckets16", "wfbp", "float16"), 100.0), (narrow_priority, 80.0))
    assert after_replan(float32_buckets, record, is_synchronous, "priority16", CONFIG) is None
    float32_priority = plan("priority32", "usbyte", "float32")
    decision = after_replan(float32_buckets, {**record, **measured((float32_priority, 85.0))}, is_synchronous,
                            "priority16", CONFIG)
    assert isinstance(decision, Settle) and decision.plan is float32_priority


def test_a_replan_that_keeps_float32_rebuilds_the_chosen_order_on_its_wires():
    """The Preserver keeps ``p3`` float32 while US-Byte's order, measured fastest, sends it in float16: that plan
    would undo the decision, and DDP's buckets would drop the order. The stand-in is US-Byte's order on the
    re-plan's wires; unmeasured, it duels the synchronous re-plan (or is what a re-plan with delays must beat)."""
    profile, buckets16, usbyte16, replan = kept_wire_plans()
    assert narrows_kept(profile, usbyte16, ["p3"]) and narrows_kept(profile, buckets16, ["p3"])
    assert not narrows_kept(profile, replan, ["p3"]) and not narrows_kept(profile, usbyte16, [])
    stand_in = synchronous_stand_in(usbyte16, replan, profile, "deft", is_synchronous, None)
    assert stand_in.policy == "usbyte" and not narrows_kept(profile, stand_in, ["p3"])
    assert {item.wire_dtype for item in stand_in.items if all(s.param != 3 for s in item.slices)} == {"float16"}
    assert [s.param for item in stand_in.items for s in item.slices] == [
        s.param for item in usbyte16.items for s in item.slices], "the order is US-Byte's"
    assert synchronous_stand_in(buckets16, replan, profile, "deft", is_synchronous, None) is replan
    before = measured((buckets16, 100.0), (usbyte16, 85.0), (replan, 101.0))
    assert retired_by_wire(before, profile, ["p3"], is_synchronous, usbyte16.hash()) == (
        [buckets16.hash(), usbyte16.hash()], usbyte16)
    assert retired_by_wire(before, profile, ["p3"], is_synchronous, replan.hash()) == (
        [buckets16.hash(), usbyte16.hash()], None), "the chosen plan keeps p3 float32: no stand-in"
    kept, rebuilt = retire_for_replan(before, replan, profile, ["p3"], "deft", is_synchronous, usbyte16.hash(), None)
    assert list(kept) == [replan.hash()] and rebuilt.hash() == stand_in.hash()
    assert retire_for_replan(before, replan, profile, ["p3"], "deft", is_synchronous, replan.hash(), None) == (
        {replan.hash(): before[replan.hash()]}, None)
    # a stand-in an earlier re-plan queued and nobody measured stays the plan to measure, rebuilt where a later
    # re-plan keeps one more of its parameters float32
    replan2 = replan_keeping(profile, ["p3", "p2"])
    assert retire_for_replan({}, replan, profile, ["p3"], "deft", is_synchronous, None, None, (stand_in,)) == (
        {}, stand_in)
    _, rebuilt2 = retire_for_replan({}, replan2, profile, ["p3", "p2"], "deft", is_synchronous, None, None, (stand_in,))
    assert rebuilt2.policy == "usbyte" and narrows_kept(profile, stand_in, ["p2"])
    assert not narrows_kept(profile, rebuilt2, ["p3", "p2"])
    # the measured plans that narrow p3 are retired by the loop: nothing synchronous measured is left
    assert after_replan(replan, {}, is_synchronous, stand_in.hash(), CONFIG, stand_in) == StartDuel(
        stand_in, replan, REWIRED_DUEL)
    assert after_replan(replan, {}, is_synchronous, None, CONFIG) is None  # no stand-in: the re-plan runs on
    assert after_replan(STALE, {}, is_synchronous, stand_in.hash(), CONFIG, stand_in) == StartDuel(
        STALE, stand_in, "re-plan")
    # no duels configured: the stand-in is measured alone after the re-plan; beside a synchronous re-plan the
    # synchronous plan is then chosen again among the measured ones
    alone = ClosedLoopConfig(duel_rounds=0)
    assert after_replan(replan, {}, is_synchronous, stand_in.hash(), alone, stand_in) == MeasureAlone(
        then=(stand_in,), between=(replan.hash(), stand_in.hash()))
    assert after_replan(STALE, {}, is_synchronous, stand_in.hash(), alone, stand_in) == MeasureAlone(then=(stand_in,))
    # measured alone, the decision is between the two only: the priority order where min_gain (1 %) faster, else
    # the re-plan; a faster plan measured earlier (a plan with delays) is not among them
    between = (replan.hash(), stand_in.hash())
    for stand_in_ms, winner in ((98.5, stand_in), (99.5, replan)):
        record = measured((stand_in, stand_in_ms), (replan, 100.0), (STALE, 50.0))
        decision = settle_between(record, between, is_synchronous, alone)
        assert isinstance(decision, Settle) and decision.plan is winner, (stand_in_ms, decision.why)
    # measured already (the duel ran): decided from the measurements as before
    record = measured((stand_in, 80.0), (replan, 100.0))
    decision = after_replan(replan, record, is_synchronous, stand_in.hash(), CONFIG, stand_in)
    assert isinstance(decision, Settle) and decision.plan is stand_in


def test_the_duels_verdict_is_the_median_ratio_against_min_gain():
    duel = Duel.between(STALE, BUCKETS, 2, "settle", block_steps=3)
    duel.medians = [90.0, 100.0, 100.0, 91.0]  # order 0 1 1 0: ratios 0.9 and 0.91
    won, verdict, record = duel_verdict(duel, CONFIG)
    assert won and "median ratio 0.905" in verdict and record["duel"]["stale_plan"] == "stale"
    duel.medians = [100.0, 100.0, 100.0, 100.0]
    assert not duel_verdict(duel, CONFIG)[0]  # a tie goes to the synchronous plan
    short = measured((STALE, 4.0), (BUCKETS, 5.0))
    assert duel_block_steps(short, STALE, BUCKETS, ClosedLoopConfig(min_window_ms=100.0, duel_steps=3)) == 25


def test_later_replans_stay_synchronous_or_carry_the_priority_schedule():
    assert adjust_options({"a": 1}, True, None) == {"a": 1, "max_staleness": 0, "allow_period": False}
    assert adjust_options({}, False, "usbyte") == {"synchronous_schedule": "usbyte"}
    assert adjust_options({"synchronous_schedule": "x"}, False, "usbyte") == {"synchronous_schedule": "x"}
    on = ClosedLoopConfig(priority_schedule=True)
    record = measured((BUCKETS, 100.0), (PRIORITY, 90.0))
    assert priority_schedule_for(PRIORITY, "deft", 1, record, is_synchronous, None, on) == "bytescheduler"
    assert priority_schedule_for(STALE, "deft", 1, record, is_synchronous, None, on) == "bytescheduler"
    assert priority_schedule_for(PRIORITY, "deft", 2, record, is_synchronous, None, on) is None  # one link only
    assert priority_schedule_for(PRIORITY, "usbyte", 1, record, is_synchronous, None, on) is None
    assert priority_schedule_for(PRIORITY, "deft", 1, record, is_synchronous, None, CONFIG) is None  # opt-in


def test_deft_trials_its_synchronous_plan_and_both_priority_plans():
    profile = build_profile("gpt2", gpus=16)
    plan = solve(profile, "deft")
    assert not is_synchronous(plan), "the test needs an initial plan with delays"
    solved = []

    def solve_own(options):
        solved.append(options)
        return solve(profile, "deft", **options)

    queue = trial_queue("deft", plan, profile, {}, is_synchronous, CONFIG, solve_own, loss_scaled=False)
    assert [why for _, why in queue] == ["synchronous candidate", "synchronous priority candidate (bytescheduler)",
                                         "synchronous priority candidate (usbyte)"]
    assert solved[0]["max_staleness"] == 0 and all(is_synchronous(p) for p, _ in queue)
    assert len(trial_queue("deft", plan, profile, {}, is_synchronous, CONFIG, solve_own, loss_scaled=True)) == 1
    wfbp = solve(profile, "wfbp")
    assert trial_queue("wfbp", wfbp, profile, {}, is_synchronous, CONFIG, solve_own, loss_scaled=False) == []


def test_priority_candidates_are_tried_only_where_their_bytes_could_gain_the_least_gain():
    """A priority plan computes what the initial plan computes and hides at most its communication: where the
    busiest link's load (x(1 + tolerance) for the profile's error) is under ``min_gain`` of the step, its trial
    cannot pay and the queue leaves it out; the same model on a slower link tries both."""
    import dataclasses

    from deft_compile.planner.closed_loop import can_gain, link_load_ms
    from deft_compile.planner.stability import predicted_ms

    profile = build_profile("gpt2", gpus=16)
    fast = dataclasses.replace(profile, links=[dataclasses.replace(link, alpha_ms=0.0, beta_ms_per_byte=1e-12)
                                               for link in profile.links])
    for chosen, tried in ((profile, True), (fast, False)):
        plan = solve(chosen, "deft", max_staleness=0)
        load, step = link_load_ms(chosen, plan), predicted_ms(chosen, plan)
        assert can_gain(plan, chosen, CONFIG) == ((1 + CONFIG.tolerance) * load >= CONFIG.min_gain * step) == tried
        queue = trial_queue("deft", plan, chosen, {}, is_synchronous, CONFIG, lambda o: solve(chosen, "deft", **o),
                            loss_scaled=False)
        assert [why for _, why in queue] == ((["synchronous priority candidate (bytescheduler)",
                                               "synchronous priority candidate (usbyte)"]) if tried else [])


def test_refining_from_the_threads_clocks_reproduces_the_measured_plans():
    """Measurements made by the simulator itself at known factors (compute 1.3x, contention 0.4): the refinement
    from the thread's clocks finds the compute (within the run-queue share it reads at the profile's overlaps)
    and a profile on which the plans' simulated times are the measured ones; the fit from the times alone is
    bounded below by the thread's CPU time."""
    from deft_compile.planner.refine import contention_parts, scaled_profile
    from deft_compile.planner.simulator import simulate

    profile = build_profile("resnet101", gpus=16)
    truth = scaled_profile(profile, 1.3, 1.0, 0.4)
    plans = [solve(profile, policy) for policy in ("wfbp", "bytescheduler", "usbyte")]
    record = {p.hash(): (p, simulate(truth, p, record=False, check=False).iteration_ms) for p in plans}
    cpu = {p.hash(): simulate(truth, p, record=False, check=False).compute_ms for p in plans}
    queue = {p.hash(): 0.4 * contention_parts(truth, p)[1] for p in plans}
    assert thread_ms_of(record, cpu, {}) == [None, None, None]
    result = refine_profile(profile, record, cpu, queue, measure_contention=True, fit_contention=False)
    assert 1.3 <= result.refinement.compute < 1.3 * 1.1 and result.refinement.run_queue_share is not None
    assert result.refinement.error < 0.01 and result.profile.contention == result.refinement.contention
    fitted = refine_profile(profile, record, cpu, queue, measure_contention=False, fit_contention=True)
    assert fitted.refinement.run_queue_share is None and fitted.fitted_contention
    assert fitted.min_compute > 1.0  # the step thread's CPU time bounds the fitted compute


def test_the_preserver_reads_measured_times_and_whether_delays_lost():
    """What the Preserver judges a plan with delays by: the agreed measured times, the synchronous plan's (the pick
    once chosen), whether the loop has settled, and whether a plan with delays lost its duel."""
    record = measured((BUCKETS, 60.0), (PRIORITY, 55.0), (STALE, 45.0))
    times = measured_times(record, is_synchronous, BUCKETS.hash(), "settled", False, CONFIG)
    assert times.plan_ms == {"buckets": 60.0, "priority": 55.0, "stale": 45.0}
    assert times.synchronous_ms == 60.0, "the synchronous plan chosen, not merely the fastest"
    assert times.settled and not times.synchronous_only
    assert times.duel_steps == 2 * CONFIG.duel_rounds * (CONFIG.duel_steps + 1)
    during = measured_times(measured((STALE, 45.0)), is_synchronous, None, "duel", True, CONFIG)
    assert during.synchronous_ms is None and not during.settled and during.synchronous_only


def test_the_rules_are_pure():
    root = pathlib.Path(__file__).resolve().parents[1] / "deft_compile"
    for name in ("planner/closed_loop.py", "planner/refine.py", "planner/link_fit.py", "preserver/decisions.py",
                 "preserver/pricing.py", "preserver/verdict.py", "preserver/trade.py"):
        tree = ast.parse((root / name).read_text())
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert not any(m == "torch" or m.startswith(("torch.", "deft_compile.step")) for m in imported), name
