"""Simulator: hand-computed timelines per policy, invariants, trace format, speed."""

from __future__ import annotations

import dataclasses
import json
import math
import random
import time

import pytest

from deft_compile.planner.plan import (
    CommItem,
    LinkCost,
    ParamProfile,
    ParamSlice,
    Plan,
    Profile,
)
from deft_compile.planner.simulator import BucketScheduleEvaluator, compute_floor_ms, coverage_rate, simulate
from deft_compile.planner.solvers import POLICIES, solve

# Three parameters, ready order p0 (output side, layer 2), p1 (layer 1), p2 (layer 0).
# forward 1 ms and backward 1 ms each; one link: alpha 0.5 ms, beta 0.001 ms/B
#   p0: 1000 float32 = 4000 B -> 4.5 ms;  p1, p2: 250 float32 = 1000 B -> 1.5 ms.
# Forward runs layer 0, 1, 2 (3 ms); backward makes p0, p1, p2 ready 1, 2, 3 ms after it starts.


def three_param_profile(update_ms: float = 0.0) -> Profile:
    params = [ParamProfile("p0", 1000, "float32", 1.0, 1.0, update_ms, layer=2),
              ParamProfile("p1", 250, "float32", 1.0, 1.0, update_ms, layer=1),
              ParamProfile("p2", 250, "float32", 1.0, 1.0, update_ms, layer=0)]
    return Profile(params, [LinkCost("link", 0.5, 0.001)], world_size=2)


def whole(param: int, numel: int) -> tuple[ParamSlice, ...]:
    return (ParamSlice(param, 0, numel),)


def events_of(timeline, program: int) -> dict[int, tuple[float, float]]:
    return {e.item_id: (e.start_ms, e.end_ms) for e in timeline.comm_events() if e.program == program}


def test_wfbp_timeline_by_hand() -> None:
    profile = three_param_profile()
    plan = solve(profile, "wfbp", first_bucket_bytes=1000, bucket_cap_bytes=1000)
    assert [item.slices for item in plan.items] == [whole(0, 1000), whole(1, 250), whole(2, 250)]
    timeline = simulate(profile, plan)
    # step 0: forward 0-3, backward 3-6; p0 ready 4 -> [4, 8.5]; p1 ready 5, link busy -> [8.5, 10];
    # p2 ready 6 -> [10, 11.5]; wait at end of backward until 11.5; next forward at 11.5.
    assert events_of(timeline, 0) == {0: (4.0, 8.5), 1: (8.5, 10.0), 2: (10.0, 11.5)}
    assert timeline.forward_starts[:3] == [0.0, 11.5, 23.0]
    assert timeline.iteration_ms == pytest.approx(11.5)
    assert timeline.compute_ms == pytest.approx(6.0)
    assert timeline.exposed_comm_ms == pytest.approx(5.5)


def test_bytescheduler_timeline_by_hand() -> None:
    profile = three_param_profile()
    plan = solve(profile, "bytescheduler", partition_bytes=1000, credit=1)
    # partitions of 1000 B: p0 -> 4 parts (a..d), p1, p2 one each; priority p2 > p1 > p0 parts.
    # relative to backward start (credit = one partition in flight):
    #   t=1 p0a ready, commit [1, 2.5]; t=2 p1 ready but credit full;
    #   t=2.5 commit p1 [2.5, 4]; t=3 p2 ready, credit full; t=4 commit p2 [4, 5.5];
    #   then p0b [5.5, 7], p0c [7, 8.5], p0d [8.5, 10].
    assert [(item.slices[0].param, item.slices[0].offset) for item in plan.items] == [
        (0, 0), (1, 0), (2, 0), (0, 250), (0, 500), (0, 750)]
    timeline = simulate(profile, plan)
    assert events_of(timeline, 0) == {0: (4.0, 5.5), 1: (5.5, 7.0), 2: (7.0, 8.5),
                                      3: (8.5, 10.0), 4: (10.0, 11.5), 5: (11.5, 13.0)}
    # step 1 starts at 6 (no end-of-backward wait): layer 0 waits for p2 until 8.5 -> 8.5-9.5,
    # layer 1 (p1 done at 7) 9.5-10.5, layer 2 waits for p0d until 13 -> 13-14; backward 14-17.
    # Every step repeats 11 ms later: iteration 11 (vs WFBP's 11.5).
    record = timeline._records[1]
    assert list(record.layer_start) == [8.5, 9.5, 13.0]
    assert record.backward_start == pytest.approx(14.0)
    assert timeline.iteration_ms == pytest.approx(11.0)
    assert plan.metadata["closed_form_iteration_ms"] == pytest.approx(11.0)


