#!/usr/bin/env python
"""Check deft_compile on one CUDA device in one short run; with ``--device cpu``, the same paths as a quick smoke.

    timeout 510 python benchmarks/gpu_check.py --device cuda --quick --out gpu_check_out   # one H100/H200, <= 8 min
    python benchmarks/gpu_check.py --device cpu --out /tmp/gpu_check                      # CPU smoke (tiny models), CI

Each part runs in its own process (a CUDA error or a hang stays in its part) with its own time budget, and the
parts run in the order of what is least known. ``gpu_check.json`` is rewritten after every part (so a run cut
short keeps the parts it finished), with the run's provenance (command, commit, whether the tree was clean, date,
machine, torch); a part cut short by its budget keeps the checks it finished. ``--budget-s`` (480 s) bounds the
whole run: a part starts only with 20 s left and gets at most what is left. The table at the end lists every check
with its value and bound.

Parts (letters as in docs/GPU.md):
  accuracy   (e) a char-level GPT under bf16 autocast, trained by a synchronous ``deft`` step through the closed
             loop's trial plans (ByteScheduler's and US-Byte's, whose updates run in the next call) and the
             Preserver's staleness probes, behind an emulated link (two mirrored ranks), against the eager loop on
             the same batches: each of the first 50 training losses within bf16's machine epsilon (2^-7, relative)
             of eager's, and the final validation loss within 1 % of eager's, both sides. Beside it: the round-off
             floor (eager from weights one ulp away, both directions) and the same step with the plan switched by
             hand (no closed loop) between DDP's buckets and the two priority plans.
  step_time  (a) one rank, world size 1 (NCCL on CUDA, gloo on CPU): ``wfbp`` and ``deft`` on the default
             compiler (regional Inductor) against eager and ``torch.compile(model)`` on the transformers GPT-2
             (124 M, bf16 autocast, AdamW; without ``--quick`` also a ResNet-50-sized CNN, fp32, SGD): parameters
             after the warm-up steps against eager's, within twice torch.compile's own difference; step time in
             interleaved rounds (the order rotating), with what the regional lowering runs per step (segments,
             compiled regions) and, on CUDA, the device kernels per step of every variant.
  profiler   (c) the profiler's per-layer times (CUDA events around each node's kernels, queued behind device
             sleeps) against torch.profiler's kernel times of the same nodes (each node's kernels summed from the
             profiler's own records, the host far ahead of the device) within 15 %, and the sum of the nodes
             against a CUDA-graph replay of the whole graph; the plans ``deft``, ``bytescheduler`` and ``usbyte``
             solve from either profile at a coverage rate of 2, compared (does the error change a plan?).
  two_ranks  (b) two processes sharing the device, gloo over its tensors: ``wfbp``, ``bytescheduler``, ``usbyte``
             equal to DistributedDataParallel step by step; ``deft`` with delays (the averaged delayed update) equal
             to its eager delayed reference.
  overlap    (d) rank 0 of two mirrored ranks behind an emulated link (a side stream sleeping a calibrated time per
             byte, ``emulated_link.py``): the measured step within 20 % of the simulator's prediction, and each
             collective's measured start within 20 % of a step of where the simulated timeline puts it.
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

#: part -> (letter, seconds with --quick on CUDA, seconds without --quick on CUDA, seconds in the CPU smoke), in the
#: order the parts run: what is least known first. The --quick budgets sum to 465 s, under the 480 s of the run.
PARTS: dict[str, tuple[str, int, int, int]] = {
    "accuracy": ("e", 150, 300, 150),
    "step_time": ("a", 150, 330, 130),
    "profiler": ("c", 55, 90, 50),
    "two_ranks": ("b", 55, 120, 70),
    "overlap": ("d", 55, 120, 80),
}
#: the whole run's budget (seconds): parts start only while 20 s are left, each gets at most what is left
RUN_BUDGET_S = 480.0

#: in the CPU smoke, the most the emulated link spends on the profiler's largest probe (tiny models' gradients are
#: small, so a link slow enough for them would take minutes over a 4 MiB probe)
QUICK_PROBE_MS = 20.0

#: (e): a training loss of the synchronous step may differ from eager's by this much, relative. bf16 keeps 8
#: significant bits: its machine epsilon is 2^-7, twice the unit round-off 2^-8 of one rounding. Two equivalent
#: eager runs (weights one ulp apart) reach 2^-8 within 50 steps on the CPU model (their round-off differences
#: grow from step to step): the bound sits a factor 2 above that floor, and the run measures its own floor.
LOSS_BOUND = 2.0 ** -7
#: (e): the steps whose training losses are compared one by one
TRACKED_STEPS = 50
#: (e): the final validation loss of the synchronous step within this share of eager's, both sides
VALIDATION_BOUND = 0.01
#: (c): per-layer agreement with the reference
PROFILE_BOUND = 0.15


# -- results ---------------------------------------------------------------------------------------------------


class Checks:
    """The checks of one part: name, measured value, bound, pass or fail, and free-form data beside them. Every
    check added is written at once (``save``): a part its budget cuts short keeps what it finished."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.data: dict[str, Any] = {}

    save: Callable[[], None] = staticmethod(lambda: None)

    def add(self, name: str, ok: bool, value: Any, bound: str, note: str = "") -> bool:
        self.rows.append({"check": name, "ok": bool(ok), "value": _plain(value), "bound": bound, "note": note})
        self.save()
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


