"""Solvers: coverage, determinism, DeFT never slower than WFBP, reductions, CLI, zoo profiles."""

from __future__ import annotations

import argparse
import json
import random

import numpy as np
import pytest

from deft_compile.tools import simulate as cli_simulate
from deft_compile.planner.plan import LinkCost, ParamProfile, Plan, Profile
from deft_compile.planner.simulator import coverage_rate, simulate
from deft_compile.planner.solvers import POLICIES, SCHEDULING_POLICIES, solve
from deft_compile.planner.solvers.deft import link_shares
from deft_compile.planner.zoo_profiles import build_profile, model_summary

BUCKETS = {"first_bucket_bytes": 200_000, "bucket_cap_bytes": 1_000_000}


def random_profile(seed: int, links: int = 1, dtypes: bool = False) -> Profile:
    rng = random.Random(seed)
    n = rng.randint(2, 40)
    params = []
    for i in range(n):
        dtype = rng.choice(["float32", "float32", "bfloat16"]) if dtypes else "float32"
        params.append(ParamProfile(f"p{i}", rng.randint(1, 500_000), dtype, rng.uniform(0.0, 1.0),
                                   rng.uniform(0.0, 2.0), rng.uniform(0.0, 0.05), layer=n - 1 - i))
    costs = [LinkCost(f"l{j}", rng.uniform(0.0, 0.3), rng.uniform(1e-7, 5e-6)) for j in range(links)]
    return Profile(params, costs, world_size=8, extra_forward_ms=rng.uniform(0, 1),
                   extra_backward_ms=rng.uniform(0, 1))


def solve_with_buckets(profile: Profile, policy: str, **options) -> Plan:
    if policy in ("wfbp", "deft"):
        options = {**BUCKETS, **options}
    return solve(profile, policy, **options)


def carried_counts(profile: Profile, plan: Plan) -> list[np.ndarray]:
    """How often each element is carried, computed without Plan.validate."""
    counts = [np.zeros(p.numel, dtype=np.int64) for p in profile.params]
    for item in plan.items:
        for s in item.slices:
            counts[s.param][s.offset:s.offset + s.count] += 1
    return counts


@pytest.mark.parametrize("policy", POLICIES)
def test_every_element_is_carried_exactly_once(policy: str) -> None:
    for seed in range(12):
        profile = random_profile(seed, links=1 + seed % 2, dtypes=seed % 3 == 0)
        plan = solve_with_buckets(profile, policy)
        plan.validate(profile)
        assert all((c == 1).all() for c in carried_counts(profile, plan))
        for item in plan.items:  # one dtype per collective
            assert len({profile.params[s.param].dtype for s in item.slices}) == 1


@pytest.mark.parametrize("policy", POLICIES)
def test_solving_is_deterministic_and_round_trips(policy: str) -> None:
    profile = random_profile(42, links=2)
    first = solve_with_buckets(profile, policy)
    second = solve_with_buckets(Profile.from_json(profile.to_json()), policy)
    assert first.hash() == second.hash()
    assert first == second
    assert Plan.from_json(first.to_json()) == first
    assert first.predicted_iteration_ms == pytest.approx(simulate(profile, first).iteration_ms)


def test_deft_is_never_slower_than_wfbp_on_random_profiles() -> None:
    for seed in range(100):
        profile = random_profile(1000 + seed, links=1 + seed % 2)
        wfbp = simulate(profile, solve_with_buckets(profile, "wfbp")).iteration_ms
        deft_plan = solve_with_buckets(profile, "deft")
        deft = simulate(profile, deft_plan).iteration_ms
        assert deft <= wfbp + 1e-9, seed


def test_deft_without_staleness_is_wfbp() -> None:
    for seed in range(20):
        profile = random_profile(2000 + seed, links=2)
        wfbp = solve_with_buckets(profile, "wfbp")
        deft = solve_with_buckets(profile, "deft", max_staleness=0)
        assert deft.communication() == wfbp.communication()
        assert [i.bucket for i in deft.items] == [i.bucket for i in wfbp.items]
        assert all(i.delay == 0 and i.period == 1 and i.window == "backward" for i in deft.items)
        assert deft.predicted_iteration_ms == pytest.approx(wfbp.predicted_iteration_ms)


