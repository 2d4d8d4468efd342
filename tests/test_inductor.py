"""Inductor lowering of the step graph (deft_compile/step/lowering.py).

Kept small: each Inductor compile of a step graph takes seconds on CPU, so the
rest of the suite runs the graphs as aten (tests/conftest.py).

Every comparison of an Inductor-compiled step with a reference is bounded by ``DRIFT_MULTIPLE`` times the yardstick
measured beside it (the reference with the model compiled by ``torch.compile``, against the reference), or by a
written round-off analysis (tests/bounds.py).
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from bounds import UNIT_ROUND_OFF, check_difference, check_within_drift, worst
from deft_compile import DeftConfig, deft_compile
from deft_compile.passes.scalars import tensorize_item_reads
from deft_compile.step import lowering
from deft_compile.step.capture import capture_step
from deft_compile.step.optim_support import hyperparameter_inputs
from deft_compile.tools.launcher import run_local_workers
from default_route_workers import delayed_beside_compile, with_yardstick
from inductor_workers import inductor_vs_ddp
from workers import policy_with_lr_schedule_beside_ddp

# Cold Inductor compiles (deft's and its yardstick's) on a 2-core host take minutes per launch when the host is busy;
# this is a hang guard.
pytestmark = pytest.mark.timeout(900)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))


def _batches(n: int):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(n)]


def test_compiler_option_and_environment(monkeypatch):
    assert DeftConfig(compiler="aten").compiler == "aten"
    with pytest.raises(ValueError,
                       match="DeftConfig.compiler must be one of 'inductor', 'inductor-graph', 'aten'; got 'tvm'"):
        DeftConfig(compiler="tvm")
    monkeypatch.setenv("DEFT_COMPILER", "inductor")
    assert DeftConfig().compiler == "inductor"
    monkeypatch.delenv("DEFT_COMPILER")
    assert DeftConfig().compiler == "inductor"
    monkeypatch.setenv("DEFT_COMPILER", "nope")
    with pytest.raises(ValueError, match=r"\$DEFT_COMPILER must be one of"):
        DeftConfig()


def test_item_reads_become_tensor_arithmetic():
    """AdamW's lr and weight decay enter as 0-dim float64 inputs read with .item(); after the pass no .item() is
    left and the graph computes the same update (to float32 round-off: alpha= becomes a separate multiply)."""
    model = _mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    x, y = _batches(1)[0]
    captured = capture_step(model, optimizer, F.cross_entropy, (x, y), {}, [])
    item = torch.ops.aten._local_scalar_dense.default
    assert any(n.target is item for n in captured.graph_module.graph.nodes)
    tensorized = tensorize_item_reads(lowering._copy(captured.graph_module))
    assert not any(n.target is item for n in tensorized.graph.nodes)
    assert any(n.target is item for n in captured.graph_module.graph.nodes), "the original graph is untouched"
    results = []
    for gm in (captured.graph_module, tensorized):
        params = [p.detach().clone() for p in model.parameters()]
        with torch.no_grad():
            gm(*params, x, y, *hyperparameter_inputs(optimizer))
        results.append(params)
    for a, b in zip(*results):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference of ``a`` from ``b`` over ``b``'s largest magnitude."""
    return ((a - b).abs().max() / b.abs().max()).item()


def _adamw_under_step_lr(model: nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.StepLR]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.8)


@pytest.fixture(scope="module")
def adamw_under_step_lr_drift() -> float:
    """The yardstick of the local AdamW runs (tests/bounds.py): ``_mlp()`` compiled by ``torch.compile`` against the
    eager one, each with the eager AdamW and StepLR on the same batches; the largest relative difference of a
    parameter after the run."""
    eager, compiled = _mlp(), _mlp()
    torch._dynamo.reset()  # a fresh recompile budget: past it Dynamo runs the model eagerly
    # (``torch.compile(model)``: ``nn.Module.compile`` compiles nothing of a ``torch.nn`` container of ``torch.nn``
    # layers, whose frames Dynamo skips)
    for model, forward in ((eager, eager), (compiled, torch.compile(compiled))):
        optimizer, schedule = _adamw_under_step_lr(model)
        for x, y in _batches(4):
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(forward(x), y).backward()
            optimizer.step()
            schedule.step()
    torch._dynamo.reset()
    return max(_relative(a.detach(), b.detach()) for a, b in zip(compiled.parameters(), eager.parameters()))


