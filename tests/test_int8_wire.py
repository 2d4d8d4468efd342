"""The 8-bit wire (``wire_dtype="int8"``): a plan item's gradients cross the link as blocks of 8-bit integers with a
float32 scale each, gathered from every rank and summed locally (``passes/schedule.py``).

Plan data and pricing in one process; then, 2 gloo processes on the aten route:

- ``wfbp`` with every bucket on the 8-bit wire against DDP with a comm hook of the same arithmetic
  (``wire_workers.int8_hook``, per parameter): bit-identical parameters, gradients and momentum after every step
  (``wfbp``'s buckets hold whole parameters, so its blocks are the hook's); plain DDP differs, so the wire ran.
- Priority plans cut parameters into partitions, and their blocks start at each partition: the pending tensors
  are the gathered bytes, the replicas agree, and the parameters stay within the quantization's error of the
  hook's.
- Delayed buckets carry their 8-bit bytes under every delayed semantics; the replicas agree after ``flush()``.
- A checkpoint holding pending 8-bit bytes resumes bit for bit.
- ``deft`` allowed the 8-bit wire prices it on its first call beside the 16-bit ones.

One Inductor run checks the compiled route against DDP with the hook around ``torch.compile(model)``
(tests/bounds.py).
"""

from __future__ import annotations

import pytest
import torch

from batched import Case, launch_cases
from bounds import check_within_drift, worst
from deft_compile import DeftConfig
from deft_compile.planner.plan import (DEFAULT_WIRE_DTYPES, INT8_BLOCK, WIRE_DTYPES, CommItem, LinkCost, ParamProfile, ParamSlice, Plan,
                                       Profile)
from deft_compile.planner.simulator import simulate
from deft_compile.planner.solvers import solve
from deft_compile.planner.wire import choose_wire
from deft_compile.preserver.wire_error import cast_error_norms, int8_round_trip
from deft_compile.tools.launcher import run_local_workers
from wire_workers import (deft_chooses_wire, delayed_wire_run, int8_bytes, int8_sum, priority_wire_beside_ddp,
                          wire_beside_ddp)
from workers import checkpoint_run

STEPS = 5
SMALL_BUCKETS = {"first_bucket_mb": 0.0002, "bucket_cap_mb": 0.004}
DELAYED_CASES = [("compensated", 1), ("averaged", 2), ("local", 1)]

CASE_LIST = (
    [Case(("wfbp", case), wire_beside_ddp, (case, STEPS, "int8"),
          tests=(f"test_wfbp_on_the_8_bit_wire_is_ddp_with_its_hook[{case}]",))
     for case in ("mlp_dropout_sgd", "transformer_sgd")]
    + [Case(("priority", policy), priority_wire_beside_ddp, ("mlp_dropout_sgd", STEPS, policy, "int8"),
            tests=(f"test_priority_plans_carry_the_gathered_bytes[{policy}]",))
       for policy in ("bytescheduler", "usbyte")]
    + [Case(("delayed", delayed_update, accumulation), delayed_wire_run,
            ("mlp_dropout_sgd", 6, "int8", accumulation, delayed_update),
            tests=(f"test_delayed_buckets_carry_the_8_bit_bytes[{delayed_update}-{accumulation}]",))
       for delayed_update, accumulation in DELAYED_CASES]
    + [Case("prices", deft_chooses_wire, ("mlp_dropout_sgd", 4, {**SMALL_BUCKETS, "wire_dtypes": WIRE_DTYPES}),
            tests=("test_deft_allowed_the_8_bit_wire_prices_it_beside_the_16_bit_ones",))]
)




@pytest.fixture(scope="module")
def outcome(request, tmp_path_factory):
    path = f"{tmp_path_factory.mktemp('int8')}/ckpt"
    resume = [Case(("checkpoint", run), checkpoint_run, ("mlp_dropout_sgd", start, stop, load, save, "compensated",
                                                         "deft-int8"),
                   tests=("test_a_checkpoint_with_pending_8_bit_bytes_resumes_exactly",))
              for run, start, stop, load, save in (("straight", 0, 10, None, None), ("first", 0, 5, None, path),
                                                   ("resumed", 5, 10, path, None))]
    return launch_cases(request, CASE_LIST + resume, timeout_s=900.0)


def _profile(world_size: int = 2, numel: int = 1000) -> Profile:
    return Profile([ParamProfile("p0", numel, "float32", 1.0, 1.0, 0.1, layer=0)], [LinkCost("link", 0.5, 0.001)],
                   world_size=world_size)