def test_deft_keeps_ddp_buckets_and_their_order() -> None:
    for seed in range(20):
        profile = random_profile(3000 + seed, links=1 + seed % 2)
        buckets = profile.buckets(**BUCKETS)
        plan = solve_with_buckets(profile, "deft")
        by_bucket: dict[int, list] = {}
        for item in plan.items:
            by_bucket.setdefault(item.bucket, []).extend(item.slices)
        for b, bucket in enumerate(buckets):  # a bucket's shares together are exactly the bucket
            params = [s.param for s in by_bucket[b]]
            assert sorted(set(params)) == sorted(bucket)
            assert sum(s.count for s in by_bucket[b]) == sum(profile.params[p].numel for p in bucket)
            kinds = {(i.window, i.delay, i.period, i.period_offset) for i in plan.items if i.bucket == b}
            assert len(kinds) == 1  # all shares of a bucket share one schedule
        for window in ("forward-next", "backward-next", "backward"):
            order = [i.bucket for i in plan.items if i.window == window]
            assert order == sorted(order)  # DDP order inside every window, never reordered


def test_deft_delays_when_backward_cannot_hide_the_last_buckets() -> None:
    # 4 equal buckets ready at 1, 2, 3, 4 ms of backward, each 1.5 ms of comm; forward 4 ms.
    params = [ParamProfile(f"p{i}", 250_000, "float32", 1.0, 1.0, 0.0, layer=3 - i) for i in range(4)]
    profile = Profile(params, [LinkCost("l", 0.5, 1e-6)])
    options = {"first_bucket_bytes": 1_000_000, "bucket_cap_bytes": 1_000_000}
    wfbp = solve(profile, "wfbp", **options)
    deft = solve(profile, "deft", **options)
    assert any(item.delay == 1 for item in deft.items)
    assert deft.predicted_iteration_ms < wfbp.predicted_iteration_ms
    # with period off, a prohibitive staleness price keeps everything synchronous
    priced = solve(profile, "deft", staleness_penalty_ms=100.0, allow_period=False, **options)
    assert all(item.delay == 0 for item in priced.items)
    assert priced.communication() == wfbp.communication()


def test_staleness_prices_trade_delays_bucket_by_bucket() -> None:
    """Per-parameter prices (the Preserver's trade): zero prices change nothing; a price above the time a
    bucket's delay hides keeps that bucket synchronous while cheaper ones stay delayed; the chosen plan's
    predicted time plus its price never exceeds WFBP's time."""
    params = [ParamProfile(f"p{i}", 250_000, "float32", 1.0, 1.0, 0.0, layer=3 - i) for i in range(4)]
    profile = Profile(params, [LinkCost("l", 0.5, 1e-6)])
    options = {"first_bucket_bytes": 1_000_000, "bucket_cap_bytes": 1_000_000}
    wfbp = solve(profile, "wfbp", **options)
    options["allow_period"] = False
    free = solve(profile, "deft", **options)
    assert solve(profile, "deft", staleness_prices={"p0": 0.0}, **options).items == free.items
    delayed = {item.bucket for item in free.items if item.delay}
    assert len(delayed) >= 2
    expensive = max(delayed)
    bucket_of = {s.param: item.bucket for item in free.items for s in item.slices}
    expensive_param = next(f"p{p}" for p, b in bucket_of.items() if b == expensive)
    priced = solve(profile, "deft", staleness_prices={expensive_param: 50.0}, **options)
    assert expensive not in {item.bucket for item in priced.items if item.delay}
    assert any(item.delay for item in priced.items), "the unpriced buckets are still delayed"
    assert priced.predicted_iteration_ms + priced.metadata["staleness_price_ms"] <= wfbp.predicted_iteration_ms
    everything = solve(profile, "deft", staleness_prices={f"p{i}": 50.0 for i in range(4)}, **options)
    assert not any(item.delay for item in everything.items)


def test_priced_buckets_get_no_period() -> None:
    """A period skips updates: priced by ``update_prices`` above the communication it saves, no bucket gets one;
    priced low, the period stays."""
    params = [ParamProfile(f"p{i}", 1_000_000, "float32", 1.0, 1.0, 0.0, layer=7 - i) for i in range(8)]
    profile = Profile(params, [LinkCost("l", 0.1, 1e-6)])  # 4 ms per bucket, 32 ms vs 16 ms compute
    options = {"first_bucket_bytes": 4_000_000, "bucket_cap_bytes": 4_000_000, "max_staleness": 1}
    periodic = solve(profile, "deft", **options)
    assert any(item.period > 1 for item in periodic.items)
    dear = solve(profile, "deft", update_prices={f"p{i}": 10.0 for i in range(8)}, **options)
    assert all(item.period == 1 for item in dear.items)  # above every bucket's 4 ms of communication
    cheap = solve(profile, "deft", update_prices={f"p{i}": 0.01 for i in range(8)}, **options)
    assert any(item.period > 1 for item in cheap.items)
    assert cheap.metadata["staleness_price_ms"] > 0
    stale = solve(profile, "deft", staleness_prices={f"p{i}": 10.0 for i in range(8)}, **options)
    assert all(item.period == 1 and item.delay == 0 for item in stale.items)