@pytest.mark.parametrize("whole", [False, True])
def test_local_inductor_step_matches_aten_and_reuses_graph_under_lr_schedule(caplog, monkeypatch, whole,
                                                                             adamw_under_step_lr_drift):
    """One graph for a whole LR schedule, the aten route's numbers to round-off (within ``DRIFT_MULTIPLE`` times
    torch.compile's own difference from eager on the same model, optimizer, schedule and batches). Regional (the
    default): its first run compiles what Inductor's cache holds (``aten_first_call``), its regions are all compiled
    by the second run and the LR changes compile nothing more. Whole-graph (``inductor-graph``): compiled on its
    second run."""
    monkeypatch.setattr(lowering, "REGION_CACHES", False)  # every region keeps its generated code for the check
    inductor = "inductor-graph" if whole else "inductor"
    models = {c: _mlp() for c in ("aten", inductor)}
    steps = {}
    for compiler, model in models.items():
        optimizer, schedule = _adamw_under_step_lr(model)
        steps[compiler] = step = deft_compile(model, optimizer, F.cross_entropy, config=DeftConfig(compiler=compiler))
        compiled_by_call = []
        with caplog.at_level(logging.INFO, logger="deft_compile"):
            for x, y in _batches(4):
                step(x, y)
                schedule.step()
                compiled_by_call.append(len(step.lowering.history))
    assert steps[inductor].compiler == "inductor" and steps["aten"].compiler == "aten"
    # one graph: the optimizer state exists from the first capture (optim_support.initialize_state), and the
    # learning rate's changes reuse it
    assert steps[inductor].trace_count == 1
    history = steps[inductor].lowering.history
    assert history and all(h["compiler"] == "inductor" for h in history)
    if whole:
        assert len(history) == 1 and "Inductor compiled step graph" in caplog.text
    else:
        # the first call (regions from the cache, or as aten from the first miss), the second's compiles if it had
        # any; nothing more
        assert steps[inductor].lowering.cold_runs in (1, 2) and compiled_by_call[1] == compiled_by_call[-1] > 0
        assert "region(s) of the step graph" in caplog.text
    differences = {name: _relative(a.detach(), b.detach())
                   for (name, a), b in zip(models[inductor].named_parameters(), models["aten"].parameters())}
    name = max(differences, key=differences.get)
    check_difference(differences[name], adamw_under_step_lr_drift, f"{inductor}, worst {name}")
    # AdamW's per-parameter scalars (bias corrections: pow in float64) are computed once per step, not
    # inside the element loops (lowering.RealizeScalars)
    source = steps[inductor].lowering.last.source_code
    assert "std::pow" in source and _lines_inside_loops(source, "std::pow") == 0


def _lines_inside_loops(source: str, needle: str) -> int:
    """How many lines containing ``needle`` lie inside a ``for`` loop of the generated C++ kernels."""
    count, braces, pending = 0, [], False
    for line in source.splitlines():
        stripped = line.strip()
        if stripped.startswith("for("):
            pending = True
        if needle in line and any(braces):
            count += 1
        for ch in stripped:
            if ch == "{":
                braces.append(pending)
                pending = False
            elif ch == "}" and braces:
                braces.pop()
    return count