# -- plan data and the link's bytes --------------------------------------------------------------------------------
def test_an_8_bit_item_costs_a_byte_and_a_scale_per_block_scaled_to_an_all_gather():
    """An all-gather of n bytes per rank moves (W − 1)·n per rank, a ring all-reduce of n bytes 2(W − 1)/W·n: the
    8-bit wire's bytes count W / 2 times in the link's all-reduce cost (at 2 ranks, once)."""
    item = CommItem(0, (ParamSlice(0, 0, 25_600),), wire_dtype="int8")
    per_element = 1 + 4 / INT8_BLOCK
    assert item.nbytes(_profile(2, 25_600)) == int(25_600 * per_element)
    assert item.nbytes(_profile(8, 25_600)) == int(25_600 * per_element * 4)
    plan, profile = Plan("wfbp", [item]), _profile(2, 25_600)
    assert simulate(profile, plan).link_busy_ms == [pytest.approx(profile.links[0].cost(25_600 * per_element))]


def test_the_8_bit_wire_is_allowed_only_when_asked():
    assert "int8" not in DeftConfig().wire_dtypes
    assert DeftConfig(wire_dtypes=("float32", "int8")).wire_dtypes == ("float32", "int8")
    profile = _profile()
    with pytest.raises(ValueError, match="not among the allowed"):
        solve(profile, "wfbp", wire_dtype="int8", wire_dtypes=DEFAULT_WIRE_DTYPES)  # what DeftConfig() passes
    plan = solve(profile, "wfbp", wire_dtype="int8", wire_dtypes=WIRE_DTYPES)
    assert [item.wire_dtype for item in plan.items] == ["int8"] and "int8" in plan.table(profile)
    # prices of a dtype not allowed are dropped: the defaults never choose it
    prices = {dtype: {"p0": 0.0} for dtype in ("float16", "int8")}
    assert {item.wire_dtype for item in solve(profile, "deft", max_staleness=0, wire_prices=prices,
                                              wire_dtypes=DEFAULT_WIRE_DTYPES).items} == {"float16"}


def test_a_bucket_takes_the_wire_that_saves_the_most_net_of_its_price():
    """The 8-bit wire saves half as much again as a 16-bit one; it is chosen where that beats its higher price."""
    params = [ParamProfile(f"p{i}", 250_000, "float32", 1.0, 1.0, 0.0, layer=1 - i) for i in range(2)]
    profile = Profile(params, [LinkCost("l", 0.5, 1e-6)], world_size=2)
    buckets = profile.buckets(1_000_000, 1_000_000)
    # link: 1.0 ms for a float32 bucket, 0.5 ms in 16 bits, about 0.25 ms in 8 bits; step 10 ms, compute 8 ms
    cheap = {"float16": {"p0": 0.01, "p1": 0.01}, "int8": {"p0": 0.05, "p1": 0.3}}
    choice = choose_wire(profile, buckets, cheap, 10.0, 8.0)
    by_param = {profile.params[bucket[0]].name: dtype for bucket, dtype in zip(buckets, choice)}
    # p0: int8 saves ~0.75 ms - 0.0625 lost against float16's 0.5 - 0.0125; p1: int8's 0.375 ms lost is too dear
    assert by_param == {"p0": "int8", "p1": "float16"}


# -- the rounding and its price --------------------------------------------------------------------------------------
def test_the_priced_round_trip_is_the_wire_s_own_arithmetic():
    torch.manual_seed(0)
    g = torch.randn(1000) * torch.logspace(-3, 1, 1000)
    g[300:556] = 0.0  # a zero block stays zero
    assert torch.equal(int8_round_trip(g), int8_sum(int8_bytes(g).view(1, -1), g.numel()))
    assert torch.equal(int8_round_trip(g)[300:556], torch.zeros(256))
    error = (int8_round_trip(g) - g).abs()
    scale = torch.nn.functional.pad(g, (0, 24)).view(-1, INT8_BLOCK).abs().amax(1) / 127
    assert bool((error.view(-1)[:768].view(3, -1) <= scale[:3, None] / 2 * (1 + 1e-6)).all()), "half a step at most"


def test_the_8_bit_wire_is_priced_above_float16_and_below_a_whole_share():
    torch.manual_seed(0)
    g = torch.randn(4096)
    norm, square, fp16, int8 = cast_error_norms([g], 2, ["float16", "int8"])
    assert square == pytest.approx(norm ** 2)
    assert 0 < fp16 < int8 < 0.02 * norm / 2, (fp16, int8, norm)


# -- 2 processes -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["mlp_dropout_sgd", "transformer_sgd"])
def test_wfbp_on_the_8_bit_wire_is_ddp_with_its_hook(outcome, case):
    for rank, report in enumerate(outcome(("wfbp", case))):
        assert report["compiler"] == "aten" and report["items"] >= 3 and report["wire"] == ["int8"]
        assert report["code"].count("all_gather_into_tensor") >= report["items"]
        assert "all_reduce" not in report["code"]
        for entry in report["steps"]:
            where = f"{case} rank {rank} step {entry['step']}: worst {entry['worst']}"
            assert entry["missing"] == [] and entry["compared"] > 0, where
            assert entry["max_abs"] == 0.0 and entry["loss_diff"] == 0.0, where
        assert max(entry["sides"][0]["max_rel"] for entry in report["steps"]) > 0


