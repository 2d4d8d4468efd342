"""The Preserver's trade (deft_compile.preserver.pricing): prices from measured gradient changes, probe spacing."""

from __future__ import annotations

import math

import pytest

from deft_compile.preserver import Preserver, PreserverConfig
from deft_compile.preserver.pricing import (
    NOISE_CAP,
    ProbeSchedule,
    StalenessPricer,
    noise_ratios,
    prior_update_prices,
    progress_shares,
    skipped_share,
    update_shares,
)


def test_progress_share_is_the_first_order_loss_of_one_stale_step():
    # a: ‖g‖² = 4, ‖Δg‖² = 1 -> 1*2/5; b: ‖g‖² = 1, no change -> 0; total ‖g‖² = 5
    shares = progress_shares({"a": (1.0, 4.0), "b": (0.0, 1.0)})
    assert shares == {"a": pytest.approx(2.0 / 5.0), "b": 0.0}
    # additive: splitting a parameter into two equal halves keeps the total share
    halves = progress_shares({"a1": (0.5, 2.0), "a2": (0.5, 2.0), "b": (0.0, 1.0)})
    assert halves["a1"] + halves["a2"] == pytest.approx(shares["a"])
    assert progress_shares({"a": (1.0, 0.0)}) == {"a": 0.0}
    assert update_shares({"a": (1.0, 4.0), "b": (0.0, 1.0)}) == {"a": pytest.approx(0.8), "b": pytest.approx(0.2)}


def test_prior_update_prices_follow_parameter_counts():
    assert prior_update_prices({"big": 300, "small": 100}, step_ms=8.0) == {"big": 6.0, "small": 2.0}
    assert prior_update_prices({}, step_ms=8.0) == {}


def test_pricer_prices_the_median_of_a_full_window():
    pricer = StalenessPricer(price_factor=2.0, window=3)
    for d in (1.0, 100.0, 1.0):  # one spike
        assert not pricer.ready
        pricer.observe({"a": (d, 4.0), "b": (0.0, 1.0)})
    assert pricer.ready
    share = math.sqrt(1.0 * 4.0) / 5.0
    staleness, updates = pricer.prices(step_ms=10.0)
    assert staleness == {"a": pytest.approx(2.0 * share * 10.0), "b": 0.0}
    assert updates == {"a": pytest.approx(2.0 * 0.8 * 10.0), "b": pytest.approx(2.0 * 0.2 * 10.0)}
    clone = StalenessPricer(2.0, 3)
    clone.load_state_dict(pricer.state_dict())
    assert clone.prices(10.0) == pricer.prices(10.0)


def test_noise_ratios_measure_the_gradient_noise_of_the_all_reduced_step():
    """Ranks' gradients G + noise with known variance: the ranks' mean squared norm and the squared norm of their mean
    give b = tr(Σ of the mean) / ‖G‖² within sampling error; no noise gives 0, noise alone the cap, one rank
    nothing."""
    import torch

    torch.manual_seed(0)
    size, ranks, sigma = 200_000, 4, 0.02
    true = torch.randn(size) * 0.01  # ‖G‖² = 20; tr(Σ) of one rank's gradient = size σ² = 80
    grads = [true + sigma * torch.randn(size) for _ in range(ranks)]
    local = sum(float(g.double().square().sum()) for g in grads) / ranks
    mean = float(torch.stack(grads).mean(0).double().square().sum())
    expected = size * sigma ** 2 / ranks / float(true.double().square().sum())  # 1.0
    assert noise_ratios({"w": local}, {"w": mean}, ranks)["w"] == pytest.approx(expected, rel=0.05)
    exact = float(true.double().square().sum())
    assert noise_ratios({"w": exact}, {"w": exact}, ranks) == {"w": 0.0}
    pure = [sigma * torch.randn(size) for _ in range(2)]
    assert noise_ratios({"w": sum(float(g.square().sum()) for g in pure) / 2},
                        {"w": float(((pure[0] + pure[1]) / 2).square().sum()) * 0.9}, 2) == {"w": NOISE_CAP}
    assert noise_ratios({"w": 0.0}, {"w": 0.0}, 2) == {"w": 0.0}
    assert noise_ratios({"w": 2.0}, {"w": 1.0}, 1) == {}