def test_usbyte_timeline_by_hand() -> None:
    profile = three_param_profile()
    plan = solve(profile, "usbyte", split_layer=0, scale=1.0)
    # break-even block alpha/beta = 500 B. Relative to backward start:
    #   t=1 p0 ready, next ready event at 2: gap 1 -> (1-0.5)/0.001 = 500 B: p0[0:125] [1, 2];
    #   t=2 p1 ready, next at 3: 500 B more of p0 (ready order first): p0[125:250] [2, 3];
    #   t=3 backward over -> layer order: p2 [3, 4.5], p1 [4.5, 6], rest of p0 (3000 B) [6, 9.5].
    assert [item.slices for item in plan.items] == [
        (ParamSlice(0, 0, 125),), (ParamSlice(0, 125, 125),), whole(2, 250), whole(1, 250),
        (ParamSlice(0, 250, 750),)]
    timeline = simulate(profile, plan)
    assert events_of(timeline, 0) == {0: (4.0, 5.0), 1: (5.0, 6.0), 2: (6.0, 7.5), 3: (7.5, 9.0),
                                      4: (9.0, 12.5)}
    # next forward from 6: layer 0 waits until 7.5 (7.5-8.5), layer 1 until 9 (9-10),
    # layer 2 until 12.5 (12.5-13.5); backward at 13.5 -> iteration 10.5.
    assert timeline.iteration_ms == pytest.approx(10.5)


def delayed_items() -> list[CommItem]:
    """p0 delayed in forward-next, p2 delayed in backward-next, p1 synchronous (test_deft_delayed_timeline_by_hand)."""
    after = "before-update-next-step"
    return [CommItem(0, whole(0, 1000), window="forward-next", delay=1, order=0, wait_at=after,
                     update_at="next-step", bucket=0),
            CommItem(1, whole(2, 250), window="backward-next", delay=1, order=1, wait_at=after,
                     update_at="next-step", bucket=2),
            CommItem(2, whole(1, 250), order=2, bucket=1)]


def test_deft_delayed_timeline_by_hand() -> None:
    profile = three_param_profile(update_ms=0.25)
    items = delayed_items()
    plan = Plan("deft", items)
    timeline = simulate(profile, plan)
    # step 0: forward 0-3, backward 3-6; only p1 (sync) communicates: ready 5 -> [5, 6.5];
    #   wait 6.5, its update 6.5-6.75; delayed buckets have nothing to apply yet -> step 1 at 6.75.
    # step 1: forward 6.75-9.75, backward 9.75-12.75.
    #   p0 (grad of step 0) issued at forward start: [6.75, 11.25]
    #   p2 (grad of step 0) issued at backward start, link busy: [11.25, 12.75]
    #   p1 (grad of step 1) ready 11.75, link busy: [12.75, 14.25]
    #   wait p1 -> 14.25, sync update -> 14.5; delayed ones long done; delayed updates -> 15.0
    assert events_of(timeline, 0) == {2: (5.0, 6.5)}
    assert events_of(timeline, 1) == {0: (6.75, 11.25), 1: (11.25, 12.75), 2: (12.75, 14.25)}
    assert timeline.forward_starts[:4] == [0.0, 6.75, 15.0, 23.25]
    assert timeline.iteration_ms == pytest.approx(8.25)
    assert timeline.compute_ms == pytest.approx(6.75)
    steps = {e.item_id: e.step for e in timeline.comm_events() if e.program == 1}
    assert steps == {0: 0, 1: 0, 2: 1}


