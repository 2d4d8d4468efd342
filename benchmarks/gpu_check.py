#!/usr/bin/env python
"""Prove deft_compile on one CUDA device in one short run; with ``--device cpu``, the same paths as a quick smoke.

    python benchmarks/gpu_check.py --device cuda --out gpu_check_out      # one H100/H200, about 6-8 minutes
    python benchmarks/gpu_check.py --device cpu --out /tmp/gpu_check      # CPU smoke (tiny models), what CI runs

Each part runs in its own process (a CUDA error or a hang stays in its part, with its own timeout) and adds its
checks to ``gpu_check.json`` as it finishes; the table at the end lists every check with its value and bound.

Parts:
  profiler   (c) the profiler's per-layer times on the device (CUDA events around each node's kernels) against
             torch.profiler's kernel times for the same nodes, per layer, within 15 %.
  one_rank   (a) one rank (NCCL on CUDA, gloo on CPU), world size 1: ``wfbp`` and ``deft`` steps through Inductor on
             the transformers GPT-2 (124 M, bf16 autocast) and a ResNet-50-sized CNN (fp32, SGD): parameters against
             an eager loop, within twice torch.compile's own difference from that loop (or 1e-6 relative); step
             time against eager and against torch.compile of the model.
  two_ranks  (b) two processes sharing the device, gloo over its tensors: ``wfbp``, ``bytescheduler``, ``usbyte``
             equal to DistributedDataParallel step by step; ``deft`` with delays equal to its eager delayed reference.
  overlap    (d) rank 0 of two mirrored ranks behind an emulated link (a side stream sleeping a calibrated time per
             byte, ``emulated_link.py``): the measured step within 20 % of the simulator's prediction, and each
             collective's measured start within 20 % of a step of where the simulated timeline puts it.
  accuracy   (e) 200 steps of a char-level GPT (bf16 autocast) with ``deft`` defaults (Inductor, closed loop,
             Preserver) behind the emulated link, against the same eager loop: final validation loss within 2 %.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for path in (str(HERE), str(ROOT / "tests"), str(ROOT / "examples")):
    if path not in sys.path:
        sys.path.insert(0, path)

#: part -> (letter in the issue's list, timeout on a GPU in seconds, timeout in the CPU smoke)
PARTS: dict[str, tuple[str, int, int]] = {
    "profiler": ("c", 90, 120),
    "two_ranks": ("b", 120, 180),
    "overlap": ("d", 120, 120),
    "accuracy": ("e", 200, 180),
    "one_rank": ("a", 330, 240),
}


#: in the CPU smoke, the most the emulated link spends on the profiler's largest probe (tiny models' gradients are
#: small, so a link slow enough for them would take minutes over a 4 MiB probe)
QUICK_PROBE_MS = 20.0


# -- results ---------------------------------------------------------------------------------------------------


class Checks:
    """The checks of one part: name, measured value, bound, pass or fail, and free-form data beside them."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.data: dict[str, Any] = {}

    save: Callable[[], None] = staticmethod(lambda: None)  # writes what is known so far (a part may be cut short)

    def add(self, name: str, ok: bool, value: Any, bound: str, note: str = "") -> bool:
        self.rows.append({"check": name, "ok": bool(ok), "value": _plain(value), "bound": bound, "note": note})
        return bool(ok)


def _plain(value: Any) -> Any:
    if isinstance(value, float):
        return float(f"{value:.6g}") if math.isfinite(value) else str(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


# -- shared set-up ---------------------------------------------------------------------------------------------


def _torch():
    import torch

    return torch


def init_single(device) -> None:
    """The default process group with this process alone: NCCL on a GPU, gloo on the host."""
    torch = _torch()
    import torch.distributed as dist

    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1,
                            store=dist.HashStore(), **({"device_id": device} if device.type == "cuda" else {}))


def hf_gpt2(quick: bool, layers: int = 12, dim: int = 768, heads: int = 12, vocab: int = 50257, context: int = 1024):
    """The transformers GPT-2 from its config, random weights, dropout off (the parameter comparisons run several
    implementations side by side; Dropout's own exactness is covered by the CPU tests)."""
    import transformers

    if quick:
        layers, dim, heads, vocab, context = 2, 64, 4, 256, 64
    config = transformers.GPT2Config(n_layer=layers, n_embd=dim, n_head=heads, vocab_size=vocab, n_positions=context,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


def resnet50(quick: bool):
    """ResNet-50's bottleneck layout (3-4-6-3) at torchvision's width (25.6 M parameters with 1000 classes)."""
    from deft_compile.tools.bench_models import ResNet, _Bottleneck

    if quick:
        return ResNet(_Bottleneck, (1, 1, 1, 1), width=4, classes=10)
    return ResNet(_Bottleneck, (3, 4, 6, 3), width=64, classes=1000)


class Workload:
    """A model, its optimizer, its batches and how one step calls them."""

    def __init__(self, name: str, build: Callable[[], Any], optimizer: Callable[[Any], Any],
                 batches: list[tuple[tuple, dict]], loss_fn: Any, autocast: Any) -> None:
        self.name, self.build, self.optimizer, self.batches = name, build, optimizer, batches
        self.loss_fn, self.autocast_dtype = loss_fn, autocast

    def autocast(self, device):
        torch = _torch()
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=self.autocast_dtype)


