"""Wire precision: a plan item crosses the link in float32 (the gradients as they are), bfloat16 or float16 (the
8-bit wire: tests/test_int8_wire.py).

The plan data (JSON, validation, table), the simulator's and solvers' pricing by the bytes on the wire, the
configuration, what gloo takes, and the step against torch DDP with the compression hook of the same dtype
(``default_hooks.fp16_compress_hook`` / ``bf16_compress_hook``: ``buffer.to(dtype).div_(world_size)``, all-reduce,
copied back into the float32 bucket), 2 gloo processes:

- aten route (the suite's default): bit-identical, parameters, gradients and momentum, after every SGD step; the
  same DDP without the hook differs, so the wire was applied.
- Inductor (``compiler="inductor"``): within ``bounds.DRIFT_MULTIPLE`` times the yardstick measured in the same
  launch, DDP with the same hook around ``torch.compile(model)`` against the eager DDP with the hook
  (tests/bounds.py). A float32 round-off difference in a gradient element moves its 16-bit rounding by a whole
  16-bit ulp (2^-11 of the element for float16, 2^-8 for bfloat16), so these differences are far above float32's;
  the yardstick has the same flips, on a transformer whose LayerNorm, softmax and GELU Inductor fuses (the MLP's
  compiled gradients are eager's bit for bit for several steps: a zero yardstick). The bound does not tell a
  narrowed wire from a float32 one (the wire's own change is of the same size): the aten test does, and here the
  step graph is checked to send 16-bit buffers.

The aten-route 2-process runs of this file go in one process pair, in turn (``CASE_LIST``, tests/batched.py), and each
test asserts its own run's results; the Inductor tests launch their own pairs.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from batched import Case, launch_cases
from bounds import check_within_drift, worst
from deft_compile import DeftConfig
from deft_compile.preserver import PreserverConfig
from deft_compile.planner.plan import CommItem, LinkCost, ParamProfile, ParamSlice, Plan, Profile
from deft_compile.planner.simulator import simulate
from deft_compile.planner.solvers import solve
from deft_compile.tools.launcher import run_local_workers
from wire_workers import (deft_chooses_wire, delayed_wire_run, plain_all_reduce, priority_wire_beside_ddp,
                          register_hook_by_name, wire_beside_ddp)
from workers import check_entry

WIRES = ("float16", "bfloat16")
STEPS = 6
STEP_CASES = ["mlp_dropout_sgd", "transformer_sgd"]
PRIORITY_POLICIES = ["bytescheduler", "usbyte"]
DELAYED_WIRE_CASES = [("compensated", 1), ("averaged", 2), ("local", 1)]
#: the bucket caps of the ``deft_chooses_wire`` runs
SMALL_BUCKETS = {"first_bucket_mb": 0.0002, "bucket_cap_mb": 0.004}
#: ``test_where_no_price_can_buy_delays_a_measurement_prices_only_the_wire``'s trade margins: one no delay can gain
#: (ten compute steps), and the default
TRADE_MARGINS = (10.0, PreserverConfig().trade_margin)

#: every aten-route 2-process run of this file, by key, with the tests that read it (tests/batched.py)
CASE_LIST = (
    [Case(("all-reduce", wire), plain_all_reduce, (wire,), tests=(f"test_gloo_all_reduces_16_bit_tensors[{wire}]",))
     for wire in WIRES]
    + [Case(("hook by name", wire), register_hook_by_name, (wire,),
            tests=("test_ddp_refuses_the_bf16_hook_by_name_not_gloo",)) for wire in WIRES]
    + [Case(("wfbp", wire, case), wire_beside_ddp, (case, STEPS, wire),
            tests=(f"test_wfbp_with_a_16_bit_wire_is_ddp_with_the_compression_hook[{wire}-{case}]",))
       for case in STEP_CASES for wire in WIRES]
    + [Case(("priority", wire, policy), priority_wire_beside_ddp, ("mlp_dropout_sgd", 5, policy, wire),
            tests=(f"test_priority_plans_with_a_16_bit_wire_are_ddp_with_the_hook[{wire}-{policy}]",))
       for policy in PRIORITY_POLICIES for wire in WIRES]
    + [Case(("delayed", delayed_update, accumulation), delayed_wire_run,
            ("mlp_dropout_sgd", 6, "float16", accumulation, delayed_update),
            tests=(f"test_delayed_buckets_carry_the_16_bit_tensor[{delayed_update}-{accumulation}]",))
       for delayed_update, accumulation in DELAYED_WIRE_CASES]
    + [Case("prices", deft_chooses_wire, ("mlp_dropout_sgd", 4, SMALL_BUCKETS),
            tests=("test_deft_prices_each_16_bit_wire_on_its_first_call",)),
       Case("below float16", deft_chooses_wire, ("mlp_dropout_sgd", 4, SMALL_BUCKETS, 1e-9),
            tests=("test_gradients_below_float16_s_range_never_cross_in_float16",)),
       Case("float32 wire", deft_chooses_wire,
            ("mlp_dropout_sgd", 4, {**SMALL_BUCKETS, "wire_dtypes": ("float32",)}),
            tests=("test_a_float32_wire_is_one_setting_away",))]
    + [Case(("trade margin", margin), deft_chooses_wire,
            ("mlp_dropout_sgd", 26, {**SMALL_BUCKETS, "preserver": {"trade_margin": margin}}),
            tests=("test_where_no_price_can_buy_delays_a_measurement_prices_only_the_wire",))
       for margin in TRADE_MARGINS]
)


@pytest.fixture(scope="module")
def outcome(request):
    """The per-rank values of a run of ``CASE_LIST`` by key (a failed run fails the test that reads it)."""
    return launch_cases(request, CASE_LIST, timeout_s=900.0)


# -- plan data -------------------------------------------------------------------------------------------------
def _profile(*dtypes: str) -> Profile:
    params = [ParamProfile(f"p{i}", 1000, dtype, 1.0, 1.0, 0.1, layer=len(dtypes) - 1 - i) for i, dtype in enumerate(dtypes)]
    return Profile(params, [LinkCost("link", 0.5, 0.001)], world_size=2)


def _one_item_plan(wire_dtype: str, param: int = 0, numel: int = 1000) -> Plan:
    return Plan("wfbp", [CommItem(0, (ParamSlice(param, 0, numel),), wire_dtype=wire_dtype)])


@pytest.mark.parametrize("wire", WIRES)
def test_the_plan_json_round_trips_the_wire_dtype(wire):
    plan = solve(_profile("float32", "float32"), "wfbp", wire_dtype=wire, first_bucket_bytes=4000)
    assert [item.wire_dtype for item in plan.items] == [wire, wire]
    data = json.loads(plan.to_json())
    assert [item["wire_dtype"] for item in data["items"]] == [wire, wire]
    assert data["options"]["wire_dtype"] == wire
    again = Plan.from_json(plan.to_json())
    assert again.items == plan.items and again.hash() == plan.hash()
    full = solve(_profile("float32", "float32"), "wfbp", first_bucket_bytes=4000)
    assert full.hash() != plan.hash()


def test_json_without_the_field_loads_as_float32_and_float32_plans_keep_their_form():
    plan = solve(_profile("float32", "float32"), "wfbp", first_bucket_bytes=4000)
    data = json.loads(plan.to_json())
    assert all("wire_dtype" not in item for item in data["items"]) and "wire_dtype" not in data["options"]
    old = Plan.from_dict(data)  # the JSON a plan had before the field existed
    assert [item.wire_dtype for item in old.items] == ["float32", "float32"]
    assert old.hash() == plan.hash()
    assert solve(_profile("float32"), "wfbp", wire_dtype="float32").hash() == solve(_profile("float32"), "wfbp").hash()


def test_the_table_shows_the_wire_dtype_and_its_bytes():
    profile = _profile("float32")
    table = _one_item_plan("float16").table(profile)
    header = table.splitlines()[1].split()
    row = dict(zip(header, table.splitlines()[3].split()))
    assert row["wire"] == "float16" and row["bytes"] == "2000"
    assert dict(zip(header, _one_item_plan("float32").table(profile).splitlines()[3].split()))["bytes"] == "4000"


@pytest.mark.parametrize("dtype, wire, message", [
    ("float32", "int4", "unknown wire dtype"),
    ("bfloat16", "int8", "cannot cross the link as int8"),
    ("bfloat16", "float16", "cannot cross the link as float16"),
    ("float16", "bfloat16", "cannot cross the link as bfloat16"),
    ("int64", "float16", "cannot cross the link as float16"),
])
def test_validation_refuses_a_wire_that_cannot_narrow(dtype, wire, message):
    with pytest.raises(ValueError, match=message):
        _one_item_plan(wire).validate(_profile(dtype))


def test_16_bit_gradients_keep_their_dtype_and_float64_narrows():
    profile = _profile("bfloat16", "float32", "float64")
    plan = solve(profile, "wfbp", wire_dtype="float16", first_bucket_bytes=1)
    assert {profile.params[item.slices[0].param].dtype: item.wire_dtype for item in plan.items} == {
        "bfloat16": "float32", "float32": "float16", "float64": "float16"}
    _one_item_plan("float16").validate(_profile("float64"))


# -- pricing -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("wire", WIRES)
def test_the_simulator_charges_a_16_bit_item_half_the_bytes(wire):
    profile = _profile("float32")
    link = profile.links[0]
    narrow, full = (_one_item_plan(w) for w in (wire, "float32"))
    assert narrow.items[0].nbytes(profile) == 2000 and full.items[0].nbytes(profile) == 4000
    assert simulate(profile, narrow).link_busy_ms == [pytest.approx(link.cost(2000))]
    assert simulate(profile, full).link_busy_ms == [pytest.approx(link.cost(4000))]


@pytest.mark.parametrize("policy", ["wfbp", "bytescheduler", "usbyte", "deft"])
def test_every_timing_policy_prices_a_fixed_wire_by_its_bytes(policy):
    """A policy asked for a 16-bit wire narrows every float32 item and its plan predicts from the narrowed bytes:
    the link is busy for half the bytes (wfbp: the same buckets, each at α + β·bytes/2)."""
    from deft_compile.planner.zoo_profiles import build_profile

    profile = build_profile("resnet101")
    full, narrow = (solve(profile, policy, **({"wire_dtype": "float16"} if n else {})) for n in (0, 1))
    assert {item.wire_dtype for item in narrow.items} == {"float16"}
    assert sum(item.nbytes(profile) for item in narrow.items) * 2 == sum(item.nbytes(profile) for item in full.items)
    narrow.validate(profile)
    assert narrow.predicted_iteration_ms == pytest.approx(simulate(profile, narrow).iteration_ms)
    if policy == "wfbp":
        assert [item.slices for item in narrow.items] == [item.slices for item in full.items]
        busy = sum(profile.links[0].cost(item.nbytes(profile) / 2) for item in full.items)
        assert simulate(profile, narrow).link_busy_ms == [pytest.approx(busy)]
    assert narrow.predicted_iteration_ms < full.predicted_iteration_ms or policy == "deft"


def test_the_allowed_wire_dtypes_are_checked():
    profile = _profile("float32")
    with pytest.raises(ValueError, match="not among the allowed"):
        solve(profile, "wfbp", wire_dtype="float16", wire_dtypes=["float32"])
    with pytest.raises(ValueError, match="dlcp"):
        solve(profile, "dlcp", wire_dtype="bfloat16")
    with pytest.raises(ValueError, match="average='gradients'"):
        solve(profile, "dssync", wire_dtype="bfloat16")
    assert solve(profile, "dssync", wire_dtype="bfloat16", average="gradients").items[0].wire_dtype == "bfloat16"
    assert DeftConfig().wire_dtypes == ("float32", "bfloat16", "float16")
    for bad in ({"wire_dtypes": ("float16",)}, {"wire_dtypes": ("float32", "int4")},
                {"wire_dtypes": ("float32",), "plan_options": {"wire_dtype": "float16"}}):
        with pytest.raises(ValueError):
            DeftConfig(**bad)


def test_a_plan_item_is_frozen_with_its_wire():
    item = _one_item_plan("bfloat16").items[0]
    assert dataclasses.replace(item, id=3).wire_dtype == "bfloat16" and item.narrowed


# -- what gloo takes -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("wire", WIRES)
def test_gloo_all_reduces_16_bit_tensors(outcome, wire):
    for value in outcome(("all-reduce", wire)):
        assert value["dtype"] == f"torch.{wire}"
        assert value["values"] == value["expected"]


def test_ddp_refuses_the_bf16_hook_by_name_not_gloo(outcome):
    """DDP's ``_check_comm_hook`` refuses a hook named ``bf16_compress_hook`` unless torch is a CUDA build with NCCL
    2.10+ (or XPU with XCCL), whatever the backend; the fp16 hook registers, and the bf16 hook's own code runs on
    gloo under another name (``wire_workers.bf16_hook``, used by the tests below)."""
    assert outcome(("hook by name", "float16")) == ["ok", "ok"]
    for value in outcome(("hook by name", "bfloat16")):
        assert value.startswith("TypeError: BF16 all reduce communication hook required CUDA 11+ and NCCL")


# -- the step against DDP with the hook --------------------------------------------------------------------------
def _check_graph(report: dict, wire: str) -> None:
    assert report["wire"] == [wire]
    code = report["code"]
    assert code.count("torch.ops._c10d_functional.all_reduce_.default(div__tensor") == report["items"], code
    assert code.count("_deft_wire_") >= report["items"]


@pytest.mark.parametrize("case", STEP_CASES)
@pytest.mark.parametrize("wire", WIRES)
def test_wfbp_with_a_16_bit_wire_is_ddp_with_the_compression_hook(outcome, wire, case):
    for rank, report in enumerate(outcome(("wfbp", wire, case))):
        assert report["compiler"] == "aten" and report["items"] >= 3
        _check_graph(report, wire)
        for entry in report["steps"]:
            where = f"{wire}/{case} rank {rank} step {entry['step']}: worst {entry['worst']}"
            assert entry["missing"] == [] and entry["compared"] > 0, where
            assert entry["max_abs"] == 0.0 and entry["loss_diff"] == 0.0, where
        # the same DDP without the hook trains other numbers: the wire was applied
        assert max(entry["sides"][0]["max_rel"] for entry in report["steps"]) > 0


@pytest.mark.parametrize("policy", PRIORITY_POLICIES)
@pytest.mark.parametrize("wire", WIRES)
def test_priority_plans_with_a_16_bit_wire_are_ddp_with_the_hook(outcome, wire, policy):
    """Their all-reduces are pending across calls (waited before each layer's next forward): the carried tensors
    are the 16-bit ones, and the updates DDP's with the hook, bit for bit, every step and after ``flush()``."""
    for rank, report in enumerate(outcome(("priority", wire, policy))):
        assert report["wire"] == [wire] and report["pending_dtypes"] == [f"torch.{wire}"]
        for entry in report["steps"] + [report["final"]]:
            assert entry["missing"] == [] and entry["max_abs"] == 0.0, f"{policy}/{wire} rank {rank}: {entry}"
        assert all(entry["deferred"] for entry in report["steps"]) and report["pending_after_flush"] == []


@pytest.mark.parametrize("delayed_update, accumulation", DELAYED_WIRE_CASES)
def test_delayed_buckets_carry_the_16_bit_tensor(outcome, delayed_update, accumulation):
    """deft's delayed buckets (launched in the next call) carry their 16-bit cast; every rank applies the same
    averages, so the replicas agree after ``flush()``."""
    results = outcome(("delayed", delayed_update, accumulation))
    for report in results:
        assert report["delayed"] > 0 and report["wire"] == ["float16"]
        assert report["pending_dtypes"] == ["torch.float16"] and report["finite"] and report["pending_after_flush"] == []
    assert results[0]["sums"] == results[1]["sums"]


@pytest.mark.parametrize("wire", WIRES)
def test_wfbp_with_a_16_bit_wire_on_inductor_is_ddp_with_the_hook_to_round_off(wire):
    results = run_local_workers(wire_beside_ddp, 2, ("transformer_sgd", STEPS, wire, "inductor"), timeout_s=800,
                                collective_timeout_s=600)
    for rank, result in enumerate(results):
        report = result.value
        assert report["compiler"] == "inductor"
        _check_graph(report, wire)
        drift = max(entry["sides"][1]["max_rel"] for entry in report["steps"])  # torch.compile with the hook
        assert worst(report["steps"]) > 0, "Inductor gave the aten numbers exactly: the compiled route did not run"
        check_within_drift(report["steps"], drift, f"{wire} rank {rank}")


# -- deft's choice by price (the solver's rules: tests/test_wire_choice.py) --------------------------------------
def test_deft_prices_each_16_bit_wire_on_its_first_call(outcome):
    """The defaults measure both 16-bit dtypes on the first call's gradients: every parameter priced, the same
    prices on every rank, float16 (11 significant bits) cheaper than bfloat16 (8) for gradients in its range; a
    narrowed bucket takes the cheaper dtype, and the plan table shows each item's wire."""
    results = outcome("prices")
    prices = results[0]["prices"]
    assert prices == results[1]["prices"], "every rank solves with the same prices"
    assert set(prices) == {"bfloat16", "float16"}
    for dtype in prices:
        assert set(prices[dtype]) == set(results[0]["names"]) and min(prices[dtype].values()) >= 0
    assert 0 < sum(prices["float16"].values()) < sum(prices["bfloat16"].values())
    for result in results:
        assert set(result["wire"]) <= {"float32", "float16"}, result["table"]
        assert all(wire in result["table"] for wire in result["wire"])
        assert result["wire_seconds"] > 0


def test_gradients_below_float16_s_range_never_cross_in_float16(outcome):
    """A loss scaled by 1e-9 puts every gradient below float16's smallest number once divided by the world size:
    float16 is priced at (about) each parameter's whole share of progress, a hundred times bfloat16's round-off,
    and no bucket crosses in float16."""
    for result in outcome("below float16"):
        prices = result["prices"]
        assert sum(prices["float16"].values()) > 100 * sum(prices["bfloat16"].values()), prices
        assert "float16" not in result["wire"], result["table"]


def test_a_float32_wire_is_one_setting_away(outcome):
    """``DeftConfig(wire_dtypes=("float32",))``: nothing measured, every item float32, DDP's numbers bit for bit on
    the aten route (the synchronous start)."""
    for result in outcome("float32 wire"):
        assert result["prices"] is None and set(result["wire"]) == {"float32"}
        for entry in result["steps"]:
            check_entry(entry, True, f"step {entry['step']}")


def test_where_no_price_can_buy_delays_a_measurement_prices_only_the_wire(outcome):
    """A margin no delay can gain (ten compute steps) leaves nothing for a staleness price to decide: every due
    measurement of a plan that narrows buckets is one eager pass pricing the wire, none is the two-pass staleness
    measurement, and the plan stays synchronous. With the default margin the same run measures staleness."""
    def run(margin: float) -> list[dict]:
        return outcome(("trade margin", margin))

    for result in run(10.0):
        assert "float16" in result["wire"] or "bfloat16" in result["wire"], result["table"]
        overheads = result["overheads"]
        # step 25 only: the first call priced the wire, and the early measurements (steps 5, 10) are staleness's
        assert overheads["staleness_probes"] == 0 and overheads["wire_probes"] == 1, overheads
        assert not any("staleness" in reason for reason in result["history"]), result["history"]
    for result in run(PreserverConfig().trade_margin):
        assert result["overheads"]["staleness_probes"] > 0, result["overheads"]
