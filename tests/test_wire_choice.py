"""The deft solver's wire dtype per bucket, chosen by the time each bucket saves and its measured price
(``planner.wire``, ``solvers.deft``), and the prices themselves (``preserver.wire_pricing``), in one process: the
2-process runs that measure the prices and train with the chosen wire are in tests/test_wire_precision.py."""

from __future__ import annotations

import math

import pytest
import torch

from deft_compile.planner.plan import WIRE_FULL, LinkCost, ParamProfile, Profile
from deft_compile.planner.solvers import solve
from deft_compile.planner.wire import choose_wire, narrowing_pays

OPTIONS = {"first_bucket_bytes": 1_000_000, "bucket_cap_bytes": 1_000_000}


def _profile(beta: float = 1e-6, alpha: float = 0.5) -> Profile:
    """4 buckets of 250 000 float32 elements (1 MB each), ready at 1, 2, 3, 4 ms of backward; forward 4 ms.
    At ``beta`` 1e-6 ms/byte each all-reduce takes 1.5 ms in float32, 1.0 ms in 16 bits."""
    params = [ParamProfile(f"p{i}", 250_000, "float32", 1.0, 1.0, 0.0, layer=3 - i) for i in range(4)]
    return Profile(params, [LinkCost("l", alpha, beta)])


def _prices(value: float, dtypes=("bfloat16", "float16")) -> dict[str, dict[str, float]]:
    return {dtype: {f"p{i}": value for i in range(4)} for dtype in dtypes}


def test_narrowing_pays_only_where_the_saving_beats_the_scaled_price():
    assert narrowing_pays(0.5, 0.0, 10.0, 8.0)
    assert not narrowing_pays(0.0, 0.0, 10.0, 8.0), "a bucket that saves nothing never narrows"
    # price 0.4 ms on a step of 10 ms with compute 8 ms: 0.5 ms lost per step
    assert not narrowing_pays(0.5, 0.4, 10.0, 8.0)
    assert narrowing_pays(0.51, 0.4, 10.0, 8.0)


def test_harmless_prices_narrow_every_bucket_and_the_step_gets_shorter():
    profile = _profile()
    full = solve(profile, "deft", max_staleness=0, **OPTIONS)
    narrowed = solve(profile, "deft", max_staleness=0, wire_prices=_prices(1e-4), **OPTIONS)
    assert {item.wire_dtype for item in full.items} == {WIRE_FULL}
    assert all(item.narrowed for item in narrowed.items)
    assert narrowed.predicted_iteration_ms < full.predicted_iteration_ms
    assert narrowed.metadata["narrowed_buckets"] == 4
    assert narrowed.options["wire_prices"] == _prices(1e-4)


def test_the_cheaper_dtype_wins_per_bucket():
    profile = _profile()
    prices = {"bfloat16": {f"p{i}": 1e-3 for i in range(4)}, "float16": {f"p{i}": 1e-4 for i in range(4)}}
    prices["float16"]["p0"] = 0.01  # p0's gradients underflow in float16: bfloat16 is cheaper there
    choice = choose_wire(profile, profile.buckets(**OPTIONS), prices, 10.0, 8.0)
    bucket_of_p0 = next(b for b, bucket in enumerate(profile.buckets(**OPTIONS)) if 0 in bucket)
    assert choice[bucket_of_p0] == "bfloat16"
    assert [dtype for b, dtype in enumerate(choice) if b != bucket_of_p0] == ["float16"] * 3


def test_a_harmful_price_keeps_float32_and_an_unmeasured_dtype_is_never_chosen():
    profile = _profile()
    harmful = solve(profile, "deft", max_staleness=0, wire_prices=_prices(5.0), **OPTIONS)
    assert {item.wire_dtype for item in harmful.items} == {WIRE_FULL}
    only_bf16 = solve(profile, "deft", max_staleness=0, wire_prices=_prices(1e-4, ("bfloat16",)), **OPTIONS)
    assert {item.wire_dtype for item in only_bf16.items} == {"bfloat16"}


def test_kept_float32_buckets_and_disallowed_dtypes_do_not_narrow():
    profile = _profile()
    kept = solve(profile, "deft", max_staleness=0, wire_prices=_prices(1e-4), keep_float32=["p3"], **OPTIONS)
    by_param = {s.param: item.wire_dtype for item in kept.items for s in item.slices}
    assert by_param[3] == WIRE_FULL and all(by_param[p] != WIRE_FULL for p in (0, 1, 2))
    float32_only = solve(profile, "deft", max_staleness=0, wire_prices=_prices(1e-4), wire_dtypes=["float32"],
                         **OPTIONS)
    assert {item.wire_dtype for item in float32_only.items} == {WIRE_FULL}
    assert "wire_prices" not in float32_only.options