def test_period_timeline_by_hand() -> None:
    params = [ParamProfile("p0", 1000, "float32", 1.0, 1.0, 0.0, layer=1),
              ParamProfile("p1", 250, "float32", 1.0, 1.0, 0.0, layer=0)]
    profile = Profile(params, [LinkCost("link", 0.5, 0.001)])
    items = [CommItem(0, whole(0, 1000), order=0, period=2, period_offset=0, bucket=0),
             CommItem(1, whole(1, 250), order=1, bucket=1)]
    timeline = simulate(profile, Plan("deft", items), iterations=4)
    # even steps: forward 2, backward 2; p0 [3, 7.5], p1 ready 4 -> [7.5, 9]: step takes 9 ms.
    # odd steps: p0 skipped (accumulates); p1 ready at end of backward (+4) -> +5.5: 5.5 ms.
    # mean over the 2-step cycle: 7.25 ms; compute floor 4 ms.
    starts = timeline.forward_starts
    assert [starts[i + 1] - starts[i] for i in range(4)] == [9.0, 5.5, 9.0, 5.5]
    assert timeline.iteration_ms == pytest.approx(7.25)
    assert timeline.floor_ms == pytest.approx(4.0)
    assert timeline.measured[1] - timeline.measured[0] == 4


def test_two_links_run_in_parallel() -> None:
    params = [ParamProfile("p0", 1000, "float32", 1.0, 1.0, 0.0, layer=0)]
    profile = Profile(params, [LinkCost("a", 0.5, 0.001), LinkCost("b", 0.5, 0.002)])
    items = [CommItem(0, (ParamSlice(0, 0, 600),), link=0, order=0),
             CommItem(1, (ParamSlice(0, 600, 400),), link=1, order=1)]
    timeline = simulate(profile, Plan("deft", items))
    # both shares start at ready (2): link a 2400 B -> 2.9 ms, link b 1600 B -> 3.7 ms
    events = events_of(timeline, 0)
    assert events[0] == pytest.approx((2.0, 4.9)) and events[1] == pytest.approx((2.0, 5.7))
    assert timeline.iteration_ms == pytest.approx(5.7)
    assert timeline.link_busy_ms == pytest.approx([2.9, 3.7])


def random_profile(rng: random.Random, links: int = 1, zero_cost: bool = False) -> Profile:
    n = rng.randint(2, 30)
    params = []
    for i in range(n):
        numel = rng.randint(1, 400_000)
        params.append(ParamProfile(f"p{i}", numel, "float32", rng.uniform(0.0, 1.0),
                                   rng.uniform(0.0, 2.0), rng.uniform(0.0, 0.05), layer=n - 1 - i))
    costs = [LinkCost(f"l{j}", 0.0 if zero_cost else rng.uniform(0.0, 0.3),
                      0.0 if zero_cost else rng.uniform(1e-7, 4e-6)) for j in range(links)]
    return Profile(params, costs, world_size=4, extra_forward_ms=rng.uniform(0, 1),
                   extra_backward_ms=rng.uniform(0, 1))


BUCKETS = {"first_bucket_bytes": 200_000, "bucket_cap_bytes": 1_000_000}


def solve_small(profile: Profile, policy: str):
    return solve(profile, policy, **(BUCKETS if policy in ("wfbp", "deft") else {}))


def test_iteration_never_beats_the_compute_floor() -> None:
    rng = random.Random(3)
    for _ in range(25):
        profile = random_profile(rng, links=rng.choice([1, 2]))
        for policy in POLICIES:
            plan = solve_small(profile, policy)
            timeline = simulate(profile, plan)
            assert timeline.floor_ms == pytest.approx(compute_floor_ms(profile, plan))
            assert timeline.iteration_ms >= timeline.floor_ms - 1e-9
            assert timeline.compute_ms == pytest.approx(timeline.floor_ms)
            assert timeline.exposed_comm_ms == pytest.approx(timeline.iteration_ms - timeline.compute_ms,
                                                             abs=1e-9)