def hf_gpt2(tiny: bool, layers: int = 12, dim: int = 768, heads: int = 12, vocab: int = 50257, context: int = 1024):
    """The transformers GPT-2 from its config, random weights, dropout off (the parameter comparisons run several
    implementations side by side; Dropout's own exactness is covered by the CPU tests)."""
    import transformers

    if tiny:
        layers, dim, heads, vocab, context = 2, 64, 4, 256, 64
    config = transformers.GPT2Config(n_layer=layers, n_embd=dim, n_head=heads, vocab_size=vocab, n_positions=context,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


def resnet50(tiny: bool):
    """ResNet-50's bottleneck layout (3-4-6-3) at torchvision's width (25.6 M parameters with 1000 classes)."""
    from deft_compile.tools.bench_models import ResNet, _Bottleneck

    if tiny:
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


def gpt2_workload(device, tiny: bool, steps: int, batch: int = 8, context: int = 512) -> Workload:
    torch = _torch()
    if tiny:
        batch, context = 2, 32
    vocab = 256 if tiny else 50257
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(steps):
        ids = torch.randint(0, vocab, (batch, context), generator=g).to(device)
        batches.append(((), {"input_ids": ids, "labels": ids}))
    return Workload("gpt2-124M" if not tiny else "gpt2-tiny", lambda: hf_gpt2(tiny),
                    lambda m: torch.optim.AdamW(m.parameters(), lr=1e-4, weight_decay=0.01), batches, None,
                    torch.bfloat16 if device.type == "cuda" else None)


def resnet_workload(device, tiny: bool, steps: int) -> Workload:
    torch = _torch()
    import torch.nn.functional as F

    batch, size, classes = (4, 16, 10) if tiny else (32, 64, 1000)
    g = torch.Generator().manual_seed(2)
    batches = [((torch.randn(batch, 3, size, size, generator=g).to(device),
                 torch.randint(0, classes, (batch,), generator=g).to(device)), {}) for _ in range(steps)]
    return Workload("resnet50" if not tiny else "resnet-tiny", lambda: resnet50(tiny),
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


def plan_runs(per_step: list[str]) -> list[list[Any]]:
    """``[first step, what ran]`` for each run of equal entries of ``per_step`` (the plan each step ran)."""
    runs: list[list[Any]] = []
    for t, label in enumerate(per_step):
        if not runs or runs[-1][1] != label:
            runs.append([t, label])
    return runs


def synchronous_plan(plan) -> bool:
    return not any(item.delay or item.period > 1 for item in plan.items)


# -- (e) accuracy ----------------------------------------------------------------------------------------------


def accuracy_setup(device, tiny: bool, steps: int):
    """The char-level GPT of (e): its builder, optimizer, training batches and validation batches."""
    torch = _torch()
    from corpus import load_stdlib_corpus, random_windows  # examples/corpus.py
    from deft_compile.tools.presets import GPT2Style

    dim, layers, context, batch = (32, 2, 32, 8) if tiny else (256, 4, 128, 32)
    corpus = load_stdlib_corpus(200_000 if tiny else 2_000_000)
    split = int(corpus.numel() * 0.9)
    train, held_out = corpus[:split], corpus[split:]
    g = torch.Generator().manual_seed(4)
    batches = [random_windows(train, batch, context, g, device) for _ in range(steps)]
    validation = [random_windows(held_out, batch, context, torch.Generator().manual_seed(5 + i), device)
                  for i in range(4)]

    def build(nudge: float = 0.0):
        """The model from seed 0; ``nudge`` +inf or -inf moves every weight one ulp that way."""
        torch.manual_seed(0)
        model = GPT2Style(vocab=256, dim=dim, heads=4, layers=layers, context=context).to(device)
        if nudge:
            with torch.no_grad():
                for p in model.parameters():
                    p.copy_(torch.nextafter(p, torch.full_like(p, nudge)))
        return model

    def optimizer_of(model):
        return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)

    return build, optimizer_of, batches, validation, {"dim": dim, "layers": layers, "context": context,
                                                      "batch": batch}


def eager_losses(model, optimizer, batches, autocast, keep_at: int | None = None):
    """The eager loop: per-step training losses (and, with ``keep_at``, the parameters after that many steps)."""
    losses, kept = [], None
    for t, (inputs, targets) in enumerate(batches):
        optimizer.zero_grad(set_to_none=True)
        with autocast():
            loss = model(inputs, targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if keep_at is not None and t + 1 == keep_at:
            kept = [p.detach().clone() for p in model.parameters()]
    return losses, kept


def relative_gaps(losses: list[float], reference: list[float]) -> list[float]:
    return [abs(a - b) / abs(b) for a, b in zip(losses, reference)]


def loss_check(checks: Checks, name: str, gaps: list[float], floor: float, per_step_plan: list[str]) -> None:
    """Each training loss of the first steps within ``LOSS_BOUND`` of eager's (relative); a loss that is not finite
    is over it."""
    over = [t for t, g in enumerate(gaps) if not g <= LOSS_BOUND]
    first = over[0] if over else None
    worst = first if first is not None and not math.isfinite(gaps[first]) else max(range(len(gaps)),
                                                                                    key=gaps.__getitem__)
    checks.add(f"{name}: training loss vs eager, each of the first {len(gaps)} steps", first is None,
               {"worst_relative_gap": gaps[worst], "at_step": worst, "plan_then": per_step_plan[worst],
                "first_step_over_bound": first, "plan_at_first": None if first is None else per_step_plan[first],
                "floor": floor},
               f"<= {LOSS_BOUND:.4g} relative (bf16 machine epsilon 2^-7)",
               "floor: the largest gap of eager from weights one ulp away over the same steps")


def part_accuracy(device, tiny: bool, checks: Checks, out_dir: Path, compiler: str, steps: int | None) -> None:
    torch = _torch()
    import emulated_link as el

    from deft_compile import DeftConfig, deft_compile
    from deft_compile.planner.closed_loop import ClosedLoopConfig
    from deft_compile.preserver import PreserverConfig
    from deft_compile.step.profiler import profile_model

    if device.type == "cuda":
        torch.cuda.set_device(device)
    link = el.EmulatedLink(device="cuda" if device.type == "cuda" else "cpu")
    el.init(link, 2)
    steps = steps or (20 if tiny else 200)
    tracked = min(TRACKED_STEPS, steps)
    build, optimizer_of, batches, validation, shape = accuracy_setup(device, tiny, steps)

    def autocast():
        return torch.autocast(device.type, dtype=torch.bfloat16)

    def validate(model) -> float:
        with torch.no_grad(), autocast():
            return statistics.fmean(float(model(x, y)) for x, y in validation)

    scratch = build()
    with autocast():
        compute = profile_model(scratch, optimizer_of(scratch), None, batches[0], {})
    link.alpha_ms = 0.05
    link.beta_ms_per_byte = 2.0 * (compute.forward_ms + compute.backward_ms) / sum(p.nbytes for p in compute.params)
    if device.type != "cuda":
        link.beta_ms_per_byte = min(link.beta_ms_per_byte, QUICK_PROBE_MS / (4 << 20))
    forced_steps = min(steps, 12)
    switches = {3: "bytescheduler", 6: "usbyte", 9: "wfbp"}
    checks.data.update(steps=steps, tracked_steps=tracked, compiler=compiler, model=shape,
                       link={"alpha_ms": link.alpha_ms, "beta_ms_per_byte": link.beta_ms_per_byte})

    started = time.perf_counter()
    eager = build()
    reference, at_forced = eager_losses(eager, optimizer_of(eager), batches, autocast, keep_at=forced_steps)
    eager_val = validate(eager)
    checks.data.update(eager_losses=reference, eager_validation=eager_val, eager_s=time.perf_counter() - started)
    checks.save()

    floors = {}
    for label, nudge in (("ulp_up", math.inf), ("ulp_down", -math.inf)):
        model = build(nudge)
        losses, _ = eager_losses(model, optimizer_of(model), batches[:tracked], autocast)
        gaps = relative_gaps(losses, reference[:tracked])
        floors[label] = max(gaps) if all(math.isfinite(g) for g in gaps) else math.nan
    floor = max(floors.values()) if all(math.isfinite(f) for f in floors.values()) else math.nan
    checks.data["floor"] = floors
    checks.add(f"round-off floor: eager from weights one ulp away, first {tracked} steps", floor <= LOSS_BOUND,
               floors, f"<= {LOSS_BOUND:.4g} (else the bound cannot tell a defect from round-off)")

    # the synchronous step through the closed loop's trials and the Preserver's probes: deft's defaults, with a
    # staleness price that keeps every delay out, no update periods, and no trade margin (the Preserver skips a
    # measurement whose price cannot change its decision, ``Trader.staleness_can_pay``); on a CPU host the trials start at fixed
    # steps (windows of 5 steps whatever their length), on a GPU the windows are the defaults' (>= 200 ms). On a CPU
    # host the link is capped for quick probes (about 1 ms of this model's bytes per step), so the gate that skips
    # priority trials when communication is under ``min_gain`` of the step (``closed_loop.can_gain``) would close
    # whenever a loaded host profiles the step 5x slower: it is opened there (min_gain 0), since this part checks
    # the trial plans' numbers, not the gate (tests/test_closed_loop_rules.py checks the gate)
    loop = ClosedLoopConfig() if device.type == "cuda" else ClosedLoopConfig(min_window_ms=0.0, min_gain=0.0)
    model = build()
    step = deft_compile(model, optimizer_of(model), None, policy="deft", config=DeftConfig(
        compiler=compiler, plan_options={"allow_period": False}, closed_loop=loop,
        preserver=PreserverConfig(staleness_price=1e9, trade_margin=0.0)))
    losses, ran, segments, all_synchronous = [], [], set(), True
    started = time.perf_counter()
    for inputs, targets in batches:
        plan = step.plan
        with autocast():
            losses.append(float(step(inputs, targets)))
        ran.append((plan or step.plan).policy)
        all_synchronous &= synchronous_plan(plan or step.plan) and synchronous_plan(step.plan)
        extra = getattr(step.lowering.last, "extra", None) or {}
        if "segments" in extra:
            segments.add(extra["segments"])
    step.flush()
    deft_s = time.perf_counter() - started
    deft_val = validate(model)
    gaps = relative_gaps(losses, reference)
    probes = [s for s, _ in step.preserver.staleness_log] if step.preserver is not None else []
    checks.data.update(deft_losses=losses, relative_gaps=gaps, plans=plan_runs(ran), deft_s=deft_s,
                       history=[[h.get("step"), h.get("reason")] for h in step.plan_history], probes=probes,
                       compiles=step.lowering.history, segments_per_step=sorted(segments), ran=step.compiler)
    checks.add("synchronous deft: every plan that ran was synchronous", all_synchronous, all_synchronous, "True")
    trials = {"bytescheduler", "usbyte"} & set(ran)
    checks.add("synchronous deft: the closed loop's trial plans ran", trials == {"bytescheduler", "usbyte"},
               {"policies": sorted(set(ran)), "plans": plan_runs(ran), "history": checks.data["history"]},
               "ByteScheduler's and US-Byte's plans among them")
    checks.add(f"synchronous deft: ran {compiler}", step.compiler == compiler, step.compiler, compiler)
    loss_check(checks, "synchronous deft", gaps[:tracked], floor, ran)
    ratio = deft_val / eager_val
    checks.add("synchronous deft: final validation loss vs eager", abs(ratio - 1.0) <= VALIDATION_BOUND,
               {"deft": deft_val, "eager": eager_val, "ratio": ratio},
               f"ratio within 1 +- {VALIDATION_BOUND}",
               f"{steps} steps, bf16 autocast, emulated link at comm = 2x compute; wall s deft {deft_s:.1f} "
               f"(compiles and closed loop included) vs eager {checks.data['eager_s']:.1f}")

    _plot_accuracy(out_dir, device, reference, losses, gaps, floor, eager_val, deft_val, checks.data["plans"])

    # the same step with the plan switched by hand: no closed loop, no Preserver, DDP's buckets and the priority
    # plans in turn (the first call of a priority plan applies no update; the next call applies it before each
    # layer's forward), against eager on the same steps
    from deft_compile.planner.solvers import solve

    model = build()
    step = deft_compile(model, optimizer_of(model), None, policy="deft", config=DeftConfig(
        compiler=compiler, plan_options={"max_staleness": 0}, closed_loop=ClosedLoopConfig(enabled=False),
        preserver=PreserverConfig(enabled=False)))
    forced, ran = [], []
    for t, (inputs, targets) in enumerate(batches[:forced_steps]):
        if t in switches:
            step.switch_plan({}, f"forced: {switches[t]}", plan=solve(step.profile, switches[t]))
        ran.append(step.plan.policy if step.plan is not None else "deft")
        with autocast():
            forced.append(float(step(inputs, targets)))
    step.flush()
    after = relative_difference(list(model.parameters()), at_forced)
    checks.data.update(forced_losses=forced, forced_plans=plan_runs(ran), forced_params_after_flush=after)
    loss_check(checks, "deft, plans switched by hand", relative_gaps(forced, reference[:forced_steps]),
               floor, ran)


def relative_difference(params: list[Any], reference: list[Any]) -> float:
    """The norm of the parameters' difference over the norm of the reference parameters."""
    diff = sum(float((p.detach().double() - q.double()).pow(2).sum()) for p, q in zip(params, reference))
    norm = sum(float(q.double().pow(2).sum()) for q in reference)
    return math.sqrt(diff) / max(math.sqrt(norm), 1e-30)


def _plot_accuracy(out_dir: Path, device, reference, losses, gaps, floor, eager_val, deft_val, plans) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    top.plot(reference, label=f"eager (val {eager_val:.3f})", linewidth=1)
    top.plot(losses, label=f"synchronous deft (val {deft_val:.3f})", linewidth=1)
    top.set_ylabel("training loss")
    top.legend()
    bottom.semilogy([max(g, 1e-9) for g in gaps], linewidth=1, label="|deft - eager| / eager")
    bottom.axhline(LOSS_BOUND, color="red", linewidth=0.8, label="bound 2^-7")
    bottom.axhline(max(floor, 1e-9), color="gray", linewidth=0.8, linestyle="--", label="one-ulp eager floor")
    for first, policy in plans:
        bottom.axvline(first, color="green", linewidth=0.5, alpha=0.6)
        bottom.text(first, LOSS_BOUND * 1.3, policy, fontsize=6, rotation=90, va="bottom")
    bottom.set_xlabel("step")
    bottom.legend(fontsize=7)
    top.set_title(f"char-level GPT, bf16 autocast, {device.type}")
    fig.tight_layout()
    fig.savefig(out_dir / "accuracy.png", dpi=110)


# -- (a) step time ---------------------------------------------------------------------------------------------


class Variant:
    """One implementation of the training step in the step-time part: its model copy and how it runs one step."""

    def __init__(self, name: str, model, run_one: Callable[[int], Any], step=None) -> None:
        self.name, self.model, self.run_one, self.step = name, model, run_one, step
        self.warmup_s: list[float] = []
        self.blocks: list[Any] = []  # one span per round, over ``block`` steps

    def lowering(self) -> dict[str, Any] | None:
        """What the regional lowering ran in the last step: segments (compiled regions and the aten glue between
        them, in order) and distinct compiled regions; None for what is not a deft_compile step."""
        if self.step is None or self.step.lowering.last is None:
            return None
        return {"compiler": self.step.compiler, **dict(self.step.lowering.last.extra)}


def device_kernels(device, run: Callable[[], Any]) -> int | None:
    """Device kernels (and copies) launched by one call of ``run``, from torch.profiler; None off CUDA."""
    torch = _torch()
    if device.type != "cuda":
        return None
    from torch.autograd import DeviceType

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize(device)
    return sum(1 for event in prof.events() if event.device_type == DeviceType.CUDA)


def part_step_time(device, tiny: bool, checks: Checks, models: list[str], compiler: str, compile_backend: str,
                   rounds: int) -> None:
    torch = _torch()
    from deft_compile import DeftConfig, deft_compile
    from deft_compile.timing import clock_for, resolve_ms

    init_single(device)
    clock = clock_for(device)
    warm, block = (3, 1) if tiny else (4, 5)
    for name in models:
        steps = warm + block
        workload = gpt2_workload(device, tiny, steps) if name == "gpt2" else resnet_workload(device, tiny, steps)
        torch.manual_seed(0)
        base = workload.build().to(device)
        start = [p.detach().clone() for p in base.parameters()]

        def eager_variant(label: str, compiled: bool) -> Variant:
            model = copy.deepcopy(base)
            optimizer = workload.optimizer(model)
            forward = torch.compile(model, backend=compile_backend) if compiled else model

            def run_one(t):
                optimizer.zero_grad(set_to_none=True)
                with workload.autocast(device):
                    loss = _loss_of(workload, forward, workload.batches[t % steps])
                loss.backward()
                optimizer.step()
                return loss.detach()

            return Variant(label, model, run_one)

        def deft_variant(policy: str) -> Variant:
            model = copy.deepcopy(base)
            step = deft_compile(model, workload.optimizer(model), workload.loss_fn, policy=policy,
                                config=DeftConfig(compiler=compiler))

            def run_one(t):
                with workload.autocast(device):
                    return _deft_call(workload, step, workload.batches[t % steps])

            return Variant(f"deft_compile {policy}", model, run_one, step)

        variants = [eager_variant("eager", False), eager_variant("torch.compile", True),
                    deft_variant("wfbp"), deft_variant("deft")]
        # warm-up (compiles): the same steps for every variant, each synchronised and wall-clocked; what each took
        # is saved as it finishes (a cold compile that outlasts the budget leaves the others' figures)
        results: dict[str, Any] = {}
        checks.data[workload.name] = results
        for variant in variants:
            for t in range(warm):
                clock.synchronize()
                started = time.perf_counter()
                variant.run_one(t)
                clock.synchronize()
                variant.warmup_s.append(time.perf_counter() - started)
            results[variant.name] = {"warmup_s": variant.warmup_s}
            checks.save()
        reference = variants[0].model
        compile_diff = param_difference(variants[1].model, reference, start)
        results["torch.compile"].update(compile_diff)
        bound = max(2 * compile_diff["update_rel"], 1e-4)
        for variant in variants[2:]:
            diff = param_difference(variant.model, reference, start)
            results[variant.name].update(diff)
            checks.add(f"{workload.name} {variant.name}: parameters after {warm} steps vs eager (relative norm of "
                       "the updates' difference)", diff["update_rel"] <= bound, diff["update_rel"],
                       f"<= {bound:.3g} (2x torch.compile's {compile_diff['update_rel']:.3g}, or 1e-4)",
                       f"largest element difference {diff['max_rel']:.3g} of the parameter's largest magnitude "
                       f"(torch.compile {compile_diff['max_rel']:.3g})")
            checks.add(f"{workload.name} {variant.name}: ran {compiler}", variant.step.compiler == compiler,
                       variant.step.compiler, compiler)
        for variant in variants:
            results[variant.name]["lowering"] = variant.lowering()
            results[variant.name]["device_kernels_per_step"] = device_kernels(device, lambda: variant.run_one(warm))
        checks.data[workload.name] = results
        checks.save()
        # interleaved rounds: each round runs every variant for ``block`` steps, the order rotating (and reversed
        # every other round), so a trend in the machine's speed falls on every variant alike
        for r in range(rounds):
            order = variants[r % len(variants):] + variants[:r % len(variants)]
            if r % 2:
                order = order[::-1]
            for variant in order:
                mark = clock.mark()
                for t in range(warm, warm + block):
                    variant.run_one(t)
                variant.blocks.append(clock.since(mark))
        clock.synchronize()
        per_round = {v.name: [ms / block for ms in resolve_ms(v.blocks)] for v in variants}
        compiled = per_round["torch.compile"]
        for variant in variants:
            ms = per_round[variant.name]
            results[variant.name].update(step_ms=statistics.median(ms), step_ms_rounds=ms,
                                         vs_torch_compile=statistics.median(a / b for a, b in zip(ms, compiled)))
        checks.data[workload.name] = results
        for variant in variants[2:]:
            ratio = results[variant.name]["vs_torch_compile"]
            lowering = results[variant.name]["lowering"] or {}
            value = {"step_ms": results[variant.name]["step_ms"], "eager_ms": results["eager"]["step_ms"],
                     "torch.compile_ms": results["torch.compile"]["step_ms"], "vs_torch_compile": ratio,
                     "segments_per_step": lowering.get("segments"), "regions": lowering.get("regions"),
                     "device_kernels_per_step": results[variant.name]["device_kernels_per_step"],
                     "torch.compile_kernels_per_step": results["torch.compile"]["device_kernels_per_step"]}
            if device.type == "cuda":
                checks.add(f"{workload.name} {variant.name}: step time vs torch.compile(model), {rounds} interleaved "
                           "rounds", ratio <= 1.0, value, "median per-round ratio <= 1.0")
            else:
                checks.add(f"{workload.name} {variant.name}: step time vs torch.compile(model), {rounds} interleaved "
                           "rounds (CPU smoke)", math.isfinite(ratio) and ratio > 0, value,
                           "reported (a finite ratio); the GPU run bounds it")


# -- (c) profiler ----------------------------------------------------------------------------------------------


def _layer_of(name: str) -> str:
    parts = name.split(".")
    for marker in ("h", "blocks", "layers"):
        if marker in parts:
            i = parts.index(marker)
            if i + 1 < len(parts) and parts[i + 1].isdigit():
                return ".".join(parts[: i + 2])
    return ".".join(parts[:-1]) or name


def _subtree_kernel_us(event) -> float:
    """Microseconds of the device kernels (and copies) launched inside ``event``: each kernel as torch.profiler
    attributed it to the host op that launched it, summed over the op tree under ``event`` (once each: a kernel
    belongs to one op)."""
    own = sum(kernel.duration for kernel in getattr(event, "kernels", []))
    return own + sum(_subtree_kernel_us(child) for child in event.cpu_children)


def reference_node_times(gm, inputs, device, clock, repeats: int = 3) -> dict[Any, float]:
    """Per node of ``gm``, milliseconds by torch.profiler: the node inside a ``record_function`` range, its launches
    queued behind the same device sleep as our profiler's (the host far ahead of the device); on CUDA the sum of
    the kernels the profiler attributes to the range's ops, on a CPU the range's CPU time. The minimum over
    ``repeats`` profiled runs after one warm-up run, as our profiler takes."""
    torch = _torch()
    import torch.fx as fx

    from deft_compile.timing import NODE_SLEEP_S, RUN_LEAD_S

    numbered = {node: i for i, node in enumerate(gm.graph.nodes)}
    by_number = {i: node for node, i in numbered.items()}

    class Annotated(fx.Interpreter):
        run_index = 0

        def run_node(self, n):
            if n.op in ("placeholder", "output", "get_attr"):
                return super().run_node(n)
            if device.type == "cuda":
                clock.device_sleep(NODE_SLEEP_S)
            with torch.profiler.record_function(f"deft_node_{self.run_index}_{numbered[n]}"):
                return super().run_node(n)

    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    samples: dict[Any, list[float]] = {}
    rng = torch.get_rng_state()
    with torch.no_grad():
        Annotated(gm).run(*[t.detach().clone() if isinstance(t, torch.Tensor) else t for t in inputs])
        clock.synchronize()
        with torch.profiler.profile(activities=activities) as prof:
            for run in range(repeats):
                copies = [t.detach().clone() if isinstance(t, torch.Tensor) else t for t in inputs]
                clock.synchronize()
                if device.type == "cuda":
                    clock.device_sleep(RUN_LEAD_S)
                interpreter = Annotated(gm)
                interpreter.run_index = run
                interpreter.run(*copies)
                clock.synchronize()
    torch.set_rng_state(rng)
    per_run: dict[tuple[int, Any], float] = {}
    for event in prof.events():
        if not event.name.startswith("deft_node_") or event.device_type != _cpu_device_type():
            continue
        run, number = (int(x) for x in event.name[len("deft_node_"):].split("_"))
        ms = _subtree_kernel_us(event) / 1e3 if device.type == "cuda" else event.cpu_time_total / 1e3
        per_run[(run, by_number[number])] = per_run.get((run, by_number[number]), 0.0) + ms
    for (_, node), ms in per_run.items():
        samples.setdefault(node, []).append(ms)
    return {node: min(values) for node, values in samples.items()}


def _cpu_device_type():
    from torch.autograd import DeviceType

    return DeviceType.CPU


def per_layer_ms(captured, index, annotation, node_ms: dict[Any, float]) -> tuple[Any, dict[str, float]]:
    """The profile ``node_ms`` gives (no links) and its compute per layer (forward + backward + update)."""
    from deft_compile.planner.plan import LinkCost
    from deft_compile.step.profiler import attribute_times
    from deft_compile.step.scheduling import static_profile

    profile = static_profile(captured, index, [LinkCost("local", 0.0, 0.0)], 1,
                             attribute_times(annotation, index, node_ms))
    layers: dict[str, float] = {}
    for param in profile.params:
        layers[_layer_of(param.name)] = layers.get(_layer_of(param.name), 0.0) + (
            param.forward_ms + param.backward_ms + param.update_ms)
    return profile, layers


def plans_from(captured, index, annotation, ours: dict[Any, float], theirs: dict[Any, float]) -> dict[str, Any]:
    """Does the profile's error change a plan? ``deft``, ``bytescheduler`` and ``usbyte`` solved from our node
    times and from the reference's, two ranks behind one link whose all-reduce of every gradient takes twice the
    step's compute by our profile (coverage rate 2, where delays and priorities matter)."""
    from deft_compile.planner.plan import LinkCost
    from deft_compile.planner.solvers import solve
    from deft_compile.step.profiler import attribute_times
    from deft_compile.step.scheduling import static_profile

    compute = sum(ours.values())
    nbytes = sum(p.numel() * p.element_size() for p, trains in zip(captured.model_state.params, captured.trainable)
                 if trains)
    links = [LinkCost("emulated", 0.05, 2.0 * compute / max(nbytes, 1))]
    profiles = {label: static_profile(captured, index, links, 2, attribute_times(annotation, index, times))
                for label, times in (("deft_compile", ours), ("reference", theirs))}
    result = {}
    for policy in ("deft", "bytescheduler", "usbyte"):
        plans = {label: solve(profile, policy) for label, profile in profiles.items()}
        result[policy] = {"same_plan": plans["deft_compile"].hash() == plans["reference"].hash(),
                          "items": {k: len(p.items) for k, p in plans.items()},
                          "delayed_items": {k: sum(1 for i in p.items if i.delay) for k, p in plans.items()},
                          "options": {k: {o: v for o, v in p.options.items() if not isinstance(v, (list, dict))}
                                      for k, p in plans.items()}}
    return result


def part_profiler(device, tiny: bool, checks: Checks) -> None:
    torch = _torch()

    from deft_compile.step.capture import capture_step, split_user_inputs
    from deft_compile.step.optim_support import hyperparameter_inputs
    from deft_compile.step.pipeline import annotate_capture
    from deft_compile.step.profiler import measure_node_times
    from deft_compile.step.scheduling import ProfileIndex
    from deft_compile.timing import RUN_LEAD_S, clock_for

    workload = gpt2_workload(device, tiny, 1, batch=8, context=512)
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
    inputs = [*captured.model_state.params, *captured.model_state.buffers, *user_tensors, *hyperparameter_inputs(optimizer)]
    clock = clock_for(device)
    checks.add("profiler clock follows the device", clock.kind == ("cuda" if device.type == "cuda" else "host"),
               clock.kind, "cuda events on a GPU, the host clock on a CPU")
    started = time.perf_counter()
    ours = measure_node_times(captured, inputs, warmup=1, repeats=3)
    checks.data["profile_s"] = time.perf_counter() - started
    gm = captured.graph_module
    theirs = reference_node_times(gm, inputs, device, clock)
    with torch.no_grad():  # the whole graph back to back (no per-node brackets), for scale
        copies = [t.detach().clone() if isinstance(t, torch.Tensor) else t for t in inputs]
        clock.synchronize()
        if device.type == "cuda":
            clock.device_sleep(RUN_LEAD_S)
        mark = clock.mark()
        rng = torch.get_rng_state()
        gm(*copies)
        whole_ms = clock.since(mark).ms
        torch.set_rng_state(rng)
        replay_ms, replay_error = graph_replay_ms(gm, inputs, clock) if device.type == "cuda" else (None, "no GPU")
    checks.data.update(whole_graph_ms=whole_ms, sum_of_nodes_ms=sum(ours.values()),
                       reference_sum_of_nodes_ms=sum(theirs.values()))
    _, layers_ours = per_layer_ms(captured, index, annotation, ours)
    _, layers_theirs = per_layer_ms(captured, index, annotation, theirs)
    rows = {layer: {"deft_compile_ms": layers_ours.get(layer, 0.0), "reference_ms": ms,
                    "ratio": layers_ours.get(layer, 0.0) / ms if ms > 0 else math.inf}
            for layer, ms in layers_theirs.items()}
    checks.data["per_layer"] = rows
    plans = plans_from(captured, index, annotation, ours, theirs)
    checks.data["plans"] = plans
    changed = sorted(policy for policy, entry in plans.items() if not entry["same_plan"])
    total_ours, total_theirs = sum(layers_ours.values()), sum(layers_theirs.values())
    if device.type != "cuda":
        # on a host the profiler's own bookkeeping is most of an annotated node's CPU time: only the bookkeeping
        # of the comparison is checked (the same layers on both sides, every time measured, the plans solved)
        same = set(layers_ours) == set(layers_theirs)
        positive = all(v > 0 for layers in (layers_ours, layers_theirs) for v in layers.values())
        checks.add("both sides time the same layers, all positive; plans solved from both (CPU smoke)",
                   same and positive and len(plans) == 3,
                   {"layers": len(rows), "deft_compile_ms": total_ours, "reference_ms": total_theirs,
                    "plans_changed_by_the_difference": changed}, "same layer set, every time > 0")
        return
    ok = replay_ms is not None and abs(sum(ours.values()) / replay_ms - 1.0) <= PROFILE_BOUND
    checks.add("sum of per-node times vs a CUDA-graph replay of the whole graph", ok,
               {"sum_of_nodes_ms": sum(ours.values()), "replay_ms": replay_ms, "error": replay_error},
               f"ratio within 1 +- {PROFILE_BOUND}")
    weighty = {k: v for k, v in rows.items() if v["reference_ms"] >= 0.01 * total_theirs}
    worst = max(weighty.items(), key=lambda kv: abs(kv[1]["ratio"] - 1.0)) if weighty else ("-", {"ratio": math.nan})
    off = abs(worst[1]["ratio"] - 1.0) > PROFILE_BOUND
    checks.add("per-layer time vs torch.profiler's kernel time (worst layer of >= 1 % of the step)", not off,
               {"layer": worst[0], "ratio": worst[1]["ratio"], "layers": len(weighty)},
               f"ratio within 1 +- {PROFILE_BOUND}",
               ("the difference changes the plans of " + ", ".join(changed) if changed else
                "the plans solved from either profile are the same") + " (coverage rate 2, two ranks)")
    checks.add("step total vs torch.profiler's kernel time", abs(total_ours / total_theirs - 1.0) <= PROFILE_BOUND,
               {"deft_compile_ms": total_ours, "reference_ms": total_theirs, "ratio": total_ours / total_theirs},
               f"ratio within 1 +- {PROFILE_BOUND}")
    checks.add("the profile's difference from the reference changes no plan", not changed,
               {"changed": changed, "plans": plans}, "the same deft, bytescheduler and usbyte plans from both")


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


def two_ranks_worker(rank: int, world_size: int, device_name: str, tiny: bool) -> dict:
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
    steps = 4 if tiny else 6
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
                                          delayed_update="averaged", preserver=PreserverConfig(enabled=False)))
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