def test_wire_prices_are_deft_s_and_exclude_a_fixed_wire_dtype():
    profile = _profile()
    with pytest.raises(ValueError, match="policy 'wfbp' sends one wire_dtype"):
        solve(profile, "wfbp", wire_prices=_prices(1e-4), **OPTIONS)
    with pytest.raises(ValueError, match="give one or the other"):
        solve(profile, "deft", wire_dtype="float16", wire_prices=_prices(1e-4), **OPTIONS)


def test_delays_are_chosen_on_the_narrowed_buckets():
    """At a coverage rate where float32 needs delays, the narrowed plan needs fewer: the solver sees the narrowed
    bytes, and it is never slower than the narrowed synchronous plan."""
    profile = _profile(beta=2e-6, alpha=0.5)  # 2.5 ms per bucket in float32, 1.5 ms in 16 bits
    full = solve(profile, "deft", allow_period=False, **OPTIONS)
    narrowed = solve(profile, "deft", allow_period=False, wire_prices=_prices(1e-4), **OPTIONS)
    synchronous = solve(profile, "deft", max_staleness=0, wire_prices=_prices(1e-4), **OPTIONS)
    assert all(item.narrowed for item in narrowed.items)
    assert sum(item.delay for item in narrowed.items) <= sum(item.delay for item in full.items)
    assert narrowed.predicted_iteration_ms <= synchronous.predicted_iteration_ms
    assert narrowed.predicted_iteration_ms < full.predicted_iteration_ms
    assert math.isfinite(narrowed.predicted_iteration_ms)


# -- the prices ------------------------------------------------------------------------------------------------
def _measured(gradients: dict[str, torch.Tensor], world_size: int = 2, dtypes=("bfloat16", "float16")):
    """Rank sums of ``cast_error_norms`` with every rank holding ``gradients``, priced on a 10 ms compute step."""
    from deft_compile.preserver.wire_error import cast_error_norms
    from deft_compile.preserver.wire_pricing import wire_prices, wire_shares

    row = cast_error_norms(list(gradients.values()), world_size, dtypes)
    return wire_prices(wire_shares(list(gradients), dtypes, [world_size * v for v in row], world_size), 10.0)


def test_rounding_prices_follow_each_dtype_s_unit_round_off():
    """Gradients in float16's normal range: each dtype's price is a small share of the compute step, float16's
    (11 significant bits) under bfloat16's (8), and each within the bound of the dtype's round-off (the cast's
    u per rank plus the all-reduce's own (W - 1) u, times the parameter's share)."""
    from deft_compile.preserver.wire_pricing import UNIT_ROUND_OFF

    generator = torch.Generator().manual_seed(0)
    gradients = {"a": torch.randn(10_000, generator=generator), "b": 0.1 * torch.randn(10_000, generator=generator)}
    prices = _measured(gradients)
    total = sum(float(g.square().sum()) for g in gradients.values())
    for dtype in ("bfloat16", "float16"):
        for name, g in gradients.items():
            share = float(g.square().sum()) / total
            bound = 10.0 * share * (2 * UNIT_ROUND_OFF[dtype] + UNIT_ROUND_OFF[dtype])  # W = 2: two casts, one add
            assert 0 < prices[dtype][name] <= bound * 1.01, (dtype, name, prices[dtype][name], bound)
    assert sum(prices["float16"].values()) < sum(prices["bfloat16"].values()) / 4


def test_gradients_below_float16_s_range_price_float16_at_their_whole_share_and_bfloat16_wins():
    generator = torch.Generator().manual_seed(0)
    tiny = {"a": 1e-9 * torch.randn(10_000, generator=generator)}  # below 2**-24 once divided by the world size
    prices = _measured(tiny)
    assert prices["float16"]["a"] == pytest.approx(10.0, rel=0.02), "flushed to zero: the whole share is lost"
    assert prices["bfloat16"]["a"] <= 10.0 * 3 * 2.0 ** -8, "bfloat16 keeps float32's range: its round-off only"
    params = [ParamProfile("a", 10_000, "float32", 1.0, 1.0, 0.0, layer=0)]
    profile = Profile(params, [LinkCost("l", 0.1, 1e-5)])  # 0.4 ms per float32 all-reduce, saving 0.2 ms
    assert choose_wire(profile, [[0]], prices, 10.0, 10.0) == ["bfloat16"]


def test_a_measurement_that_prices_a_narrowed_bucket_harmful_names_it():
    from deft_compile.preserver.wire_pricing import harmful_buckets

    items = [(("a", "b"), "float16", 0.5), (("c",), "bfloat16", 0.5)]
    prices = {"float16": {"a": 0.1, "b": 0.3}, "bfloat16": {"c": 0.01}}
    # step 10 ms, compute 8 ms: (0.1 + 0.3) x 10 / 8 = 0.5 ms lost, not less than the 0.5 ms saved
    assert harmful_buckets(items, prices, 10.0, 8.0) == [(("a", "b"), "float16", pytest.approx(0.4), 0.5)]
    assert harmful_buckets(items, prices, 9.0, 8.0) == []