def test_the_noise_measurement_sends_a_sample_that_gives_the_same_ratios():
    """``monitor.noise_sample`` keeps about ``NOISE_SAMPLE_ELEMENTS`` elements of a model's gradients, at least
    ``NOISE_SAMPLE_LEAST`` of each tensor (all of a smaller one), the same elements on every rank, and every column of
    a weight's rows: noise ratios from the sample equal the full gradients' within sampling error, for a weight
    matrix whose rows differ in scale, a bias and a tensor sent whole."""
    import torch

    from deft_compile.preserver.monitor import NOISE_SAMPLE_ELEMENTS, NOISE_SAMPLE_LEAST, noise_sample

    torch.manual_seed(1)
    ranks = 2
    shapes = {"weight": (1536, 1024), "bias": (1536,), "scale": (100,)}
    true = {name: torch.randn(shape) * 0.01 * torch.linspace(0.2, 2.0, shape[0]).reshape(-1, *[1] * (len(shape) - 1))
            for name, shape in shapes.items()}
    sigma = {"weight": 0.01, "bias": 0.015, "scale": 0.01}
    grads = [[(true[n] + sigma[n] * torch.randn(shapes[n])).reshape(-1) for n in shapes] for _ in range(ranks)]
    samples = [noise_sample(g) for g in grads]
    assert sum(t.numel() for t in samples[0]) <= NOISE_SAMPLE_ELEMENTS + NOISE_SAMPLE_LEAST * len(shapes)
    assert samples[0][0].numel() < grads[0][0].numel() // 2, "a large tensor is sampled"
    assert samples[0][1].numel() >= NOISE_SAMPLE_LEAST, "a small tensor keeps enough elements for its own ratio"
    assert samples[0][2].numel() == grads[0][2].numel(), "a tensor under the least count is sent whole"
    stride = samples[0][0].stride(0)  # a strided view of the flat gradient
    columns = torch.arange(0, grads[0][0].numel(), stride) % shapes["weight"][1]
    assert columns.unique().numel() == shapes["weight"][1], "the stride walks every column of the weight's rows"

    def ratios(per_rank):
        local = {n: sum(float(g[i].double().square().sum()) for g in per_rank) / ranks for i, n in enumerate(shapes)}
        mean = {n: float(sum(g[i] for g in per_rank).div(ranks).double().square().sum()) for i, n in enumerate(shapes)}
        return noise_ratios(local, mean, ranks)

    full, sampled = ratios(grads), ratios(samples)
    assert 0.1 < full["weight"] < 10 and 0.1 < full["bias"] < 10, full
    for name in shapes:
        assert sampled[name] == pytest.approx(full[name], rel=0.1), (name, sampled, full)


def test_a_period_loses_less_of_a_noisy_gradients_progress():
    """An update with the mean of K gradients is worth (1 + b)/(1 + b/K) updates: a period K loses (K - 1)/(K + b)
    of the parameter's share of progress, (1 - 1/K) with an exact gradient."""
    assert skipped_share(2, 0.0) == 0.5 and skipped_share(4, 0.0) == 0.75
    assert skipped_share(2, 2.0) == pytest.approx(0.25) and skipped_share(4, 12.0) == pytest.approx(3 / 16)
    assert skipped_share(1, 5.0) == 0.0