def test_free_links_reach_the_floor_for_every_policy() -> None:
    rng = random.Random(4)
    for _ in range(15):
        profile = random_profile(rng, zero_cost=True)
        for policy in POLICIES:
            timeline = simulate(profile, solve_small(profile, policy))
            assert timeline.iteration_ms == pytest.approx(timeline.floor_ms)
            assert timeline.exposed_comm_ms == pytest.approx(0.0, abs=1e-9)


def test_slower_link_never_helps_wfbp() -> None:
    rng = random.Random(5)
    for _ in range(20):
        profile = random_profile(rng)
        plan = solve_small(profile, "wfbp")
        fast = simulate(profile, plan).iteration_ms
        slow_link = LinkCost("slow", profile.links[0].alpha_ms * 2, profile.links[0].beta_ms_per_byte * 2)
        slow = Profile(profile.params, [slow_link], profile.world_size, profile.extra_forward_ms,
                       profile.extra_backward_ms)
        assert simulate(slow, plan).iteration_ms >= fast - 1e-9


def test_evaluator_matches_simulate() -> None:
    rng = random.Random(6)
    profile = random_profile(rng)
    plan = solve_small(profile, "deft")
    n = len(plan.items)
    group = list(range(n))
    evaluator = BucketScheduleEvaluator(profile, plan, group)
    import numpy as np
    window = np.array([{"forward-next": 0, "backward-next": 1, "backward": 2}[i.window] for i in plan.items])
    value = evaluator.iteration_ms(window, np.array([i.delay for i in plan.items]),
                                   np.array([i.period for i in plan.items]),
                                   np.array([i.period_offset for i in plan.items]),
                                   np.array([i.order for i in plan.items]), iterations=6)
    assert value == pytest.approx(simulate(profile, plan, iterations=6, warmup=None).iteration_ms,
                                  rel=1e-6)


def test_chrome_trace_is_valid_json_with_complete_events() -> None:
    profile = three_param_profile(update_ms=0.25)
    plan = solve(profile, "bytescheduler", partition_bytes=1000, credit=1)
    trace = simulate(profile, plan).to_chrome_trace()
    parsed = json.loads(json.dumps(trace))
    spans = [e for e in parsed["traceEvents"] if e["ph"] == "X"]
    assert spans and all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    assert all(isinstance(e["pid"], int) and isinstance(e["tid"], int) for e in spans)
    comm = [e for e in spans if e["cat"] == "comm"]
    assert comm[0]["ts"] == pytest.approx(4000.0) and comm[0]["dur"] == pytest.approx(1500.0)
    kinds = {e["cat"] for e in spans}
    assert {"forward", "backward", "update", "comm"} <= kinds


def test_coverage_rate_counts_period() -> None:
    profile = three_param_profile()
    plan = solve(profile, "wfbp", first_bucket_bytes=1000, bucket_cap_bytes=1000)
    # comm 4.5 + 1.5 + 1.5 = 7.5 ms over T_F + T_B = 6 ms
    assert coverage_rate(profile, plan) == pytest.approx(7.5 / 6)


def test_simulating_500_buckets_is_fast() -> None:
    rng = random.Random(8)
    params = [ParamProfile(f"p{i}", rng.randint(300_000, 1_000_000), "float32", 0.05, 0.1, 0.001,
                           layer=499 - i) for i in range(500)]
    profile = Profile(params, [LinkCost("l", 0.02, 5e-8)])
    plan = solve(profile, "wfbp", first_bucket_bytes=1 << 20, bucket_cap_bytes=1 << 20)
    assert len(plan.items) == 500
    simulate(profile, plan, record=False)
    start = time.perf_counter()
    timeline = simulate(profile, plan, record=False, check=False)
    per_iteration = (time.perf_counter() - start) / timeline.measured[1]
    assert per_iteration < 0.025  # target 5 ms; loose here, benchmarks/planner_speed.py measures