def _tanh_gelu_bounds(x: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """How far ``lowering``'s sigmoid form of GELU(tanh) in float32 and ATen's tanh form in float64 may each lie from
    the exact values, per element, to first order in ``u = 2**-24`` and ``v = 2**-53`` (tests/bounds.py): the sum of
    the two, forward and backward.

    Every float32 operation rounds once (relative ``u``, the constants ``kappa`` and ``2K = 2 sqrt(2/pi)`` too) and
    ``exp`` lies within 2 ulps (``4u``; Sleef's and glibc's are within 1). ``z = 2K (x + kappa x**3)`` sums two
    terms of one sign: within ``7u |z|``. ``s = sigmoid(z) = 1 / (1 + exp(-z))`` then moves by ``(1 - s) |dz|``
    relative and rounds in ``exp``, the sum and the division: ``e_s = ((1 - s)(4 + 7|z|) + 2) u`` relative; ``1 - s
    = sigmoid(-z)``, computed as such, ``e_m = (s (4 + 7|z|) + 2) u``. Forward ``y = x s``: ``|y| (e_s + u)``.
    Backward ``grad (s + slope)``, ``slope = x s sigmoid(-z) du``, ``du = 2K (1 + 3 kappa x**2)`` (a sum of
    positive terms: ``6u``): ``slope`` within ``e_s + e_m + 9u`` relative; the sum, which cancels for negative
    ``x``, within ``s e_s + |slope| (e_s + e_m + 9u) + u |s + slope|``, and the product with ``grad`` one more ``u``.
    ATen's float64 kernels compute ``0.5 x (1 + t)`` and ``0.5 (1 + t) + 0.5 x (1 - t**2) du / 2`` with ``t =
    tanh(z / 2)`` within 2 ulps, which cancel near saturation: within ``8 v |x|`` forward and ``8 v |grad| (1 + |x|
    du)`` backward (``(1 - t**2) |z / 2|``, the sensitivity of ``t`` to its argument's round-off, is below 0.45)."""
    u, v = UNIT_ROUND_OFF, 2.0 ** -53
    x, grad = x.double(), grad.double()
    twice_k, kappa = 2.0 * math.sqrt(2.0 / math.pi), 0.044715
    z = twice_k * (x + kappa * x ** 3)
    s, m = torch.sigmoid(z), torch.sigmoid(-z)
    e_s, e_m = (m * (4 + 7 * z.abs()) + 2) * u, (s * (4 + 7 * z.abs()) + 2) * u
    du = twice_k * (1 + 3 * kappa * x ** 2)
    slope = x * s * m * du
    forward = (x * s).abs() * (e_s + u) + 8 * v * x.abs()
    backward = (grad.abs() * (s * e_s + slope.abs() * (e_s + e_m + 9 * u) + 2 * u * (s + slope).abs())
                + 8 * v * grad.abs() * (1 + x.abs() * du))
    return forward, backward


def test_tanh_gelu_rewrite_is_accurate():
    """The sigmoid form of GELU(tanh) the step graph gives Inductor: forward and backward, per element, within the
    written round-off bound of the float32 form plus that of ATen's float64 kernels (``_tanh_gelu_bounds``) of
    them, finite at the extremes; the erf GELU is left alone."""
    from torch.fx.experimental.proxy_tensor import make_fx

    aten = torch.ops.aten

    def fn(x, grad):
        return F.gelu(x, approximate="tanh"), aten.gelu_backward(grad, x, approximate="tanh"), F.gelu(x)

    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(4096, generator=g) * 3,
                   torch.tensor([-100.0, -30.0, -9.0, -1e-6, 0.0, 1e-6, 9.0, 100.0])])
    grad = torch.randn(x.shape, generator=g)
    gm = lowering.decompose_tanh_gelu(make_fx(fn, tracing_mode="fake")(x, grad))
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert aten.gelu_backward.default not in targets and targets.count(aten.gelu.default) == 1  # the erf one
    ours = gm(x, grad)
    reference = fn(x.double(), grad.double())
    for got, want, bound in zip(ours[:2], reference[:2], _tanh_gelu_bounds(x, grad)):
        assert got.dtype == torch.float32 and torch.isfinite(got).all()
        over = (got.double() - want).abs() > bound
        assert not over.any(), (x[over], got[over], want[over], bound[over])
    assert torch.equal(ours[2], F.gelu(x))