@pytest.mark.parametrize("policy", ["bytescheduler", "usbyte"])
def test_priority_plans_carry_the_gathered_bytes(outcome, policy):
    results = outcome(("priority", policy))
    for report in results:
        assert report["wire"] == ["int8"] and report["pending_dtypes"] == ["torch.uint8"]
        assert report["pending_after_flush"] == [] and all(entry["deferred"] for entry in report["steps"])
        # partitions start their blocks elsewhere than the hook's per-parameter blocks: close, not equal
        assert max(entry["max_abs"] for entry in report["steps"] + [report["final"]]) < 1e-2
    assert results[0]["final"] == results[1]["final"]


@pytest.mark.parametrize("delayed_update, accumulation", DELAYED_CASES)
def test_delayed_buckets_carry_the_8_bit_bytes(outcome, delayed_update, accumulation):
    results = outcome(("delayed", delayed_update, accumulation))
    for report in results:
        assert report["delayed"] > 0 and report["wire"] == ["int8"]
        assert report["pending_dtypes"] == ["torch.uint8"] and report["finite"] and report["pending_after_flush"] == []
    assert results[0]["sums"] == results[1]["sums"]


def test_a_checkpoint_with_pending_8_bit_bytes_resumes_exactly(outcome):
    """Ten compensated steps straight, against five saved with their pending bytes and five resumed in new step
    objects: the same parameters, optimizer state and pending bytes, bit for bit."""
    straight, first, resumed = (outcome(("checkpoint", run)) for run in ("straight", "first", "resumed"))
    for rank in range(2):
        assert first[rank]["pending_before_save"] > 0, "the checkpoint must carry pending bytes"
        expected, actual = straight[rank], resumed[rank]
        assert expected["state"].keys() == actual["state"].keys() and actual["step_count"] == 10
        for name, tensor in expected["state"].items():
            assert torch.equal(tensor, actual["state"][name]), f"rank {rank}: {name} differs after resuming"
        assert {str(t.dtype) for t in expected["pending"].values()} == {"torch.uint8"}
        for item, tensor in expected["pending"].items():
            assert torch.equal(tensor, actual["pending"][item]), f"rank {rank}: pending item {item} differs"


def test_deft_allowed_the_8_bit_wire_prices_it_beside_the_16_bit_ones(outcome):
    results = outcome("prices")
    prices = results[0]["prices"]
    assert prices == results[1]["prices"] and set(prices) == {"bfloat16", "float16", "int8"}
    assert set(prices["int8"]) == set(results[0]["names"])
    assert sum(prices["float16"].values()) < sum(prices["int8"].values())
    for result in results:
        assert set(result["wire"]) <= set(WIRE_DTYPES), result["table"]


def test_wfbp_on_the_8_bit_wire_on_inductor_is_ddp_with_its_hook_to_round_off():
    results = run_local_workers(wire_beside_ddp, 2, ("transformer_sgd", 6, "int8", "inductor"), timeout_s=800,
                                collective_timeout_s=600)
    for rank, result in enumerate(results):
        report = result.value
        assert report["compiler"] == "inductor" and report["wire"] == ["int8"]
        assert report["code"].count("all_gather_into_tensor") >= report["items"]
        drift = max(entry["sides"][1]["max_rel"] for entry in report["steps"])  # torch.compile with the hook
        assert worst(report["steps"]) > 0, "Inductor gave the aten numbers exactly: the compiled route did not run"
        check_within_drift(report["steps"], drift, f"int8 rank {rank}")


def test_the_closed_loop_re_solves_a_plan_on_the_8_bit_wire():
    """The closed loop re-solves from a plan's recorded options, which do not list the dtypes allowed: its refined
    re-solve and its synchronous candidate keep a plan's 8-bit wire instead of refusing it."""
    from deft_compile.planner.closed_loop import refined_plan, synchronous_candidate
    from deft_compile.planner.zoo_profiles import build_profile

    profile = build_profile("resnet101")
    own = {"wire_dtype": "int8", "wire_dtypes": WIRE_DTYPES}
    initial = solve(profile, "deft", **own)
    assert "wire_dtypes" not in initial.options
    assert {item.wire_dtype for item in refined_plan(profile, "deft", initial, own).items} == {"int8"}
    wfbp = solve(profile, "wfbp", **own)
    candidate = synchronous_candidate("wfbp", wfbp, profile, lambda options: None)
    assert {item.wire_dtype for item in candidate.items} == {"int8"}