def test_update_waiting_for_every_gradient_is_simulated() -> None:
    """With clipping or loss scaling the synchronous update waits for the delayed buckets of the previous step
    too (``update_waits_for_all``): a delayed all-reduce that outlasts forward and backward then shows."""
    from deft_compile.planner.plan import UPDATE_AT_NEXT_STEP, UPDATE_AT_STEP, WAIT_BEFORE_NEXT_UPDATE, WAIT_END_OF_BACKWARD
    from deft_compile.planner.plan import WINDOW_BACKWARD, WINDOW_FORWARD_NEXT

    profile = three_param_profile(update_ms=0.5)
    # p0 delayed on a slow second link (its all-reduce 12.5 ms outlasts forward + backward), p1 and p2
    # synchronous on the fast first link: only the update-waits-for-all rule makes p0's wait show.
    slow = dataclasses.replace(profile, links=[LinkCost("fast", 0.5, 0.001), LinkCost("slow", 0.5, 0.003)])
    items = [
        CommItem(0, whole(0, 1000), link=1, window=WINDOW_FORWARD_NEXT, wait_at=WAIT_BEFORE_NEXT_UPDATE,
                 update_at=UPDATE_AT_NEXT_STEP, delay=1),
        CommItem(1, whole(1, 250) + whole(2, 250), window=WINDOW_BACKWARD, wait_at=WAIT_END_OF_BACKWARD,
                 update_at=UPDATE_AT_STEP, order=1),
    ]
    plain = Plan("deft", items)
    waiting = Plan("deft", items, options={"update_waits_for_all": True})
    base, clipped = simulate(slow, plain), simulate(slow, waiting)
    assert clipped.iteration_ms > base.iteration_ms
    # the planner's prediction carries the option through solve()
    solved = solve(slow, "deft", update_waits_for_all=True)
    assert solved.options["update_waits_for_all"] is True
    assert solved.predicted_iteration_ms >= solve(slow, "deft").predicted_iteration_ms - 1e-9


def test_message_cpu_cost_by_hand() -> None:
    """``message_cpu_ms`` is the compute thread's time per collective: 0.5 ms per launch in the backward
    delays the gradients after it and each later launch. wfbp's timeline by hand with it:
    backward 3-7.5: p0 ready 4, launched 4-4.5 -> link [4.5, 9]; p1 ready 5.5 (1 ms of backward after the
    launch), launched -> 6 -> link [9, 10.5]; p2 ready 7 + 0.5 -> link [10.5, 12]; next forward at 12."""
    profile = dataclasses.replace(three_param_profile(), message_cpu_ms=0.5)
    plan = solve(profile, "wfbp", first_bucket_bytes=1000, bucket_cap_bytes=1000)
    timeline = simulate(profile, plan)
    assert events_of(timeline, 0) == {0: (4.5, 9.0), 1: (9.0, 10.5), 2: (10.5, 12.0)}
    assert timeline.iteration_ms == pytest.approx(12.0)
    assert timeline.compute_ms == pytest.approx(7.5)
    # many small messages cost the compute thread; the same bytes in one message do not
    free = dataclasses.replace(profile, links=[LinkCost("free", 0.0, 0.0)])
    split = solve(free, "bytescheduler", partition_bytes=100, credit=1)
    assert len(split.items) > 10
    assert simulate(free, split).iteration_ms == pytest.approx(6.0 + 0.5 * len(split.items))
    assert Profile.from_json(profile.to_json()).message_cpu_ms == 0.5
    with pytest.raises(ValueError):
        dataclasses.replace(profile, message_cpu_ms=-1.0)