def gpt2_workload(device, quick: bool, steps: int, batch: int = 8, context: int = 512) -> Workload:
    torch = _torch()
    if quick:
        batch, context = 2, 32
    vocab = 256 if quick else 50257
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(steps):
        ids = torch.randint(0, vocab, (batch, context), generator=g).to(device)
        batches.append(((), {"input_ids": ids, "labels": ids}))
    return Workload("gpt2-124M" if not quick else "gpt2-tiny", lambda: hf_gpt2(quick),
                    lambda m: torch.optim.AdamW(m.parameters(), lr=1e-4, weight_decay=0.01), batches, None,
                    torch.bfloat16 if device.type == "cuda" else None)


def resnet_workload(device, quick: bool, steps: int) -> Workload:
    torch = _torch()
    import torch.nn.functional as F

    batch, size, classes = (4, 16, 10) if quick else (32, 64, 1000)
    g = torch.Generator().manual_seed(2)
    batches = [((torch.randn(batch, 3, size, size, generator=g).to(device),
                 torch.randint(0, classes, (batch,), generator=g).to(device)), {}) for _ in range(steps)]
    return Workload("resnet50" if not quick else "resnet-tiny", lambda: resnet50(quick),
                    lambda m: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4),
                    batches, F.cross_entropy, None)


def _loss_of(workload: Workload, model, batch):
    args, kwargs = batch
    if workload.loss_fn is not None:
        inputs, targets = args
        return workload.loss_fn(model(inputs), targets)
    return model(**kwargs).loss


def _deft_call(workload: Workload, step, batch):
    args, kwargs = batch
    return step(*args) if workload.loss_fn is not None else step(**kwargs)


def param_difference(model, reference, start) -> dict[str, float]:
    """``max_rel``: the largest element difference over the reference's largest magnitude, worst parameter;
    ``update_rel``: the norm of the difference of the two updates (from ``start``) over the reference update's."""
    worst, diff_sq, ref_sq = 0.0, 0.0, 0.0
    for (name, p), q, p0 in zip(model.named_parameters(), reference.parameters(), start):
        a, b, a0 = p.detach().double(), q.detach().double(), p0.double()
        scale = b.abs().max().item() or 1.0
        worst = max(worst, (a - b).abs().max().item() / scale)
        diff_sq += ((a - a0) - (b - a0)).pow(2).sum().item()
        ref_sq += (b - a0).pow(2).sum().item()
    return {"max_rel": worst, "update_rel": math.sqrt(diff_sq) / max(math.sqrt(ref_sq), 1e-30)}


def timed_steps(clock, run_one: Callable[[int], Any], steps: int, timed: int) -> dict[str, Any]:
    """Run ``steps`` steps; the first ``steps - timed`` synchronised and wall-clocked one by one (their cost includes
    compiling), the rest back to back between device events (the steady step, read after one synchronise)."""
    first_s = []
    losses = []
    for t in range(steps - timed):
        clock.synchronize()
        started = time.perf_counter()
        losses.append(run_one(t))
        clock.synchronize()
        first_s.append(time.perf_counter() - started)
    spans = []
    block = clock.mark()
    for t in range(steps - timed, steps):
        mark = clock.mark()
        losses.append(run_one(t))
        spans.append(clock.since(mark))
    total = clock.since(block)
    clock.synchronize()
    from deft_compile.timing import resolve_ms

    per_step = resolve_ms(spans)
    return {"losses": [float(l) for l in losses], "warmup_s": first_s,
            "step_ms": resolve_ms([total])[0] / max(timed, 1), "step_ms_median": statistics.median(per_step)}


# -- (a) one rank ----------------------------------------------------------------------------------------------


def part_one_rank(device, quick: bool, checks: Checks, models: list[str], compiler: str, compile_backend: str) -> None:
    torch = _torch()
    from deft_compile import DeftConfig, deft_compile
    from deft_compile.timing import clock_for

    init_single(device)
    clock = clock_for(device)
    steps, timed = (4, 2) if quick else (8, 5)
    for name in models:
        workload = gpt2_workload(device, quick, steps) if name == "gpt2" else resnet_workload(device, quick, steps)
        torch.manual_seed(0)
        base = workload.build().to(device)
        start = [p.detach().clone() for p in base.parameters()]
        results: dict[str, Any] = {}

        def eager_variant(compiled: bool):
            model = copy.deepcopy(base)
            optimizer = workload.optimizer(model)
            forward = torch.compile(model, backend=compile_backend) if compiled else model

            def run_one(t):
                optimizer.zero_grad(set_to_none=True)
                with workload.autocast(device):
                    loss = _loss_of(workload, forward, workload.batches[t])
                loss.backward()
                optimizer.step()
                return loss.detach()

            out = timed_steps(clock, run_one, steps, timed)
            return model, out

        reference, results["eager"] = eager_variant(False)
        compiled_model, results["torch.compile"] = eager_variant(True)
        compile_diff = param_difference(compiled_model, reference, start)
        results["torch.compile"].update(compile_diff)
        for policy in ("wfbp", "deft"):
            model = copy.deepcopy(base)
            optimizer = workload.optimizer(model)
            step = deft_compile(model, optimizer, workload.loss_fn, policy=policy, config=DeftConfig(compiler=compiler))

            def run_one(t, step=step):
                with workload.autocast(device):
                    return _deft_call(workload, step, workload.batches[t])

            out = timed_steps(clock, run_one, steps, timed)
            out.update(param_difference(model, reference, start))
            out.update(compiler=step.compiler, compiles=step.lowering.history,
                       overheads={k: v for k, v in step.overheads.items() if isinstance(v, (int, float))})
            results[f"deft_compile {policy}"] = out
            bound = max(2 * compile_diff["update_rel"], 1e-4)
            checks.add(f"{workload.name} {policy}: parameter update vs eager (relative norm of the difference)",
                       out["update_rel"] <= bound, out["update_rel"],
                       f"<= {bound:.3g} (2x torch.compile's {compile_diff['update_rel']:.3g}, or 1e-4)",
                       f"largest element difference {out['max_rel']:.3g} of the parameter's largest magnitude "
                       f"(torch.compile {compile_diff['max_rel']:.3g})")
            checks.add(f"{workload.name} {policy}: ran {compiler}", out["compiler"] == compiler, out["compiler"],
                       compiler)
        eager_ms = results["eager"]["step_ms"]
        compiled_ms = results["torch.compile"]["step_ms"]
        for policy in ("wfbp", "deft"):
            ms = results[f"deft_compile {policy}"]["step_ms"]
            checks.add(f"{workload.name} {policy}: step ms (vs eager, vs torch.compile)", True,
                       {"deft_compile": ms, "eager": eager_ms, "torch.compile": compiled_ms,
                        "vs_eager": ms / eager_ms, "vs_torch_compile": ms / compiled_ms},
                       "reported", "steady steps between device events; compile excluded (warmup_s has it)")
        checks.data[workload.name] = results
        checks.save()