def part_two_ranks(device, tiny: bool, checks: Checks, timeout_s: float) -> None:
    from deft_compile.tools.launcher import run_local_workers

    env = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    results = run_local_workers(two_ranks_worker, 2, (str(device), tiny), backend="gloo", timeout_s=timeout_s,
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


def part_overlap(device, tiny: bool, checks: Checks, out_dir: Path, commit: str | None = None) -> None:
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
    layers, dim, context, batch = (2, 64, 32, 4) if tiny else (6, 768, 512, 16)
    torch.manual_seed(0)
    base = hf_gpt2(False, layers=layers, dim=dim, heads=max(1, dim // 64), vocab=8192 if not tiny else 256,
                   context=context).to(device)
    g = torch.Generator().manual_seed(3)
    vocab = base.config.vocab_size
    batches = []
    for _ in range(6 if tiny else 12):
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
    if tiny:  # a tiny model's gradient is far smaller than the profiler's largest link probe (4 MiB)
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
        trace = {"provenance": run_provenance(commit), "traceEvents": trace_events}
        (out_dir / "overlap_trace.json").write_text(json.dumps(trace))


# -- driver ----------------------------------------------------------------------------------------------------


def part_budget(name: str, device: str, quick: bool) -> int:
    letter, quick_s, full_s, cpu_s = PARTS[name]
    if device != "cuda":
        return cpu_s
    return quick_s if quick else full_s


def run_part(name: str, args: argparse.Namespace) -> dict[str, Any]:
    torch = _torch()
    device = torch.device(args.device if args.device != "cuda" else "cuda:0")
    tiny = device.type != "cuda"
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
        if name == "accuracy":
            part_accuracy(device, tiny, checks, out_dir, args.accuracy_compiler or compiler, args.accuracy_steps)
        elif name == "step_time":
            models = args.models.split(",") if args.models else (["gpt2"] if args.quick and not tiny
                                                                  else ["gpt2", "resnet50"])
            rounds = 2 if tiny else (5 if args.quick else 8)
            part_step_time(device, tiny, checks, models, compiler, backend, rounds)
        elif name == "profiler":
            part_profiler(device, tiny, checks)
        elif name == "two_ranks":
            part_two_ranks(device, tiny, checks, timeout_s=max(30.0, (args.part_timeout or 120.0) - 15.0))
        elif name == "overlap":
            part_overlap(device, tiny, checks, out_dir, args.commit)
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
    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.cuda.is_available()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["cuda_version"] = torch.version.cuda
        info["driver"] = _nvidia_driver()
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info


def _nvidia_driver() -> str | None:
    try:
        return Path("/proc/driver/nvidia/version").read_text().split("Kernel Module", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def run_provenance(commit: str | None) -> dict[str, Any]:
    """The run's provenance (``deft_compile.tools.provenance``). Where the checkout has no git (a lent machine's copy
    of the tree), ``commit`` given on the command line is the commit, and ``recovered`` says so: whether the tree
    was clean is then not known."""
    from deft_compile.tools.provenance import provenance

    record = provenance()
    if record.get("commit") is None and commit:
        record.update(commit=commit, clean=None, changed=None,
                      recovered="commit given on the command line (--commit): the tree the run read has no git, "
                                "so whether it was clean is not known")
    return record


def print_table(report: dict[str, Any]) -> None:
    print(f"\n== gpu_check on {report['environment'].get('gpu', report['device'])} "
          f"(torch {report['environment']['torch']}, commit {str(report['provenance'].get('commit'))[:10]}) ==")
    for part in report["parts"]:
        status = "ERROR" if part["error"] else ("ok" if all(c["ok"] for c in part["checks"]) else "FAIL")
        print(f"\n({part['letter']}) {part['part']}: {status}  [{part['seconds']:.0f} s of {part['budget_s']} s]")
        for row in part["checks"]:
            mark = "ok  " if row["ok"] else "FAIL"
            print(f"  {mark} {row['check']}: {json.dumps(row['value'])}  [{row['bound']}]"
                  + (f"  ({row['note']})" if row["note"] else ""))
        if part["error"]:
            print("  " + part["error"].strip().replace("\n", "\n  ")[-3000:])


def _run_child(name: str, args: argparse.Namespace, timeout: float, out_dir: Path) -> dict[str, Any]:
    """One part in its own process, cut at ``timeout`` (a faulthandler dump of every thread 5 s before)."""
    command = [sys.executable, str(Path(__file__).resolve()), "--part", name, "--device", args.device,
               "--out", str(out_dir), "--part-timeout", f"{timeout:.0f}"]
    for flag, value in (("--models", args.models), ("--compiler", args.compiler), ("--commit", args.commit),
                        ("--compile-backend", args.compile_backend), ("--accuracy-compiler", args.accuracy_compiler),
                        ("--accuracy-steps", args.accuracy_steps)):
        if value:
            command += [flag, str(value)]
    command += ["--quick"] if args.quick else []
    result_path = out_dir / f"part_{name}.json"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    try:
        completed = subprocess.run(command, timeout=timeout, env=env, capture_output=True, text=True)
        result = (json.loads(result_path.read_text()) if result_path.exists() else
                  {"part": name, "letter": PARTS[name][0], "checks": [], "data": {},
                   "error": f"exit code {completed.returncode}:\n{completed.stderr[-4000:]}"})
        if completed.returncode != 0 and not result.get("error"):
            result["error"] = f"exit code {completed.returncode}:\n{completed.stderr[-4000:]}"
    except subprocess.TimeoutExpired as expired:
        stderr = expired.stderr.decode() if isinstance(expired.stderr, bytes) else (expired.stderr or "")
        result = (json.loads(result_path.read_text()) if result_path.exists() else
                  {"part": name, "letter": PARTS[name][0], "checks": [], "data": {}})
        result["error"] = f"cut at its budget of {timeout:.0f} s (the checks above finished):\n{stderr[-8000:]}"
    result_path.unlink(missing_ok=True)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--out", default="gpu_check_out", help="folder for gpu_check.json and the plots")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--quick", action="store_true",
                        help="on CUDA: the parts' short budgets (the run within 8 minutes on a cold cache) and the "
                             "step-time part on GPT-2 alone; the CPU smoke is always tiny and short")
    parser.add_argument("--models", default=None, help="step_time's models: gpt2, resnet50")
    parser.add_argument("--budget-s", type=float, default=None,
                        help=f"the whole run's seconds: no part starts with less than 20 s left (default "
                             f"{RUN_BUDGET_S:.0f} with --quick and in the CPU smoke, else the parts' budgets' sum)")
    parser.add_argument("--compiler", default=None,
                        help="deft_compile's compiler (default: inductor, the default route, on CUDA; aten on CPU)")
    parser.add_argument("--compile-backend", default=None, help="torch.compile's backend for the baseline")
    parser.add_argument("--accuracy-compiler", default=None, help="deft_compile's compiler in the accuracy part")
    parser.add_argument("--accuracy-steps", type=int, default=None,
                        help="training steps of the accuracy part (default 200 on CUDA, 20 in the CPU smoke)")
    parser.add_argument("--commit", default=None,
                        help="the commit the tree is, recorded where the checkout has no git (a lent machine's copy)")
    parser.add_argument("--part-budget-s", type=float, default=None,
                        help="every part's budget in seconds, in place of its own (a longer accuracy run)")
    parser.add_argument("--part", default=None, help=argparse.SUPPRESS)  # run one part in this process
    parser.add_argument("--part-timeout", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    run_started = time.monotonic()  # the run's budget counts from here, the driver's own set-up included
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.budget_s is None:
        full = args.device == "cuda" and not args.quick
        parts_s = float(sum(part_budget(name, args.device, args.quick) for name in PARTS))
        args.budget_s = parts_s if full else RUN_BUDGET_S
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
    names = [p for p in args.parts.split(",") if p]
    unknown = [name for name in names if name not in PARTS]
    if unknown:
        parser.error(f"unknown part(s) {', '.join(unknown)}; the parts: {', '.join(PARTS)}")
    report = {"provenance": run_provenance(args.commit), "device": args.device, "quick": args.quick,
              "budget_s": args.budget_s, "environment": environment(), "parts": []}
    results_path = out_dir / "gpu_check.json"
    deadline = run_started + args.budget_s
    for name in names:
        budget = args.part_budget_s or part_budget(name, args.device, args.quick)
        left = deadline - time.monotonic()
        if left < 20:
            result = {"part": name, "letter": PARTS[name][0], "seconds": 0.0, "checks": [], "data": {},
                      "error": f"not run: the run's {args.budget_s:.0f} s were spent"}
        else:
            timeout = min(budget, left)
            print(f"[gpu_check] part {name} (budget {timeout:.0f} s)", flush=True)
            started = time.perf_counter()
            result = _run_child(name, args, timeout, out_dir)
            result["seconds"] = time.perf_counter() - started
        result["budget_s"] = budget
        report["parts"].append(result)
        report["seconds"] = time.monotonic() - run_started
        results_path.write_text(json.dumps(report, indent=1))  # after every part: a cut run keeps what finished
    print_table(report)
    failed = [p["part"] for p in report["parts"] if p["error"] or not all(c["ok"] for c in p["checks"])]
    print(f"\n[gpu_check] {len(report['parts']) - len(failed)} of {len(report['parts'])} parts passed in "
          f"{report.get('seconds', 0.0):.0f} s" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