def test_evaluator_matches_simulate_with_message_cpu_cost() -> None:
    import numpy as np

    rng = random.Random(6)
    profile = dataclasses.replace(random_profile(rng), message_cpu_ms=0.2)
    plan = solve_small(profile, "deft")
    evaluator = BucketScheduleEvaluator(profile, plan, list(range(len(plan.items))))
    window = np.array([{"forward-next": 0, "backward-next": 1, "backward": 2}[i.window] for i in plan.items])
    value = evaluator.iteration_ms(window, np.array([i.delay for i in plan.items]),
                                   np.array([i.period for i in plan.items]),
                                   np.array([i.period_offset for i in plan.items]),
                                   np.array([i.order for i in plan.items]), iterations=6)
    assert value == pytest.approx(simulate(profile, plan, iterations=6, warmup=None).iteration_ms, rel=1e-6)
    free = dataclasses.replace(profile, message_cpu_ms=0.0)
    assert value > simulate(free, plan, iterations=6, warmup=None).iteration_ms


def test_contention_charges_the_communication_that_overlaps_compute_by_hand() -> None:
    """``Profile.contention`` γ: each ms a collective overlaps the compute stream costs γ ms more per step.
    wfbp by hand (test_wfbp_timeline_by_hand): compute 0-6 per step, collectives [4, 8.5], [8.5, 10],
    [10, 11.5]: 2 ms overlap (4-6), the rest is exposed: 11.5 + 0.5 x 2 = 12.5. DeFT's delayed plan
    (test_deft_delayed_timeline_by_hand): [6.75, 11.25] lies in the forward and backward (4.5 ms),
    [11.25, 12.75] in the backward (1.5 ms), [12.75, 14.25] while the step waits for it (0 ms):
    8.25 + 0.5 x 6 = 11.25. Hiding communication gains less where it costs compute."""
    profile = dataclasses.replace(three_param_profile(), contention=0.5)
    plan = solve(profile, "wfbp", first_bucket_bytes=1000, bucket_cap_bytes=1000)
    timeline = simulate(profile, plan)
    assert timeline.contention_ms == pytest.approx(1.0)
    assert timeline.iteration_ms == pytest.approx(12.5)
    assert timeline.exposed_comm_ms == pytest.approx(6.5)

    items = delayed_items()
    delayed = dataclasses.replace(three_param_profile(update_ms=0.25), contention=0.5)
    timeline = simulate(delayed, Plan("deft", items))
    assert timeline.contention_ms == pytest.approx(3.0)
    assert timeline.iteration_ms == pytest.approx(11.25)


def test_no_contention_leaves_every_policy_as_it_was_and_it_never_helps() -> None:
    rng = random.Random(11)
    for _ in range(5):
        profile = random_profile(rng)
        for policy in ("wfbp", "bytescheduler", "usbyte", "deft"):
            plan = solve_small(profile, policy)
            plain = simulate(profile, plan)
            assert plain.contention_ms == 0.0
            contended = simulate(dataclasses.replace(profile, contention=0.4), plan)
            assert contended.iteration_ms >= plain.iteration_ms - 1e-9
            # at most γ x the link's busy time, at most γ x the compute time
            bound = 0.4 * min(sum(plain.link_busy_ms), plain.compute_ms)
            assert contended.contention_ms <= bound + 1e-6, (policy, contended.contention_ms, bound)


def test_contention_is_saved_and_checked() -> None:
    profile = dataclasses.replace(three_param_profile(), contention=0.25)
    assert Profile.from_json(profile.to_json()).contention == 0.25
    assert Profile.from_dict({k: v for k, v in three_param_profile().to_dict().items() if k != "contention"}).contention == 0.0
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="contention"):
            dataclasses.replace(profile, contention=bad)