def test_inductor_failure_falls_back_to_aten_once(monkeypatch, caplog):
    def broken(gm, inputs, **options):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(lowering, "compile_with_inductor", broken)
    lowering._warned.clear()
    model, reference = _mlp(), _mlp()
    step = deft_compile(model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy,
                        config=DeftConfig(compiler="inductor"))
    aten = deft_compile(reference, torch.optim.SGD(reference.parameters(), lr=0.1), F.cross_entropy,
                        config=DeftConfig(compiler="aten"))
    with caplog.at_level(logging.WARNING, logger="deft_compile"):
        for x, y in _batches(3):
            step(x, y)
            aten(x, y)
    assert step.compiler == "aten"
    assert step.lowering.history[0]["fallback_reason"] == "RuntimeError: no C++ compiler"
    assert caplog.text.count("Inductor could not compile a region of the step") == 1
    for a, b in zip(model.parameters(), reference.parameters()):  # the fallback runs the same aten ops
        assert torch.equal(a, b)


@pytest.fixture(scope="module", params=["mlp_dropout_sgd", "transformer_tied_adamw_groups", "cnn_batchnorm_adam"])
def ddp_report(request):
    results = run_local_workers(inductor_vs_ddp, 2, (request.param, 5), timeout_s=800, collective_timeout_s=240)
    return request.param, [r.value for r in results]


def test_inductor_wfbp_equals_ddp(ddp_report):
    """SGD (with Dropout: Inductor falls back to ATen's RNG), AdamW and Adam with BatchNorm: DDP's numbers within
    ``DRIFT_MULTIPLE`` times DDP around ``torch.compile(model)`` against DDP, measured in the same launch."""
    case, per_rank = ddp_report
    for rank, report in enumerate(per_rank):
        compilers = report["compilers"]  # the first call: aten where Inductor's cache missed (aten_first_call)
        assert compilers[0] in ("aten", "inductor") and compilers[1:] == ["inductor"] * (len(compilers) - 1), \
            report["history"]
        check_within_drift(report["steps"], worst(report["compiled"]), f"{case} rank {rank}")


def test_compiled_regions_run_between_the_collectives_where_the_plan_says(ddp_report):
    """The regional program runs the collectives in the FX graph's order (one launch per bucket), with backward
    regions between the first launch and the first wait (overlap kept) and the optimizer's regions after the
    last wait."""
    case, per_rank = ddp_report
    for report in per_rank:
        order = ["kernel" if e == "region" else e for e in report["program_order"]]
        collectives = [e for e in order if e != "kernel"]
        assert collectives == report["fx_order"]
        assert collectives.count("all_reduce") == report["buckets"] >= 2
        first_launch = order.index("all_reduce")
        first_wait = order.index("wait", first_launch)  # (a buffer broadcast's wait comes before forward)
        last_launch = len(order) - 1 - order[::-1].index("all_reduce")
        last_wait = len(order) - 1 - order[::-1].index("wait")
        assert "kernel" in order[:first_launch], "forward/backward compute before the first launch"
        assert "kernel" in order[first_launch:first_wait], "backward compute overlaps the first bucket"
        assert last_launch < first_wait, "wfbp: every bucket is launched before the first wait"
        assert "kernel" in order[last_wait:], "the optimizer update runs after the waits"


def test_updates_moved_into_the_next_forward_equal_ddp_on_the_regional_route():
    """ByteScheduler's plan applies step t's updates before each layer's forward of call t+1; in regions the update
    still runs before the layer that reads the parameter it wrote in place. DDP's numbers under a per-step LR
    schedule with flushes in the middle (SGD momentum, Dropout), within ``DRIFT_MULTIPLE`` times DDP around
    ``torch.compile(model)`` against DDP under the same schedule, measured in the same launch."""
    case, steps = "mlp_dropout_sgd", 7
    results = run_local_workers(with_yardstick, 2, (policy_with_lr_schedule_beside_ddp,
                                                    (case, steps, "bytescheduler", (2, 3), "inductor"), case, steps,
                                                    {"lr_schedule": True}), timeout_s=800, collective_timeout_s=240)
    for rank, result in enumerate(results):
        report = result.value
        assert any(entry["deferred"] for entry in report["steps"]), "the plan must defer updates"
        check_within_drift(report["steps"] + [report["final"]], worst(report["compiled"]), f"rank {rank}")