def test_a_period_pays_where_the_gradients_are_noisy() -> None:
    """The same update prices refuse a period with exact gradients and buy one where the measured noise ratio says
    a mean of K gradients is worth nearly K updates (``update_noise``); the noise ratios are plan options."""
    params = [ParamProfile(f"p{i}", 1_000_000, "float32", 1.0, 1.0, 0.0, layer=7 - i) for i in range(8)]
    profile = Profile(params, [LinkCost("l", 0.1, 1e-6)])  # 4 ms per bucket, 32 ms vs 16 ms compute
    options = {"first_bucket_bytes": 4_000_000, "bucket_cap_bytes": 4_000_000, "max_staleness": 1,
               "update_prices": {f"p{i}": 2.0 for i in range(8)}}  # all of them: the compute step
    exact = solve(profile, "deft", **options)
    assert all(item.period == 1 for item in exact.items), exact.table(profile)
    noisy = solve(profile, "deft", update_noise={f"p{i}": 5.0 for i in range(8)}, **options)
    assert any(item.period > 1 for item in noisy.items), noisy.table(profile)
    assert noisy.options["update_noise"] == {f"p{i}": 5.0 for i in range(8)}
    assert noisy.predicted_iteration_ms < exact.predicted_iteration_ms
    assert "update_noise" not in exact.options and exact.hash() != noisy.hash()


def test_a_bucket_larger_than_either_phase_is_still_delayed() -> None:
    """One large bucket whose communication exceeds T_F and T_B alone but not their sum: the knapsacks cannot place
    it, the whole-suffix candidate delays it from the start of the next forward, and the simulator keeps it."""
    params = [ParamProfile("small", 1000, "float32", 0.5, 0.5, 0.0, layer=1),
              ParamProfile("big", 1_500_000, "float32", 4.0, 4.0, 0.0, layer=0)]
    profile = Profile(params, [LinkCost("l", 0.1, 1.0e-6)])  # big: 6.1 ms of comm; T_F = T_B = 4.5 ms
    options = {"first_bucket_bytes": 4000, "bucket_cap_bytes": 4000, "allow_period": False}
    wfbp = solve(profile, "wfbp", first_bucket_bytes=4000, bucket_cap_bytes=4000)
    assert len(wfbp.items) == 2
    deft = solve(profile, "deft", **options)
    big = next(item for item in deft.items if any(s.param == 1 for s in item.slices))
    assert big.delay == 1 and big.window == "forward-next", deft.table(profile)
    assert deft.predicted_iteration_ms < wfbp.predicted_iteration_ms


def test_deft_uses_a_period_when_coverage_stays_above_one() -> None:
    params = [ParamProfile(f"p{i}", 1_000_000, "float32", 1.0, 1.0, 0.0, layer=7 - i) for i in range(8)]
    profile = Profile(params, [LinkCost("l", 0.1, 1e-6)])  # 4 ms per bucket, 32 ms vs 16 ms compute
    options = {"first_bucket_bytes": 4_000_000, "bucket_cap_bytes": 4_000_000}
    plan = solve(profile, "deft", max_period=4, **options)
    no_period = solve(profile, "deft", allow_period=False, **options)
    assert coverage_rate(profile, no_period) > 1
    assert max(item.period for item in plan.items) >= 2
    assert coverage_rate(profile, plan) < 1
    assert plan.predicted_iteration_ms < no_period.predicted_iteration_ms
    assert plan.metadata["period"] == min(k for k in range(2, 5) if 32 / k <= 16 / 1.1 or k == 4)


def test_kept_synchronous_buckets_are_never_delayed_or_periodic() -> None:
    """``keep_synchronous`` (the Preserver's pinning) removes named buckets from both knapsacks and from
    the period choice; the solver still delays or periodises the others when that pays."""
    params = [ParamProfile(f"p{i}", 1_000_000, "float32", 1.0, 1.0, 0.0, layer=7 - i) for i in range(8)]
    profile = Profile(params, [LinkCost("l", 0.1, 1e-6)])
    options = {"first_bucket_bytes": 4_000_000, "bucket_cap_bytes": 4_000_000}
    free = solve(profile, "deft", max_period=4, **options)
    touched = [i for i in free.items if i.delay or i.period > 1]
    assert touched, "the unconstrained plan delays or periodises"
    pinned_names = [params[s.param].name for s in touched[0].slices] + ["p7*"]
    pinned = solve(profile, "deft", max_period=4, keep_synchronous=pinned_names, **options)
    assert pinned.options["keep_synchronous"] == sorted(pinned_names)
    for item in pinned.items:
        names = {params[s.param].name for s in item.slices}
        if names & set(pinned_names) or "p7" in names:
            assert item.delay == 0 and item.period == 1, item
    assert any(i.delay or i.period > 1 for i in pinned.items), "the other buckets still get delays / periods"
    everything = solve(profile, "deft", keep_synchronous=["p*"], **options)
    assert all(i.delay == 0 and i.period == 1 for i in everything.items)