def test_the_pricer_keeps_the_median_noise_ratio_beside_the_prices():
    pricer = StalenessPricer(price_factor=1.0, window=3)
    for noise in (4.0, 90.0, 6.0):
        pricer.observe({"a": (1.0, 4.0), "b": (0.0, 1.0)}, {"a": noise, "b": 0.5})
    staleness, updates, ratios = pricer.prices(step_ms=10.0)
    assert ratios == {"a": 6.0, "b": 0.5}
    clone = StalenessPricer(1.0, 3)
    clone.load_state_dict(pricer.state_dict())
    assert clone.prices(10.0) == pricer.prices(10.0)
    unmeasured = StalenessPricer(1.0, 1)
    unmeasured.observe({"a": (1.0, 4.0)})
    assert len(unmeasured.prices(10.0)) == 2, "no noise measured: the update prices stand alone"
    preserver = Preserver(PreserverConfig(staleness_window=1), base_options={"bucket_cap_bytes": 2}, max_period=4)
    prices = preserver.trade(5, {"a": (1.0, 4.0)}, step_ms=10.0, noise={"a": 3.0})
    assert preserver.priced_options(prices)["update_noise"] == {"a": 3.0}
    preserver.record_trade(5, prices, {}, "test")
    restored = Preserver(PreserverConfig(staleness_window=1), base_options={"bucket_cap_bytes": 2}, max_period=4)
    restored.load_state_dict(preserver.state_dict())
    assert restored.options["update_noise"] == {"a": 3.0} == preserver.options["update_noise"]


def test_probes_back_off_while_stable_and_return_after_a_change():
    probes = ProbeSchedule(every=25, backoff=4, budget=0.0)
    due = [s for s in range(1, 30) if probes.due(s)]
    assert due == [5]
    assert probes.after_measurement(5, changed=False, probe_ms=1, step_ms=10) == 5  # early: 10 next
    assert probes.after_measurement(10, changed=False, probe_ms=1, step_ms=10) == 15  # then 25
    assert probes.due(25)
    intervals = [probes.after_measurement(step, changed=False, probe_ms=1, step_ms=10) for step in (25, 75, 175, 375)]
    assert intervals == [50, 100, 100, 100], "doubles up to every x backoff"
    assert probes.after_measurement(475, changed=True, probe_ms=1, step_ms=10) == 25
    assert probes.next_step == 500


def test_probes_never_cost_more_than_their_budget():
    probes = ProbeSchedule(every=10, backoff=100, budget=0.05)
    probes.after_measurement(2, changed=False, probe_ms=50, step_ms=10)
    probes.after_measurement(4, changed=False, probe_ms=50, step_ms=10)
    # a 50 ms probe at 5 % of a 10 ms step: at least 100 steps apart
    assert probes.after_measurement(10, changed=True, probe_ms=50, step_ms=10) == 100
    # the budget holds past the backoff's longest interval (every x backoff = 20 steps here)
    capped = ProbeSchedule(every=10, backoff=2, budget=0.05)
    assert capped.after_measurement(10, changed=False, probe_ms=50, step_ms=10) == 100
    assert capped.after_measurement(110, changed=False, probe_ms=20, step_ms=10) == 40


def test_trade_mode_options_carry_prices_or_go_synchronous():
    preserver = Preserver(PreserverConfig(staleness_window=1), base_options={"bucket_cap_bytes": 2},
                          max_period=4, mean_comm_ms=2.0, prior_update_prices={"a": 3.0})
    assert preserver.options["update_prices"] == {"a": 3.0}, "the prior prices periods before any measurement"
    prices = preserver.trade(5, {"a": (1.0, 4.0)}, step_ms=10.0)
    assert prices == ({"a": pytest.approx(5.0)}, {"a": pytest.approx(10.0)})  # 10 ms x 2 x 1 / 4; 10 ms x 4 / 4
    assert "staleness_prices" not in preserver.options, "prices count once adopted"
    assert preserver.priced_options(prices)["staleness_prices"] == {"a": 5.0}
    event = preserver.record_trade(5, prices, {}, "test")
    assert preserver.options["staleness_prices"] == {"a": 5.0} and preserver.options["update_prices"] == {"a": 10.0}
    assert "<1 parameters>" in str(event)
    assert "staleness_prices" not in preserver.unpriced_options()
    kept = Preserver(PreserverConfig(staleness_window=1), base_options={"bucket_cap_bytes": 2}, max_period=4)
    kept.load_state_dict(preserver.state_dict())
    assert kept.settle(8, "kept", "stable", {}) is None, "a final decision that keeps the options switches nothing"
    assert kept.options == preserver.options and kept.settled == "kept" and not kept.staleness_due(kept.probes.next_step)
    event = preserver.settle(30, "synchronous", "back", {})
    assert event is not None and event.reason == "back"
    assert preserver.options["max_staleness"] == 0 and "staleness_prices" not in preserver.options
    assert preserver.probes.stopped and not preserver.staleness_due(preserver.probes.next_step)
    restored = Preserver(PreserverConfig(staleness_window=1), base_options={"bucket_cap_bytes": 2}, max_period=4)
    restored.load_state_dict(preserver.state_dict())
    assert restored.options == preserver.options and restored.settled == "synchronous" and restored.probes.stopped