def test_scaled_simulation_equals_simulating_the_scaled_profile_to_the_bit() -> None:
    """The closed loop's refinement simulates each measured plan at hundreds of (compute, link, latency) factors:
    ``ScaledSimulation`` flattens the plan once and must give exactly what scaling the profile and simulating it
    gives, for plans with delays, priorities, per-layer waits and update periods, on one link and on two."""
    from deft_compile.planner.refine import scaled_profile
    from deft_compile.planner.simulator import ScaledSimulation
    from deft_compile.planner.solvers import solve
    from deft_compile.planner.zoo_profiles import build_profile

    for name, extra_link in (("gpt2", 0.0), ("resnet101", 10.0)):
        profile = build_profile(name, inter_gbps=25, extra_link_gbps=extra_link)
        plans = [solve(profile, policy) for policy in ("deft", "wfbp", "bytescheduler", "usbyte")]
        assert any(item.delay for item in plans[0].items) or any(item.period > 1 for item in plans[0].items)
        for plan in plans:
            simulation = ScaledSimulation(profile, plan)
            for compute, link, latency, contention in ((1.0, 1.0, None, None), (1.3, 0.7, None, 1.0),
                                                        (0.9, 1.5, 0.6, 0.4), (2 ** 0.125, 1 / 3, 1.7, 0.0)):
                scaled = scaled_profile(profile, compute, link, contention, latency=latency)
                expected = simulate(scaled, plan, record=False, check=False)
                got = simulation.run(compute, link, latency, contention)
                for key in ("iteration_ms", "compute_ms", "floor_ms", "exposed_comm_ms", "contention_ms"):
                    assert getattr(got, key) == getattr(expected, key), (name, plan.policy, compute, link, key)
                assert got.link_busy_ms == expected.link_busy_ms


def test_the_refinement_simulates_a_plan_once_per_link_to_compute_ratio() -> None:
    """Every time the simulator forms is a sum or a maximum of compute and link times, so scaling both by ``a``
    scales the step and its overlap by ``a``: ``scaled_parts`` simulates a plan once per ratio ``link / compute``
    and multiplies. Its parts equal ``contention_parts`` of the scaled profile to round-off (plans with delays,
    priorities, per-layer waits and periods, one link and two, message CPU time), and ``refine_scales``'s three
    grids (up to 169, 81 and 81 points) run one simulation per ratio, at most 25 + 17 + 17."""
    import dataclasses

    from deft_compile.planner import refine
    from deft_compile.planner.refine import contention_parts, scaled_parts, scaled_profile
    from deft_compile.planner.simulator import ScaledSimulation
    from deft_compile.planner.solvers import solve
    from deft_compile.planner.zoo_profiles import build_profile

    for name, extra_link in (("gpt2", 0.0), ("resnet101", 10.0)):
        profile = dataclasses.replace(build_profile(name, inter_gbps=25, extra_link_gbps=extra_link),
                                      message_cpu_ms=0.05)
        parts = scaled_parts(profile)
        for plan in [solve(profile, policy) for policy in ("deft", "wfbp", "bytescheduler", "usbyte")]:
            for compute, link in ((1.0, 1.0), (1.3, 0.7), (0.4, 2.5), (2 ** 0.125, 1 / 3), (8.0, 8.0)):
                expected = contention_parts(scaled_profile(profile, compute, link), plan)
                got = parts(plan, compute, link)
                for a, b in zip(got, expected):
                    assert math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-12), (name, plan.policy, compute, link)

    runs = []
    original = ScaledSimulation.run

    def counted(self, *args, **kwargs):
        runs.append(args)
        return original(self, *args, **kwargs)

    profile = build_profile("gpt2", inter_gbps=25)
    plan = solve(profile, "deft")
    measured = [(plan, contention_parts(scaled_profile(profile, 1.5, 2.0), plan)[0])]
    ScaledSimulation.run = counted
    try:
        refine.refine_scales(measured, scaled_parts(profile), contention=0.0, fit_link=True)
    finally:
        ScaledSimulation.run = original
    # three grids of up to 169, 81 and 81 points, one simulation per ratio bin, each at compute 1
    assert all(args[0] == 1.0 for args in runs)
    bins = {round(math.log(args[1]) / refine.RATIO_RESOLUTION) for args in runs}
    assert len(runs) == len(bins) <= 25 + 2 * 17, (len(runs), len(bins))