def test_deft_splits_large_buckets_over_two_links() -> None:
    params = [ParamProfile(f"p{i}", 1_000_000, "float32", 1.0, 2.0, 0.0, layer=3 - i) for i in range(4)]
    links = [LinkCost("fast", 0.05, 1e-6), LinkCost("slow", 0.1, 2e-6)]
    profile = Profile(params, links)
    options = {"first_bucket_bytes": 4_000_000, "bucket_cap_bytes": 4_000_000}
    both = solve(profile, "deft", allow_period=False, **options)
    one = solve(profile, "deft", allow_period=False, links=[0], **options)
    assert {item.link for item in both.items} == {0, 1}
    assert {item.link for item in one.items} == {0}
    assert both.predicted_iteration_ms < one.predicted_iteration_ms


def test_link_shares_end_together_and_skip_tiny_buckets() -> None:
    links = [LinkCost("a", 0.1, 1e-6), LinkCost("b", 0.1, 2e-6)]
    shares = link_shares(3_000_000, 4, links, [0, 1])
    assert sum(c for _, c in shares) == 3_000_000
    times = [links[l].cost(c * 4) for l, c in shares]
    assert max(times) - min(times) < 1e-3
    assert link_shares(10, 4, links, [0, 1]) == [(0, 10)]


@pytest.mark.parametrize("policy", ["bytescheduler", "usbyte"])
def test_per_layer_closed_form_matches_simulator(policy: str) -> None:
    for seed in range(10):
        profile = random_profile(4000 + seed)
        plan = solve(profile, policy)
        assert plan.metadata["closed_form_iteration_ms"] == pytest.approx(
            simulate(profile, plan, iterations=4).iteration_ms, rel=1e-9)


def test_bytescheduler_search_is_at_least_as_good_as_its_grid_neighbours() -> None:
    profile = random_profile(77)
    plan = solve(profile, "bytescheduler")
    evaluated = {(s, c): t for s, c, t in plan.metadata["evaluated"]}
    assert plan.predicted_iteration_ms == pytest.approx(min(evaluated.values()))


def test_usbyte_sends_leftovers_in_layer_order_after_backward() -> None:
    profile = random_profile(99)
    plan = solve(profile, "usbyte")
    timeline = simulate(profile, plan)
    record = timeline._records[0]
    ends = {e.item_id: e for e in timeline.comm_events() if e.program == 0}
    late = [item for item in plan.items if ends[item.id].start_ms >= record.backward_end - 1e-9
            and item.order > 0]
    layers = [min(profile.params[s.param].layer for s in item.slices) for item in late]
    assert layers == sorted(layers)


def test_unknown_policy_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown policy"):
        solve(random_profile(1), "horovod")


# --- paper-scale profiles and the CLI ------------------------------------------------


@pytest.mark.parametrize("model, params", [("resnet101", 44_549_160), ("vgg19", 143_667_240),
                                           ("gpt2", 124_439_808)])
def test_zoo_profiles_have_the_exact_parameter_counts(model: str, params: int) -> None:
    profile = build_profile(model)
    summary = model_summary(profile)
    assert summary["params"] == params
    assert summary["backward_ms"] == pytest.approx(2 * summary["forward_ms"])
    # gradient-ready order is output side first
    assert profile.params[0].layer == max(p.layer for p in profile.params)
    assert profile.params[-1].layer == 0


@pytest.mark.parametrize("model", ["resnet101", "vgg19", "gpt2"])
def test_deft_beats_the_baselines_on_the_paper_profiles(model: str) -> None:
    profile = build_profile(model, gpus=16)
    times = {p: solve(profile, p).predicted_iteration_ms for p in SCHEDULING_POLICIES}
    assert times["deft"] < min(times["bytescheduler"], times["usbyte"], times["wfbp"])


def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd")
    cli_simulate.add_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_prints_the_four_policies_and_writes_json(tmp_path, capsys) -> None:
    out = tmp_path / "r.json"
    assert run_cli(["simulate", "--model", "gpt2", "--gpus", "16", "--json", str(out),
                    "--trace-dir", str(tmp_path / "traces")]) == 0
    text = capsys.readouterr().out
    for policy in SCHEDULING_POLICIES:
        assert f"\n{policy} " in text
    data = json.loads(out.read_text())
    rows = {r["policy"]: r for r in data["results"]}
    assert set(rows) == set(SCHEDULING_POLICIES)
    assert rows["wfbp"]["speedup_vs_wfbp"] == 1.0
    assert rows["deft"]["iteration_ms"] <= rows["wfbp"]["iteration_ms"]
    assert len(list((tmp_path / "traces").glob("*.trace.json"))) == 4