def test_trade_config_is_validated():
    with pytest.raises(ValueError):
        PreserverConfig(staleness_price=-1)
    with pytest.raises(ValueError):
        PreserverConfig(probe_backoff=0)
    with pytest.raises(ValueError):
        PreserverConfig(stable_after=0)
    with pytest.raises(ValueError):
        PreserverConfig(admission_steps=1)
    with pytest.raises(ValueError):
        PreserverConfig(admission_tolerance=-0.1)


def test_probes_stop_for_good_and_resume_after_a_pause():
    probes = ProbeSchedule(every=25, backoff=8)
    assert probes.budget == 0.005, "probes take at most 0.5 % of the step time by default"
    probes.after_measurement(25, changed=False, probe_ms=1, step_ms=10)
    assert probes.due(probes.next_step)
    probes.resume(300)
    assert probes.next_step == 300 + probes.interval
    probes.stop()
    assert not any(probes.due(s) for s in range(1, 2000))
    clone = ProbeSchedule(every=25)
    clone.load_state_dict(probes.state_dict())
    assert clone.stopped and clone.next_step == probes.next_step


def test_a_switch_pays_only_when_its_gain_over_the_horizon_beats_flush_graphs_and_duel():
    from deft_compile.preserver.verdict import switch_cost_ms, switch_pays

    # flush 60 ms, three graphs of 300 ms, a 40-step duel half on the plan 10 ms slower
    cost = switch_cost_ms(60.0, 900.0, 40, 10.0)
    assert cost == pytest.approx(60.0 + 900.0 + 200.0)
    assert switch_pays(10.0, 200, cost) and not switch_pays(5.0, 200, cost)
    assert not switch_pays(-1.0, 10_000, 0.0) and not switch_pays(0.0, 200, 0.0)


def test_a_running_plan_with_delays_is_kept_on_measured_time_within_the_margin():
    from deft_compile.preserver.verdict import keeps_delays

    # measured 50 ms against 60 ms synchronous: kept until its staleness loses 1 - 50/63 of each step's progress
    assert keeps_delays(50.0, 60.0, lost_share=0.1, margin=0.05)  # 55.6 ms priced
    assert keeps_delays(50.0, 60.0, lost_share=0.2, margin=0.05)  # 62.5 ms priced: inside the 5 % margin
    assert not keeps_delays(50.0, 60.0, lost_share=0.25, margin=0.05)  # 66.7 ms priced
    assert not keeps_delays(61.0, 60.0, lost_share=0.0, margin=0.0), "measured slower loses without a margin"


def test_plain_delays_are_admitted_only_when_the_paired_replay_shows_no_cost():
    from deft_compile.preserver.verdict import Stability, admits_plain

    assert admits_plain(1.000, 1.001, tolerance=0.0) and admits_plain(1.001, 1.001, tolerance=0.0)
    assert not admits_plain(1.002, 1.001, tolerance=0.0) and admits_plain(1.002, 1.001, tolerance=0.005)
    assert not admits_plain(float("inf"), 1.0, tolerance=1.0) and not admits_plain(1.0, float("nan"), tolerance=1.0)
    stability = Stability(after=2)
    assert not stability.confirm() and stability.confirm() and stability.stable
    stability.reset()
    assert not stability.stable