# -- (c) profiler ----------------------------------------------------------------------------------------------


def _layer_of(name: str) -> str:
    parts = name.split(".")
    for marker in ("h", "blocks", "layers"):
        if marker in parts:
            i = parts.index(marker)
            if i + 1 < len(parts) and parts[i + 1].isdigit():
                return ".".join(parts[: i + 2])
    return ".".join(parts[:-1]) or name


def part_profiler(device, quick: bool, checks: Checks) -> None:
    torch = _torch()
    import torch.fx as fx

    from deft_compile.planner.plan import LinkCost
    from deft_compile.step.profiler import attribute_times, measure_node_times
    from deft_compile.step.capture import capture_step, split_user_inputs
    from deft_compile.step.optim_support import lr_inputs
    from deft_compile.step.pipeline import annotate_capture
    from deft_compile.step.scheduling import ProfileIndex, static_profile
    from deft_compile.timing import NODE_SLEEP_S, RUN_LEAD_S, clock_for

    workload = gpt2_workload(device, quick, 1, batch=8, context=512)
    torch.manual_seed(0)
    model = workload.build().to(device)
    optimizer = workload.optimizer(model)
    args, kwargs = workload.batches[0]
    started = time.perf_counter()
    with workload.autocast(device):
        captured = capture_step(model, optimizer, None, args, kwargs, [])
    checks.data["capture_s"] = time.perf_counter() - started
    annotation = annotate_capture(captured)
    index = ProfileIndex.of(annotation)
    user_tensors, _, _ = split_user_inputs(args, kwargs)
    inputs = [*captured.model_state.params, *captured.model_state.buffers, *user_tensors, *lr_inputs(optimizer)]
    clock = clock_for(device)
    checks.add("profiler clock follows the device", clock.kind == ("cuda" if device.type == "cuda" else "host"),
               clock.kind, "cuda events on a GPU, the host clock on a CPU")
    started = time.perf_counter()
    ours = measure_node_times(captured, inputs, warmup=1, repeats=3)
    checks.data["profile_s"] = time.perf_counter() - started

    gm = captured.graph_module
    numbered = {node: i for i, node in enumerate(gm.graph.nodes)}

    class Annotated(fx.Interpreter):
        """Each node inside a ``record_function`` range, launched behind the same short device sleep as the
        profiler's own timing: the device stays busy (and at the same clocks) in both measurements."""

        def run_node(self, n):
            if n.op in ("placeholder", "output", "get_attr"):
                return super().run_node(n)
            if device.type == "cuda":
                clock.device_sleep(NODE_SLEEP_S)
            with torch.profiler.record_function(f"deft_node_{numbered[n]}"):
                return super().run_node(n)

    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    rng = torch.get_rng_state()
    with torch.no_grad():
        for run in range(2):  # one warm-up run, one profiled
            copies = [t.detach().clone() if isinstance(t, torch.Tensor) else t for t in inputs]
            if run == 0:
                Annotated(gm).run(*copies)
                continue
            with torch.profiler.profile(activities=activities) as prof:
                if device.type == "cuda":
                    clock.device_sleep(RUN_LEAD_S)
                Annotated(gm).run(*copies)
                clock.synchronize()
        # the whole graph run back to back (no per-node brackets), for scale: what the brackets leave out
        copies = [t.detach().clone() if isinstance(t, torch.Tensor) else t for t in inputs]
        if device.type == "cuda":
            clock.synchronize()
            clock.device_sleep(RUN_LEAD_S)
        mark = clock.mark()
        gm(*copies)
        whole_ms = clock.since(mark).ms
        replay_ms, replay_error = graph_replay_ms(gm, inputs, clock) if device.type == "cuda" else (None, "no GPU")
    torch.set_rng_state(rng)
    checks.data["whole_graph_ms"] = whole_ms
    checks.data["sum_of_nodes_ms"] = sum(ours.values())
    if device.type == "cuda":
        # an independent absolute reference: the same graph captured into a CUDA graph and replayed (no host, no
        # launch gaps, no instrumentation), against the sum of the per-node event times
        ok = replay_ms is not None and abs(sum(ours.values()) / replay_ms - 1.0) <= 0.15
        checks.add("sum of per-node times vs a CUDA-graph replay of the whole graph", ok,
                   {"sum_of_nodes_ms": sum(ours.values()), "replay_ms": replay_ms, "error": replay_error},
                   "ratio within 1 +- 0.15")
    by_number = {i: node for node, i in numbered.items()}
    theirs: dict[Any, float] = {}
    for event in prof.events():
        if event.name.startswith("deft_node_"):
            node = by_number[int(event.name[len("deft_node_"):])]
            if device.type == "cuda":
                total = getattr(event, "device_time_total", None)
                if total is None:
                    total = event.cuda_time_total
            else:
                total = event.cpu_time_total
            theirs[node] = theirs.get(node, 0.0) + total / 1e3
    links = [LinkCost("local", 0.0, 0.0)]
    per_layer = {}
    for label, node_ms in (("deft_compile", ours), ("torch.profiler", theirs)):
        profile = static_profile(captured, index, links, 1, attribute_times(annotation, index, node_ms))
        layers: dict[str, float] = {}
        for param in profile.params:
            layers[_layer_of(param.name)] = layers.get(_layer_of(param.name), 0.0) + (
                param.forward_ms + param.backward_ms + param.update_ms)
        per_layer[label] = layers
    total_theirs = sum(per_layer["torch.profiler"].values())
    rows = {}
    for layer, theirs_ms in per_layer["torch.profiler"].items():
        ours_ms = per_layer["deft_compile"].get(layer, 0.0)
        rows[layer] = {"deft_compile_ms": ours_ms, "torch_profiler_ms": theirs_ms,
                       "ratio": ours_ms / theirs_ms if theirs_ms > 0 else math.inf}
    checks.data["per_layer"] = rows
    total_ours = sum(per_layer["deft_compile"].values())
    if device.type != "cuda":
        # on a host the profiler's own bookkeeping is most of an annotated node's CPU time: only the bookkeeping of
        # this comparison is checked (the same layers on both sides, every time measured)
        same = set(per_layer["deft_compile"]) == set(per_layer["torch.profiler"])
        positive = all(v > 0 for layers in per_layer.values() for v in layers.values())
        checks.add("both sides time the same layers, all positive (CPU smoke)", same and positive,
                   {"layers": len(rows), "deft_compile_ms": total_ours, "torch_profiler_ms": total_theirs},
                   "same layer set, every time > 0")
        return
    weighty = {k: v for k, v in rows.items() if v["torch_profiler_ms"] >= 0.01 * total_theirs}
    worst = max(weighty.items(), key=lambda kv: abs(kv[1]["ratio"] - 1.0)) if weighty else ("-", {"ratio": math.nan})
    checks.add("per-layer time vs torch.profiler's kernel time (worst layer of >= 1 % of the step)",
               abs(worst[1]["ratio"] - 1.0) <= 0.15,
               {"layer": worst[0], "ratio": worst[1]["ratio"], "layers": len(weighty)}, "ratio within 1 +- 0.15")
    checks.add("step total vs torch.profiler's kernel time", abs(total_ours / total_theirs - 1.0) <= 0.15,
               {"deft_compile_ms": total_ours, "torch_profiler_ms": total_theirs, "ratio": total_ours / total_theirs},
               "ratio within 1 +- 0.15")


