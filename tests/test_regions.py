"""Regions (deft_compile/step/regions.py): fixed by the capture, the same whatever the plan.

Pure graph checks first (nothing compiled): which region each node is in, that every policy's plan leaves the
regions whole and structurally identical (so a plan change compiles nothing), that the program runs the
rewritten graph's numbers; then the compiled route in one process.
"""

from __future__ import annotations

import copy

import pytest
import torch

from bounds import check_difference
from deft_compile import DeftConfig, deft_compile
from deft_compile.debug.dump import GraphDumper
from deft_compile.passes.schedule import APPLY_NEXT_FORWARD, ItemPhase, pending_key
from deft_compile.planner.plan import LinkCost
from deft_compile.planner.solvers import solve
from deft_compile.step.capture import capture_step
from deft_compile.step.pipeline import CommGroup, annotate_capture, compile_captured
from deft_compile.step.regions import REGION, SCALAR, RegionalProgram, block_of
from deft_compile.step.scheduling import ProfileIndex, scheduled_items, static_profile
from deft_compile.tools.presets import GPT2Style

GROUP = CommGroup(name="fake_group", rank=0, world_size=2)
LAYERS = 3


def _gpt():
    torch.manual_seed(0)
    model = GPT2Style(vocab=64, dim=32, heads=2, layers=LAYERS, context=16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    return model, optimizer, (tokens, tokens.roll(1, 1))


def _capture(model, optimizer, batch):
    return capture_step(model, optimizer, None, batch, {}, [])


def _rewritten(captured, policy: str, phases=None, flush=False, **options):
    """The step graph of ``policy``'s plan on a synthetic slow link (so the plans partition and delay)."""
    index = ProfileIndex.of(annotate_capture(captured))
    profile = static_profile(captured, index, [LinkCost("link", 0.05, 2e-5)], 2)
    profile = type(profile)(**{**profile.__dict__, "params": [
        type(p)(**{**p.__dict__, "forward_ms": 0.2, "backward_ms": 0.4, "update_ms": 0.01}) for p in profile.params]})
    plan = solve(profile, policy, **options)
    items = scheduled_items(plan, index, [GROUP])
    config = DeftConfig(bucket_cap_mb=0.002, first_bucket_mb=0.001)
    copy_ = captured.copy_for_passes()
    gm = compile_captured(copy_, items, GROUP, config, GraphDumper(None), phases=phases, flush=flush).graph_module
    return gm, plan, items


def test_a_parameter_belongs_to_its_block():
    assert block_of("transformer.h.3.attn.c_attn.weight") == "transformer.h.3"
    assert block_of("h.0.ln_1.bias") == "h.0"
    assert block_of("transformer.wte.weight") == "transformer.wte"
    assert block_of("weight") == "weight"


def test_regions_follow_blocks_in_forward_and_backward_and_parameters_in_updates():
    model, optimizer, batch = _gpt()
    captured = _capture(model, optimizer, batch)
    gm, _, _ = _rewritten(captured, "wfbp", first_bucket_bytes=1 << 30, bucket_cap_bytes=1 << 30)
    regions = {n.meta[REGION] for n in gm.graph.nodes if REGION in n.meta}
    forward = {r for r in regions if r[0] == "forward"}
    backward = {r for r in regions if r[0] == "backward"}
    updates = {r for r in regions if r[0] == "update"}
    blocks = len({block_of(name) for name in captured.model_state.param_names})  # wte, wpe, h.0..2, ln_f
    assert blocks == LAYERS + 3
    assert len({r for r in forward if r[1] >= 0}) == blocks  # one region from each block's first parameter use
    assert len({r for r in backward if 0 <= r[1] < blocks}) == blocks  # one per block, in gradient-ready order
    assert len(updates) == len(captured.model_state.param_names)  # one per parameter (the tied head is the embedding)
    scalars = [n for n in gm.graph.nodes if n.meta.get(REGION) == SCALAR]
    assert scalars and all(not isinstance(n.meta.get("val"), torch.Tensor) for n in scalars)


@pytest.fixture(scope="module")
def captured_and_reference():
    """One capture for the plan checks, and the region keys of DDP's buckets' steady graph."""
    model, optimizer, batch = _gpt()
    captured = _capture(model, optimizer, batch)
    reference, _, _ = _rewritten(captured, "wfbp", first_bucket_bytes=1 << 30, bucket_cap_bytes=1 << 30)
    return captured, {s.key for s in RegionalProgram(reference).segments if s.is_region}


@pytest.mark.parametrize("policy, options", [
    ("wfbp", {"first_bucket_bytes": 1500, "bucket_cap_bytes": 6000}),
    ("bytescheduler", {}),
    ("usbyte", {}),
    ("deft", {"first_bucket_bytes": 1500, "bucket_cap_bytes": 6000, "allow_period": False}),
])
def test_every_plan_leaves_the_regions_whole_and_the_same(captured_and_reference, policy, options):
    """The plan's nodes land between regions (or move to a region's edge), never split one, and the regions of
    its steady graph, its first graph and its flush graph are structurally those of DDP's buckets' steady graph:
    a plan change compiles no region."""
    captured, reference_keys = captured_and_reference
    first, plan, items = _rewritten(captured, policy, **options)
    carried = {item.id: ItemPhase(pending_in=True) for item in items if item.apply != "this-step"}
    graphs = [first]
    if carried:
        graphs.append(_rewritten(captured, policy, phases=carried, **options)[0])
        graphs.append(_rewritten(captured, policy, phases=carried, flush=True, **options)[0])
    for gm in graphs:
        program = RegionalProgram(gm)
        assert program.split_regions == [], program.split_regions
        keys = {s.key for s in program.segments if s.is_region}
        assert keys <= reference_keys, f"{policy}: {len(keys - reference_keys)} region(s) no other plan has"
        assert any(not s.is_region for s in program.segments)  # the plan's glue runs between the regions
    if policy != "wfbp":
        assert len(plan.items) > 1


def test_a_later_plan_reuses_the_regions_an_earlier_plan_extracted(captured_and_reference):
    """Programs of one capture share their region segments (``templates``): another plan's graph, whose passes named
    the bucket views its updates read afresh, takes every update region from the first plan's program, and each
    segment it takes is the one it would have extracted (the same structure, read from the same inputs)."""
    captured, _ = captured_and_reference
    templates: dict = {}
    first = RegionalProgram(_rewritten(captured, "wfbp", first_bucket_bytes=1500, bucket_cap_bytes=6000)[0], templates)
    extracted = {id(s.module) for s in first.segments if s.is_region}
    _, _, items = _rewritten(captured, "usbyte")
    carried = {item.id: ItemPhase(pending_in=True) for item in items if item.apply == APPLY_NEXT_FORWARD}
    for policy, options in (("wfbp", {"first_bucket_bytes": 1 << 30, "bucket_cap_bytes": 1 << 30}),
                            ("usbyte", {"phases": carried})):  # its steady graph: updates before the forward
        gm = _rewritten(captured, policy, **options)[0]
        program, fresh = RegionalProgram(gm, templates), RegionalProgram(gm)
        updates = [s for s in program.segments if s.is_region and s.region[0] == "update"]
        assert updates and all(id(s.module) in extracted for s in updates), policy
        for reused, own in zip(program.segments, fresh.segments):
            assert reused.region == own.region and reused.key == own.key, (policy, own.region)
            assert reused.inputs == own.inputs and reused.outputs == own.outputs, (policy, own.region)


@pytest.mark.parametrize("policy", ["bytescheduler", "usbyte"])
def test_an_update_moved_before_a_layer_runs_before_every_forward_region_that_reads_its_parameter(
        captured_and_reference, policy):
    """The update is written in place into the parameter: the forward's read of it is no graph edge, yet the
    program must keep the graph's order (else the layer runs with last step's weights)."""
    captured, _ = captured_and_reference
    _, _, items = _rewritten(captured, policy)
    carried = {item.id: ItemPhase(pending_in=True) for item in items if item.apply == APPLY_NEXT_FORWARD}
    assert carried, f"{policy} moves updates into the next forward"
    gm, _, _ = _rewritten(captured, policy, phases=carried)
    program = RegionalProgram(gm)
    params = program.placeholders[: gm.meta["deft_layout"].num_params]
    updated_at = {s.region[1]: i for i, s in enumerate(program.segments) if s.is_region and s.region[0] == "update"}
    checked = 0
    for index, segment in enumerate(program.segments):
        if segment.is_region and segment.region[0] == "forward":
            for p, param in enumerate(params):
                if param in segment.inputs and p in updated_at:
                    assert updated_at[p] < index, f"{policy}: parameter {p}'s update runs after forward {segment.region}"
                    checked += 1
    assert checked > 0


def test_the_program_computes_what_the_graph_computes():
    """Segments run as aten (no compiler) give the graph's own outputs and in-place updates, bit for bit."""
    model, optimizer, batch = _gpt()
    captured = _capture(model, optimizer, batch)
    gm, _, _ = _rewritten(captured, "wfbp", first_bucket_bytes=1 << 30, bucket_cap_bytes=1 << 30)
    gm = compile_captured(captured.copy_for_passes(), [], None, DeftConfig(), GraphDumper(None)).graph_module
    params = [p.detach().clone() for p in model.parameters()]
    from deft_compile.step.optim_support import hyperparameter_inputs

    inputs = [*params, *batch, *hyperparameter_inputs(optimizer)]
    twin = [t.clone() for t in inputs]
    with torch.no_grad():
        expected = gm(*inputs)
        program = RegionalProgram(gm)
        actual = program.run(twin, lambda segment, values: segment.module(*values))
    assert len(expected) == len(actual)
    for a, b in zip(expected, actual):
        assert torch.equal(a, b)
    for a, b in zip(inputs, twin):  # parameters updated in place alike
        assert torch.equal(a, b)


def _update_distance(model: torch.nn.Module, reference: torch.nn.Module, start: list[torch.Tensor]) -> float:
    """The norm of ``model``'s parameters' difference from ``reference``'s over the norm of ``reference``'s update
    from ``start``, over the whole model (element-wise, Adam turns the round-off of the attention key bias's
    mathematically zero gradient into steps of size lr, in any two implementations)."""
    with torch.no_grad():
        difference = sum(float((a - b).double().pow(2).sum())
                         for a, b in zip(model.parameters(), reference.parameters()))
        update = sum(float((b - p0).double().pow(2).sum()) for b, p0 in zip(reference.parameters(), start))
    return (difference / update) ** 0.5


def test_the_first_call_compiles_only_what_inductors_cache_holds(tmp_path, monkeypatch):
    """``aten_first_call``: on an empty Inductor cache the first call compiles one region, finds it missed the
    cache and runs the others as aten; the second call compiles them. A second step of the same model then finds
    every region in the cache on its first call and runs compiled from it. Off, the first call compiles all."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch._dynamo.reset()

    def first_two_calls(**config):
        model, optimizer, batch = _gpt()
        step = deft_compile(model, optimizer, None, config=DeftConfig(compiler="inductor", **config))
        step(*batch)
        after_first = ([dict(entry) for entry in step.lowering.history], step.compiler)
        step(*batch)
        return after_first, ([dict(entry) for entry in step.lowering.history], step.compiler)

    (first, ran), (both, ran_second) = first_two_calls()
    assert len(first) == 1 and not first[0]["cache_hit"] and ran == "aten", first
    assert len(both) > 1 and ran_second == "inductor" and all(not entry["cache_hit"] for entry in both)
    (first, ran), (again, _) = first_two_calls()
    assert len(first) == len(both) and all(entry["cache_hit"] for entry in first) and ran == "inductor", first
    assert len(again) == len(first)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor-off"))
    (first, ran), _ = first_two_calls(aten_first_call=False)
    assert len(first) == len(both) and ran == "inductor"


def test_local_regional_step_compiles_once_and_matches_aten():
    """One process, Inductor in regions: AdamW's first step compiles what Inductor's cache holds and runs the rest
    as aten (``aten_first_call``), the second compiles the rest, with the optimizer state there from the first
    capture (``optim_support.initialize_state``), and nothing after; parameters match the aten route
    to float32 round-off: within
    ``DRIFT_MULTIPLE`` times torch.compile's own difference from eager on the same model, batch and steps, measured
    here (tests/bounds.py)."""
    model, optimizer, batch = _gpt()
    reference = copy.deepcopy(model)
    start = [p.detach().clone() for p in model.parameters()]
    steps = {
        "inductor": deft_compile(model, optimizer, None, config=DeftConfig(compiler="inductor")),
        "aten": deft_compile(reference, torch.optim.AdamW(reference.parameters(), lr=1e-3), None,
                             config=DeftConfig(compiler="aten")),
    }
    compiles = []
    for t in range(4):
        for step in steps.values():
            step(*batch)
        compiles.append(len(steps["inductor"].lowering.history))
    assert 0 < compiles[0] <= compiles[1] == compiles[2] == compiles[3], compiles
    assert steps["inductor"].compiler == "inductor"
    # the yardstick: the model compiled by torch.compile and the eager one, each with the eager AdamW
    eager, compiled = _gpt()[0], _gpt()[0]
    torch._dynamo.reset()  # a fresh recompile budget: past it Dynamo runs the model eagerly
    for twin, forward in ((eager, eager), (compiled, torch.compile(compiled))):
        twin_optimizer = torch.optim.AdamW(twin.parameters(), lr=1e-3)
        for _ in range(4):
            twin_optimizer.zero_grad(set_to_none=True)
            forward(*batch).backward()
            twin_optimizer.step()
    torch._dynamo.reset()
    check_difference(_update_distance(model, reference, start), _update_distance(compiled, eager, start),
                     "parameters over the update")


def test_pending_keys_are_carried_by_the_program():
    """A delayed plan's steady graph: the carried gradient enters and leaves through the program's glue."""
    model, optimizer, batch = _gpt()
    captured = _capture(model, optimizer, batch)
    options = {"first_bucket_bytes": 1500, "bucket_cap_bytes": 6000, "allow_period": False}
    _, _, items = _rewritten(captured, "deft", **options)
    delayed = [item for item in items if item.apply == "next-update"]
    assert delayed, "the synthetic link makes the knapsack delay"
    gm, _, _ = _rewritten(captured, "deft", phases={i.id: ItemPhase(pending_in=True) for i in delayed}, **options)
    layout = gm.meta["deft_layout"]
    assert {pending_key(i.id) for i in delayed} <= set(layout.carry_inputs)
    program = RegionalProgram(gm)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    carried = placeholders[-len(layout.carry_inputs):]
    assert all(any(node in s.inputs for s in program.segments if not s.is_region) for node in carried)


def test_shared_compiles_deal_out_new_regions_and_change_no_number():
    """Rank 1 of 2 compiles every second new region (from the capture's input metadata) before the graph first
    runs and the rest as the run reaches them; the compiled regions are the same, the run-time signatures find the
    ones compiled ahead, and the step computes what an unshared step computes, to the bit. Compiled from the first
    call (``aten_first_call=False``), whatever Inductor's cache holds: with the rule on, a first call shares
    nothing and the second call deals out what it left."""
    model, optimizer, batch = _gpt()
    twin = copy.deepcopy(model)
    config = DeftConfig(compiler="inductor", aten_first_call=False)
    shared = deft_compile(model, optimizer, None, config=config)
    alone = deft_compile(twin, torch.optim.AdamW(twin.parameters(), lr=1e-3), None, config=config)
    shared.lowering.share_compiles(1, 2)
    for _ in range(3):
        shared(*batch)
        alone(*batch)
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)
    compiled = [entry["key"] for entry in shared.lowering.history]
    assert sorted(compiled) == sorted(entry["key"] for entry in alone.lowering.history), "the same regions, once"
    program = shared.lowering.program(next(iter(shared.lowering._programs.keys())))
    # a compile's identity: the structure, or for element-wise updates the optimizer form all of them share
    new = list(dict.fromkeys(shared.lowering.regions.identity(s) for s in program.segments if s.is_region))
    ahead = new[1::2]
    assert compiled[: len(ahead)] == ahead, "the share compiled first, in program order"
    assert compiled[len(ahead): len(new)] == [key for key in new if key not in ahead]
    with pytest.raises(ValueError, match="rank 2"):
        shared.lowering.share_compiles(2, 2)