def test_the_preserver_keeps_float32_buckets_across_a_resume():
    from deft_compile.preserver import Preserver, PreserverConfig

    preserver = Preserver(PreserverConfig(), base_options={"wire_prices": _prices(1e-4)})
    event = preserver.keep_float32(7, {"p[1]", "p2"}, "priced harmful", {})
    assert event.step == 7 and event.options["keep_float32"] == ["p2", "p[[]1[]]"]
    resumed = Preserver(PreserverConfig(), base_options={"wire_prices": _prices(1e-4)})
    resumed.load_state_dict(preserver.state_dict())
    assert resumed.unpriced_options()["keep_float32"] == ["p2", "p[[]1[]]"]


def test_the_closed_loop_s_priority_rivals_narrow_what_the_plan_narrows():
    """The priority plans a deft step measures beside its narrowed synchronous plan send each parameter in the
    dtype that plan chose (float32 where it kept float32), so they are DDP's numbers with the same wire."""
    from deft_compile.planner.closed_loop import priority_plans
    from deft_compile.planner.solvers.hybrid import wire_by_param

    profile = _profile()
    plan = solve(profile, "deft", max_staleness=0, wire_prices=_prices(1e-4, ("float16",)), keep_float32=["p3"],
                 **OPTIONS)
    wire_of = wire_by_param(plan)
    assert wire_of[3] == WIRE_FULL and wire_of[0] == "float16"
    rivals = priority_plans(profile, wire_of)
    assert {p.policy for p in rivals} == {"bytescheduler", "usbyte"}
    for rival in rivals:
        for item in rival.items:
            wires = {wire_of[s.param] for s in item.slices}
            assert item.wire_dtype == (wires.pop() if len(wires) == 1 else WIRE_FULL), rival.table(profile)
    assert [p.hash() for p in priority_plans(profile)] == [p.hash() for p in priority_plans(profile, {})]


def test_a_kept_parameter_leaves_its_bucket_where_that_is_faster():
    """``keep_float32`` on a bias that shares a large bucket with a weight: the solver cuts the bucket in two
    (``wire.split_kept``) where the extra message costs less than the weight's narrowed bytes save, so the weight
    still narrows and only the bias crosses in float32; where the message's latency costs more, the bucket stays
    whole and float32."""
    from deft_compile.planner.wire import split_kept

    def profile(alpha: float) -> Profile:
        params = [ParamProfile("weight", 250_000, "float32", 1.0, 1.0, 0.0, layer=1),
                  ParamProfile("bias", 100, "float32", 0.01, 0.01, 0.0, layer=1),
                  ParamProfile("other", 250_000, "float32", 1.0, 1.0, 0.0, layer=0)]
        return Profile(params, [LinkCost("l", alpha, 2e-5)])  # 1 MB: 20 ms in float32, 10 ms in 16 bits

    options = {"first_bucket_bytes": 1_100_000, "bucket_cap_bytes": 1_100_000}
    prices = {"float16": {"weight": 1e-4, "bias": 1e-4, "other": 1e-4}}
    cheap = profile(0.05)
    buckets = cheap.buckets(**options)
    assert buckets == [[0, 1, 2]], "the test needs the bias in one bucket with the weights"
    assert split_kept(cheap, buckets, ["bias"]) == [[0, 2], [1]]
    assert split_kept(cheap, buckets, ["nothing*"]) == buckets

    whole = solve(cheap, "deft", max_staleness=0, wire_prices=prices, **options)
    kept = solve(cheap, "deft", max_staleness=0, wire_prices=prices, keep_float32=["bias"], **options)
    wire_of = {s.param: item.wire_dtype for item in kept.items for s in item.slices}
    assert wire_of == {0: "float16", 1: WIRE_FULL, 2: "float16"}, kept.table(cheap)
    assert kept.metadata["kept_float32_split"] == 1
    assert whole.predicted_iteration_ms <= kept.predicted_iteration_ms < whole.predicted_iteration_ms + 1.0

    dear = profile(50.0)  # a message's latency above the 10 ms the weight's narrowing saves
    kept = solve(dear, "deft", max_staleness=0, wire_prices=prices, keep_float32=["bias"], **options)
    wire_of = {s.param: item.wire_dtype for item in kept.items for s in item.slices}
    assert set(wire_of.values()) == {WIRE_FULL}, kept.table(dear)
    assert "kept_float32_split" not in kept.metadata