def graph_replay_ms(gm, inputs, clock) -> tuple[float | None, str | None]:
    """Milliseconds of one replay of ``gm`` captured into a CUDA graph (mean of 5), or (None, why not)."""
    torch = _torch()
    try:
        static = [t.detach().clone() if isinstance(t, torch.Tensor) else t for t in inputs]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                gm(*static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            gm(*static)
        graph.replay()
        clock.synchronize()
        mark = clock.mark()
        for _ in range(5):
            graph.replay()
        return clock.since(mark).ms / 5, None
    except Exception as error:  # noqa: BLE001 - a graph that cannot be captured has no replay time
        return None, f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"


# -- (b) two ranks ---------------------------------------------------------------------------------------------


def two_ranks_worker(rank: int, world_size: int, device_name: str, quick: bool) -> dict:
    """One of two processes on one device (gloo over the device's tensors): each timing-only policy beside DDP, and
    deft with delays beside its eager delayed reference."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    from deft_compile import DeftConfig, deft_compile
    from workers import (POLICY_OPTIONS, PlanReference, _compare, _named_state, _step_beside_ddp,
                         plan_schedule_by_name, synthetic_profile)

    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False

    def make_model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                             nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                             nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10)).to(device)

    def make_optimizer(model):
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3)

    loss_fn = F.cross_entropy
    steps = 4 if quick else 6
    data = torch.Generator().manual_seed(1234 + rank)
    batches = [(torch.randn(8, 3, 16, 16, generator=data).to(device), torch.randint(0, 10, (8,), generator=data).to(device))
               for _ in range(steps)]
    report: dict[str, Any] = {}
    for policy in ("wfbp", "bytescheduler", "usbyte"):
        options = POLICY_OPTIONS.get(policy, {})
        ddp_model, deft_model = make_model(), make_model()
        ddp = DistributedDataParallel(ddp_model, device_ids=[device.index] if device.type == "cuda" else None)
        ddp_optimizer, deft_optimizer = make_optimizer(ddp_model), make_optimizer(deft_model)
        scratch = make_model()
        profile = synthetic_profile(scratch, make_optimizer(scratch), loss_fn, batches[0], world_size)
        step = deft_compile(deft_model, deft_optimizer, loss_fn, policy=policy, profile=profile,
                            config=DeftConfig(plan_options=options, compiler="aten"))
        worst = 0.0
        for t, (inputs, targets) in enumerate(batches):
            entry, _ = _step_beside_ddp(step, rank, t, inputs, targets, loss_fn, ddp, ddp_model, ddp_optimizer,
                                        deft_model, deft_optimizer)
            worst = max(worst, entry["max_rel"])
        step.flush()
        final = _compare(_named_state(deft_model, deft_optimizer), _named_state(ddp_model, ddp_optimizer))
        report[policy] = {"max_rel_per_step": worst, "max_rel_final": final["max_rel"], "items": len(step.plan.items),
                          "device": str(next(deft_model.parameters()).device)}
    # deft with delays (a synthetic profile that makes the knapsack delay) against its eager delayed reference
    ref_model, deft_model = make_model(), make_model()
    ref_optimizer, deft_optimizer = make_optimizer(ref_model), make_optimizer(deft_model)
    scratch = make_model()
    profile = synthetic_profile(scratch, make_optimizer(scratch), loss_fn, batches[0], world_size)
    from deft_compile.preserver import PreserverConfig

    step = deft_compile(deft_model, deft_optimizer, loss_fn, policy="deft", profile=profile,
                        config=DeftConfig(plan_options=POLICY_OPTIONS["deft"], compiler="aten",
                                          preserver=PreserverConfig(enabled=False)))
    reference = None
    worst = 0.0
    for t, (inputs, targets) in enumerate(batches):
        step(inputs, targets)
        if reference is None:
            reference = PlanReference(ref_model, ref_optimizer, loss_fn, plan_schedule_by_name(step), world_size)
        reference.step(inputs, targets)
        worst = max(worst, _compare(_named_state(deft_model, deft_optimizer),
                                    _named_state(ref_model, ref_optimizer))["max_rel"])
    delayed = sum(1 for item in step.plan.items if item.delay)
    step.flush()
    reference.flush()
    final = _compare(_named_state(deft_model, deft_optimizer), _named_state(ref_model, ref_optimizer))
    report["deft"] = {"max_rel_per_step": worst, "max_rel_final": final["max_rel"], "delayed_items": delayed,
                      "items": len(step.plan.items)}
    report["params"] = [p.detach().cpu() for p in deft_model.parameters()]
    return report


def part_two_ranks(device, quick: bool, checks: Checks) -> None:
    from deft_compile.tools.launcher import run_local_workers

    env = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    results = run_local_workers(two_ranks_worker, 2, (str(device), quick), backend="gloo", timeout_s=150,
                                start_method="spawn", env=env)
    reports = [r.value for r in results]
    for policy in ("wfbp", "bytescheduler", "usbyte"):
        worst = max(max(r[policy]["max_rel_per_step"], r[policy]["max_rel_final"]) for r in reports)
        checks.add(f"{policy} vs DistributedDataParallel (max rel, every step and after flush)", worst == 0.0, worst,
                   "== 0 (bit-identical; SGD, cudnn deterministic)", f"device {reports[0][policy]['device']}")
    worst = max(max(r["deft"]["max_rel_per_step"], r["deft"]["max_rel_final"]) for r in reports)
    checks.add("deft (delays) vs its eager delayed reference (max rel)", worst == 0.0 and
               reports[0]["deft"]["delayed_items"] > 0, {"max_rel": worst, "delayed_items": reports[0]["deft"]["delayed_items"]},
               "== 0 with at least one delayed item")
    identical = all(a.equal(b) for a, b in zip(reports[0]["params"], reports[1]["params"]))
    checks.add("replicas identical after flush", identical, identical, "True")
    checks.data = {k: v for k, v in reports[0].items() if k != "params"}


# -- (d) overlap on the device ---------------------------------------------------------------------------------


def part_overlap(device, quick: bool, checks: Checks, out_dir: Path) -> None:
    torch = _torch()
    import emulated_link as el

    from deft_compile import DeftConfig, deft_compile
    from deft_compile.step.profiler import profile_model
    from deft_compile.planner.simulator import simulate
    from deft_compile.preserver import PreserverConfig
    from deft_compile.planner.closed_loop import ClosedLoopConfig
    from deft_compile.timing import clock_for, resolve_ms

    if device.type == "cuda":
        torch.cuda.set_device(device)
    link = el.EmulatedLink(device="cuda" if device.type == "cuda" else "cpu")
    el.init(link, 2)
    clock = clock_for(device)
    layers, dim, context, batch = (2, 64, 32, 4) if quick else (6, 768, 512, 16)
    torch.manual_seed(0)
    base = hf_gpt2(False, layers=layers, dim=dim, heads=max(1, dim // 64), vocab=8192 if not quick else 256,
                   context=context).to(device)
    g = torch.Generator().manual_seed(3)
    vocab = base.config.vocab_size
    batches = []
    for _ in range(6 if quick else 12):
        ids = torch.randint(0, vocab, (batch, context), generator=g).to(device)
        batches.append(((), {"input_ids": ids, "labels": ids}))

    def optimizer_of(model):
        return torch.optim.AdamW(model.parameters(), lr=1e-4)

    scratch = copy.deepcopy(base)
    compute = profile_model(scratch, optimizer_of(scratch), None, (), batches[0][1])
    backward_ms = compute.backward_ms
    total_bytes = sum(p.nbytes for p in compute.params)
    link.alpha_ms = 0.05
    link.beta_ms_per_byte = 0.8 * backward_ms / total_bytes
    if quick:  # a tiny model's gradient is far smaller than the profiler's largest link probe (4 MiB)
        link.beta_ms_per_byte = min(link.beta_ms_per_byte, QUICK_PROBE_MS / (4 << 20))
    checks.data["link"] = {"alpha_ms": link.alpha_ms, "beta_ms_per_byte": link.beta_ms_per_byte,
                           "backward_ms": backward_ms, "gradient_bytes": total_bytes}
    trace_events = []
    for policy in ("wfbp", "bytescheduler"):
        model = copy.deepcopy(base)
        config = DeftConfig(compiler="aten", always_profile=True, closed_loop=ClosedLoopConfig(enabled=False),
                            preserver=PreserverConfig(enabled=False))
        step = deft_compile(model, optimizer_of(model), None, policy=policy, config=config)
        spans, logs = [], []
        for t, (_, kwargs) in enumerate(batches):
            before = len(link.log)
            mark = clock.mark()
            step(**kwargs)
            spans.append((mark, clock.since(mark)))
            logs.append(link.log[before:])
        clock.synchronize()
        steady = list(range(len(batches) // 3, len(batches)))
        step_ms = [resolve_ms([spans[t][1]])[0] for t in steady]
        measured = statistics.median(step_ms)
        predicted = float(step.plan.predicted_iteration_ms or 0.0)
        ratio = measured / predicted if predicted else math.inf
        gradient_messages = [sum(1 for _, _, n in logs[t] if n > 64) for t in steady]
        checks.add(f"{policy}: one link message per planned collective, every step",
                   all(m == len(step.plan.items) for m in gradient_messages),
                   {"messages": gradient_messages, "planned": len(step.plan.items)}, "messages == planned items")
        if device.type == "cuda":
            checks.add(f"{policy}: measured step vs simulated", abs(ratio - 1.0) <= 0.2,
                       {"measured_ms": measured, "predicted_ms": predicted, "ratio": ratio}, "ratio within 1 +- 0.2",
                       "aten route (the profile's own kernels), emulated link on a side stream")
        # where the collectives ran: measured (events, relative to the step's start) against the simulated timeline
        t = steady[-1]
        start_mark = spans[t][0]
        if device.type == "cuda":
            measured_spans = [(start_mark.elapsed_time(s), start_mark.elapsed_time(e), n) for s, e, n in logs[t]]
        else:
            measured_spans = []
        timeline = simulate(step.profile, step.plan)
        program = len(timeline._records) - 1
        forward_start = timeline.forward_starts[program] if program < len(timeline.forward_starts) else 0.0
        simulated = sorted((ev.start_ms - forward_start, ev.end_ms - forward_start)
                           for ev in timeline.comm_events() if ev.program == program)
        gradients = [span for span in measured_spans if span[2] > 64]  # the step's buckets, not control messages
        offsets = [abs(m[0] - s[0]) / measured for m, s in zip(sorted(gradients), simulated)]
        if device.type == "cuda":
            ok = len(gradients) == len(simulated) and max(offsets, default=0.0) <= 0.2
            checks.add(f"{policy}: collectives start where the simulated timeline puts them", ok,
                       {"collectives": len(gradients), "simulated": len(simulated),
                        "worst_offset_of_step": max(offsets, default=0.0)},
                       "same count; each start within 0.2 of a step")
            busy = sum(e - s for s, e, _ in gradients)
            checks.data[policy] = {"measured_ms": measured, "predicted_ms": predicted,
                                   "measured_collectives_ms": [(round(s, 3), round(e, 3)) for s, e, _ in sorted(gradients)],
                                   "simulated_collectives_ms": [(round(s, 3), round(e, 3)) for s, e in simulated],
                                   "comm_busy_ms": busy, "exposed_predicted_ms": timeline.exposed_comm_ms}
            trace_events.append({"name": "step", "ph": "X", "pid": policy, "tid": "compute",
                                 "ts": 0, "dur": measured * 1e3})
            for s, e, n in sorted(gradients):
                trace_events.append({"name": f"all_reduce {n} B", "ph": "X", "pid": policy, "tid": "link",
                                     "ts": s * 1e3, "dur": (e - s) * 1e3})
        else:
            checks.data[policy] = {"measured_ms": measured, "predicted_ms": predicted}
    if trace_events:
        from deft_compile.tools.provenance import provenance

        trace = {"provenance": provenance(), "traceEvents": trace_events}
        (out_dir / "overlap_trace.json").write_text(json.dumps(trace))


# -- (e) accuracy ----------------------------------------------------------------------------------------------


def part_accuracy(device, quick: bool, checks: Checks, out_dir: Path, compiler: str) -> None:
    torch = _torch()
    import emulated_link as el

    from deft_compile import DeftConfig, deft_compile
    from deft_compile.step.profiler import profile_model
    from corpus import load_stdlib_corpus, random_windows  # examples/corpus.py
    from deft_compile.tools.presets import GPT2Style

    if device.type == "cuda":
        torch.cuda.set_device(device)
    link = el.EmulatedLink(device="cuda" if device.type == "cuda" else "cpu")
    el.init(link, 2)
    steps = 20 if quick else 200
    dim, layers, context, batch = (32, 1, 32, 8) if quick else (256, 4, 128, 32)
    corpus = load_stdlib_corpus(2_000_000 if not quick else 200_000)
    split = int(corpus.numel() * 0.9)
    train, held_out = corpus[:split], corpus[split:]
    g = torch.Generator().manual_seed(4)
    batches = [random_windows(train, batch, context, g, device) for _ in range(steps)]
    validation = [random_windows(held_out, batch, context, torch.Generator().manual_seed(5 + i), device)
                  for i in range(4)]
    dtype = torch.bfloat16 if device.type == "cuda" else None

    def autocast():
        return torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()

    def build():
        torch.manual_seed(0)
        return GPT2Style(vocab=256, dim=dim, heads=4, layers=layers, context=context).to(device)

    def optimizer_of(model):
        return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)

    def validate(model) -> float:
        with torch.no_grad(), autocast():
            return statistics.fmean(float(model(x, y)) for x, y in validation)

    scratch = build()
    compute = profile_model(scratch, optimizer_of(scratch), None, batches[0], {})
    link.alpha_ms = 0.05
    link.beta_ms_per_byte = 2.0 * (compute.forward_ms + compute.backward_ms) / sum(p.nbytes for p in compute.params)
    if quick:
        link.beta_ms_per_byte = min(link.beta_ms_per_byte, QUICK_PROBE_MS / (4 << 20))
    eager = build()
    optimizer = optimizer_of(eager)
    eager_losses = []
    started = time.perf_counter()
    for inputs, targets in batches:
        optimizer.zero_grad(set_to_none=True)
        with autocast():
            loss = eager(inputs, targets)
        loss.backward()
        optimizer.step()
        eager_losses.append(float(loss))
    eager_s = time.perf_counter() - started
    lockstep = lockstep_divergence(build, optimizer_of, batches[: 5 if quick else 20], autocast, compiler)
    checks.data["lockstep"] = lockstep
    model = build()
    step = deft_compile(model, optimizer_of(model), None, policy="deft", config=DeftConfig(compiler=compiler))
    deft_losses = []
    started = time.perf_counter()
    for inputs, targets in batches:
        with autocast():
            deft_losses.append(float(step(inputs, targets)))
    step.flush()
    deft_s = time.perf_counter() - started
    eager_val, deft_val = validate(eager), validate(model)
    delayed_steps = sum(1 for h in step.plan_history if any(i.get("delay") for i in h.get("items", []))
                        ) if step.plan_history else 0
    ratio = deft_val / eager_val
    synchronous = not any(item.delay or item.period > 1 for item in step.plan.items)
    # a run of synchronous plans has the eager loop's semantics: it must end where eager ends, not lower either
    ok = abs(ratio - 1.0) <= 0.02 if synchronous else ratio <= 1.02
    checks.add("deft defaults vs eager: final validation loss", ok,
               {"deft": deft_val, "eager": eager_val, "ratio": ratio, "synchronous": synchronous},
               "ratio within 1 +- 0.02 (synchronous plans), <= 1.02 with delays",
               f"{steps} steps, bf16 autocast, emulated link at comm = 2x compute; wall s deft {deft_s:.1f} "
               f"(compiles and closed loop included) vs eager {eager_s:.1f}")
    checks.data.update(eager_losses=eager_losses, deft_losses=deft_losses, plans=[h.get("reason") for h in step.plan_history],
                       final_plan_delayed=sum(1 for item in step.plan.items if item.delay), compiles=step.lowering.history,
                       delayed_plans=delayed_steps)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(eager_losses, label=f"eager (val {eager_val:.3f})", linewidth=1)
        ax.plot(deft_losses, label=f"deft defaults (val {deft_val:.3f})", linewidth=1)
        ax.set_xlabel("step")
        ax.set_ylabel("training loss")
        ax.set_title(f"char-level GPT, {device.type}, {steps} steps")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir / "accuracy.png", dpi=110)
    except ImportError:
        pass


def lockstep_divergence(build, optimizer_of, batches, autocast, compiler: str) -> dict[str, Any]:
    """A synchronous ``wfbp`` step and the eager loop side by side on the same batches: per step, the relative norm
    of the parameters' difference, and the attention kernels the step's graph calls (where a divergence starts)."""
    torch = _torch()
    from deft_compile import DeftConfig, deft_compile

    eager, model = build(), build()
    eager_optimizer = optimizer_of(eager)
    step = deft_compile(model, optimizer_of(model), None, policy="wfbp", config=DeftConfig(compiler=compiler))
    per_step = []
    for inputs, targets in batches:
        eager_optimizer.zero_grad(set_to_none=True)
        with autocast():
            eager(inputs, targets).backward()
        eager_optimizer.step()
        with autocast():
            step(inputs, targets)
        with torch.no_grad():
            diff = math.sqrt(sum(float((a.double() - b.double()).pow(2).sum())
                                 for a, b in zip(model.parameters(), eager.parameters())))
            norm = math.sqrt(sum(float(b.double().pow(2).sum()) for b in eager.parameters()))
        per_step.append(diff / norm)
    attention = sorted({str(node.target) for node in step.graph.graph_module.graph.nodes
                        if node.op == "call_function" and "attention" in str(node.target)})
    first = next((t for t, d in enumerate(per_step) if d > 1e-3), None)
    return {"relative_param_difference": per_step, "first_step_over_1e-3": first, "graph_attention_ops": attention}


# -- driver ----------------------------------------------------------------------------------------------------


def run_part(name: str, args: argparse.Namespace) -> dict[str, Any]:
    torch = _torch()
    device = torch.device(args.device if args.device != "cuda" else "cuda:0")
    checks = Checks()
    out_dir = Path(args.out)
    started = time.perf_counter()
    error = None

    def save() -> None:
        partial = {"part": name, "letter": PARTS[name][0], "seconds": time.perf_counter() - started,
                   "checks": checks.rows, "data": _plain(checks.data), "error": "cut short (partial results)"}
        (out_dir / f"part_{name}.json").write_text(json.dumps(partial, indent=1))

    checks.save = save
    compiler = args.compiler or ("inductor" if device.type == "cuda" else "aten")
    backend = args.compile_backend or ("inductor" if device.type == "cuda" else "aot_eager")
    try:
        if name == "one_rank":
            part_one_rank(device, args.quick, checks, args.models.split(","), compiler, backend)
        elif name == "profiler":
            part_profiler(device, args.quick, checks)
        elif name == "two_ranks":
            part_two_ranks(device, args.quick, checks)
        elif name == "overlap":
            part_overlap(device, args.quick, checks, out_dir)
        elif name == "accuracy":
            part_accuracy(device, args.quick, checks, out_dir, args.accuracy_compiler or compiler)
        else:
            raise ValueError(f"unknown part {name!r}")
    except Exception:  # noqa: BLE001 - the failure is this part's result
        error = traceback.format_exc()
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    return {"part": name, "letter": PARTS[name][0], "seconds": time.perf_counter() - started, "checks": checks.rows,
            "data": _plain(checks.data), "error": error}


def environment() -> dict[str, Any]:
    import platform

    torch = _torch()
    info = {"python": platform.python_version(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M"),
            "cuda": torch.cuda.is_available()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["cuda_version"] = torch.version.cuda
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    try:
        info["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                        text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def print_table(report: dict[str, Any]) -> None:
    print(f"\n== gpu_check on {report['environment'].get('gpu', report['device'])} "
          f"(torch {report['environment']['torch']}) ==")
    for part in report["parts"]:
        status = "ERROR" if part["error"] else ("ok" if all(c["ok"] for c in part["checks"]) else "FAIL")
        print(f"\n({part['letter']}) {part['part']}: {status}  [{part['seconds']:.0f} s]")
        for row in part["checks"]:
            mark = "ok  " if row["ok"] else "FAIL"
            print(f"  {mark} {row['check']}: {json.dumps(row['value'])}  [{row['bound']}]"
                  + (f"  ({row['note']})" if row["note"] else ""))
        if part["error"]:
            print("  " + part["error"].strip().replace("\n", "\n  ")[-3000:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--out", default="gpu_check_out", help="folder for gpu_check.json and the plots")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--models", default="gpt2,resnet50", help="one_rank's models: gpt2, resnet50")
    parser.add_argument("--quick", action="store_true", help="tiny models and few steps (default with --device cpu)")
    parser.add_argument("--budget-s", type=float, default=480.0, help="stop starting parts after this many seconds")
    parser.add_argument("--compiler", default=None, help="deft_compile's compiler (default: inductor on cuda, aten on cpu)")
    parser.add_argument("--compile-backend", default=None, help="torch.compile's backend for the baseline")
    parser.add_argument("--accuracy-compiler", default=None, help="deft_compile's compiler in the accuracy part")
    parser.add_argument("--part", default=None, help=argparse.SUPPRESS)  # run one part in this process
    parser.add_argument("--part-timeout", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.device == "cpu":
        args.quick = True
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.part:
        if args.part_timeout:  # a hung part prints every thread's stack before it is killed
            import faulthandler

            faulthandler.dump_traceback_later(max(1.0, args.part_timeout - 5), exit=False)
        result = run_part(args.part, args)
        (out_dir / f"part_{args.part}.json").write_text(json.dumps(result, indent=1))
        sys.stdout.flush()
        sys.stderr.flush()
        # the result is written: leave without the interpreter's teardown, where a collective thread still
        # winding down (the emulated link's timers, a backend's) can abort the process and hide the result
        os._exit(0)
    from deft_compile.tools.provenance import provenance

    report = {"provenance": provenance(), "device": args.device, "environment": environment(), "parts": []}
    deadline = time.monotonic() + args.budget_s
    for name in [p for p in args.parts.split(",") if p]:
        if name not in PARTS:
            parser.error(f"unknown part {name!r}")
        timeout = PARTS[name][1] if args.device == "cuda" else PARTS[name][2]
        left = deadline - time.monotonic()
        if left < 20:
            report["parts"].append({"part": name, "letter": PARTS[name][0], "seconds": 0.0, "checks": [], "data": {},
                                    "error": f"not run: the {args.budget_s:.0f} s budget was spent"})
            continue
        command = [sys.executable, str(Path(__file__).resolve()), "--part", name, "--device", args.device,
                   "--out", str(out_dir), "--models", args.models, "--part-timeout", f"{min(timeout, left):.0f}"]
        command += ["--quick"] if args.quick else []
        command += ["--compiler", args.compiler] if args.compiler else []
        command += ["--compile-backend", args.compile_backend] if args.compile_backend else []
        command += ["--accuracy-compiler", args.accuracy_compiler] if args.accuracy_compiler else []
        started = time.perf_counter()
        print(f"[gpu_check] part {name} (timeout {min(timeout, left):.0f} s)", flush=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        try:
            completed = subprocess.run(command, timeout=min(timeout, left), env=env, capture_output=True, text=True)
            result_path = out_dir / f"part_{name}.json"
            if result_path.exists():
                result = json.loads(result_path.read_text())
                result_path.unlink()
            else:
                result = {"part": name, "letter": PARTS[name][0], "checks": [], "data": {},
                          "error": f"exit code {completed.returncode}:\n{completed.stderr[-4000:]}"}
            if completed.returncode != 0 and not result.get("error"):
                result["error"] = f"exit code {completed.returncode}:\n{completed.stderr[-4000:]}"
        except subprocess.TimeoutExpired as expired:
            stderr = expired.stderr.decode() if isinstance(expired.stderr, bytes) else (expired.stderr or "")
            result_path = out_dir / f"part_{name}.json"
            result = (json.loads(result_path.read_text()) if result_path.exists() else
                      {"part": name, "letter": PARTS[name][0], "checks": [], "data": {}})
            result_path.unlink(missing_ok=True)
            result["error"] = f"timed out after {min(timeout, left):.0f} s:\n{stderr[-8000:]}"
        result["seconds"] = time.perf_counter() - started
        report["parts"].append(result)
        (out_dir / "gpu_check.json").write_text(json.dumps(report, indent=1))
    (out_dir / "gpu_check.json").write_text(json.dumps(report, indent=1))
    print_table(report)
    failed = [p["part"] for p in report["parts"] if p["error"] or not all(c["ok"] for c in p["checks"])]
    print(f"\n[gpu_check] {len(report['parts']) - len(failed)} of {len(report['parts'])} parts passed"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