def test_the_price_of_a_plan_counts_delays_periods_and_skipped_updates():
    from deft_compile.planner.plan import LinkCost, ParamProfile, Profile
    from deft_compile.planner.solvers import solve
    from deft_compile.preserver.pricing import plan_price_ms, priced_cost_ms

    params = [ParamProfile(f"p{i}", 1_000_000, "float32", 1.0, 1.0, 0.0, layer=7 - i) for i in range(8)]
    profile = Profile(params, [LinkCost("l", 0.1, 1e-6)])
    plan = solve(profile, "deft", first_bucket_bytes=4_000_000, bucket_cap_bytes=4_000_000)
    names = [p.name for p in params]
    staleness, updates = {n: 0.1 for n in names}, {n: 0.2 for n in names}
    price = plan_price_ms(plan, names, staleness, updates)
    assert price == pytest.approx(sum((i.delay + (i.period - 1) / 2) * len(i.slices) * 0.1
                                      + (1 - 1 / i.period) * len(i.slices) * 0.2 for i in plan.items))
    # a measured step in place of the prediction, priced the same way
    assert priced_cost_ms(plan, names, staleness, updates, 16.0, step_ms=20.0) == pytest.approx(20.0 / (1 - price / 16.0))
    # with noise ratios, a period skips (K - 1)/(K + b) of the updates' progress
    noise = {n: 3.0 for n in names}
    assert plan_price_ms(plan, names, staleness, updates, noise) == pytest.approx(
        sum((i.delay + (i.period - 1) / 2) * len(i.slices) * 0.1
            + (i.period - 1) / (i.period + 3.0) * len(i.slices) * 0.2 for i in plan.items))


def test_priced_cost_counts_each_bucket_once_with_its_delay_and_period():
    from deft_compile.planner.plan import LinkCost, ParamProfile, Profile
    from deft_compile.planner.solvers import solve
    from deft_compile.planner.solvers.deft import priced_step_ms
    from deft_compile.preserver.pricing import priced_cost_ms

    params = [ParamProfile(f"p{i}", 1_000_000, "float32", 1.0, 1.0, 0.0, layer=7 - i) for i in range(8)]
    profile = Profile(params, [LinkCost("l", 0.1, 1e-6)])
    plan = solve(profile, "deft", first_bucket_bytes=4_000_000, bucket_cap_bytes=4_000_000)
    names = [p.name for p in params]
    compute = profile.forward_ms + profile.backward_ms + profile.update_ms  # 16 ms
    assert priced_cost_ms(plan, names, {}, {}, compute) == pytest.approx(plan.predicted_iteration_ms)
    staleness, updates = {n: 0.1 for n in names}, {n: 0.2 for n in names}
    price = sum((item.delay + (item.period - 1) / 2) * len(item.slices) * 0.1
                + (1 - 1 / item.period) * len(item.slices) * 0.2 for item in plan.items)
    assert any(item.delay or item.period > 1 for item in plan.items) and price > 0
    # L = price / compute of each step's progress is lost: 1 / (1 - L) times the steps
    expected = plan.predicted_iteration_ms / (1 - price / compute)
    assert priced_cost_ms(plan, names, staleness, updates, compute) == pytest.approx(expected)
    # the solver ranks by the same cost
    priced = solve(profile, "deft", first_bucket_bytes=4_000_000, bucket_cap_bytes=4_000_000,
                   staleness_prices=staleness, update_prices=updates)
    assert priced_cost_ms(priced, names, staleness, updates, compute) == pytest.approx(priced_step_ms(
        priced.predicted_iteration_ms, priced.metadata.get("staleness_price_ms", 0.0), compute))