def test_whole_graph_lowering_keeps_each_kernel_between_the_same_collectives():
    """Opt-in whole-graph lowering (``inductor-graph``): DDP's numbers (within ``DRIFT_MULTIPLE`` times DDP around
    ``torch.compile(model)`` against DDP), and the generated wrapper calls the
    collectives in the FX graph's order with backward kernels between the first launch and the first wait and the
    optimizer's kernels after the last wait (no fusion moved compute across a collective)."""
    results = run_local_workers(inductor_vs_ddp, 2, ("mlp_dropout_sgd", 4, "inductor-graph"), timeout_s=800,
                                collective_timeout_s=240)
    for rank, report in enumerate(r.value for r in results):
        assert report["compilers"][-1] == "inductor", report["history"]
        check_within_drift(report["steps"], worst(report["compiled"]), f"rank {rank}")
        order = report["code_order"]
        collectives = [e for e in order if e != "kernel"]
        assert collectives == report["fx_order"] and collectives.count("all_reduce") == report["buckets"] >= 2
        first_launch = order.index("all_reduce")
        first_wait = order.index("wait", first_launch)
        last_wait = len(order) - 1 - order[::-1].index("wait")
        assert "kernel" in order[first_launch:first_wait] and "kernel" in order[last_wait:]


def test_backend_with_inductor_equals_ddp_and_deft_policy_runs():
    """backend="deft" with compiler="inductor": wfbp equals DDP with SGD and with AdamW, each within
    ``DRIFT_MULTIPLE`` times DDP around ``torch.compile(model)`` against DDP (the same launch); policy="deft" profiles
    the backward graph, delays the buckets the knapsack picks, replicas stay equal."""
    from inductor_workers import backend_inductor_vs_ddp

    results = run_local_workers(backend_inductor_vs_ddp, 2, (), timeout_s=800, collective_timeout_s=240)
    for r in results:
        report = r.value
        for optimizer in ("sgd", "adamw"):
            check_difference(report[optimizer]["max_rel"], report[optimizer]["compiled"], optimizer)
        assert report["sgd"]["buckets"] == [3]
        assert report["deft"]["replicas_equal"] and report["deft"]["finite"], report
        assert report["lowered"].get("aten", 0) == 0 and report["lowered"]["inductor"] >= 6, report
    assert results[0].value["deft"]["buckets"] == results[1].value["deft"]["buckets"]


def test_backend_options_policy_and_compiler():
    from deft_compile.backend.options import parse_options

    assert parse_options({"policy": "deft", "compiler": "aten"}).policy == "deft"
    with pytest.raises(ValueError, match="option 'policy' must be one of 'wfbp', 'deft'"):
        parse_options({"policy": "usbyte"})
    with pytest.raises(ValueError, match="cannot be combined with policy='deft'"):
        parse_options({"policy": "deft", "delay": True})
    with pytest.raises(ValueError, match="option 'compiler' must be one of"):
        parse_options({"compiler": "tvm"})


@pytest.mark.parametrize("delayed_update", ["averaged", "local", "compensated"])
def test_inductor_delayed_plan_matches_eager_delayed_reference(delayed_update):
    """A plan with delayed buckets (d = 1) compiles with Inductor: the carried local gradient the previous call
    handed over is all-reduced functionally (an in-place all_reduce_ on a graph input made every delayed plan fall
    back to aten). Parameters and optimizer state match the eager delayed reference every step and after flush,
    for each delayed semantics (``local`` also reads the carried tensor before its all-reduce), within
    ``DRIFT_MULTIPLE`` times the same reference with its model compiled by torch.compile, against the eager one."""
    results = run_local_workers(delayed_beside_compile, 2,
                                ("transformer_tied_adamw_groups", 5, delayed_update, "inductor"),
                                timeout_s=800, collective_timeout_s=240)
    for rank, result in enumerate(r.value for r in results):
        assert result["delayed"], "the plan delays some buckets"
        assert result["semantics"] == delayed_update
        steady = result["lowering_history"]
        assert steady and all(entry["compiler"] == "inductor" for entry in steady), result["lowering_history"]
        check_within_drift(result["steps"] + [result["final"]], worst(result["compiled"]), f"rank {rank}")
