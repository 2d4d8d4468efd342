"""``deft-compile bench``: every policy against torch DDP and the no-communication floor, on real (shaped) links.

For each model and each bandwidth, one launch of ``--workers`` local gloo
workers (one intra-op thread each) trains, in the same processes and in
interleaved blocks:

* ``floor``: the same compiled step on a one-rank group per worker
  (``dist.new_group([rank])``: training is local, no collective), all workers
  busy at once as in every other variant;
* ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` (eager, default buckets);
* one ``deft_compile`` step per ``--policies`` entry (``deft`` with its default
  Preserver and solver options; ``deft-no-preserver`` is ``deft`` with
  ``PreserverConfig(enabled=False)``: the schedule's speed when no convergence
  guard vetoes a delay, the closed loop still deciding by measurement;
  ``deft-priority-sync`` is ``deft`` with ``ClosedLoopConfig(priority_schedule=True)``:
  its plans with delays carry the parameters they leave synchronous on a priority schedule).

The network: ``--bandwidth none`` runs on the machine's loopback, unshaped;
a rate (``1gbit``, ``200mbit``) runs the workers in a private network namespace
whose loopback is shaped with ``tc tbf`` (``--links 1``, ``ShapedLoopback``) or
in two namespaces joined by two shaped veth links (``--links 2``,
``TwoHostLinks``, 2 workers; ``deft`` gets the second link through
``DeftConfig(links=("gloo:link2",))``, the others use link1 only). Shaping
needs root and iproute2. Every namespace this process made is deleted when a
run ends, fails or is interrupted (Ctrl-C), see ``deft_compile.tools.netns``.

Timing: ``--warmup`` discarded steps per variant (tracing, profiling, the
first graph), more for a compiled plan until one whole update-period cycle
has run without capturing a new graph, then ``--rounds`` rounds; each round runs one block per variant
in a rotated order, each block a barrier, one untimed step and the timed steps.
A step's time is the slowest rank's. Reported per variant: median step ms,
ratio to the floor and to DDP (medians of the same run), the *paired* ratio to
DDP (median over rounds of block-median ratios, robust to other jobs on the
machine), exposed communication = median step - median floor step, the final
loss (mean over ranks of the last 5 steps), and for compiled policies the
simulator's prediction for the plan on its measured profile.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from deft_compile.compilers import COMPILERS, default_compiler

MiB = 1 << 20
POLICY_CHOICES = ("wfbp", "deft", "bytescheduler", "usbyte", "dssync", "deft-no-preserver", "deft-priority-sync")
# Bench variants that are a policy with other settings: name -> (policy, {"preserver" or "closed_loop": fields of
# that config besides the defaults}). Plain data, so the parent process needs no torch import.
POLICY_VARIANTS: dict[str, tuple[str, dict[str, dict[str, Any]]]] = {
    "deft-no-preserver": ("deft", {"preserver": {"enabled": False}}),
    # deft whose plans with delays carry what they leave synchronous on the settled priority schedule
    "deft-priority-sync": ("deft", {"closed_loop": {"priority_schedule": True}}),
}
DEFAULT_POLICIES = ("wfbp", "bytescheduler", "usbyte", "deft")
COMPILED_DDP = "ddp-compiled"  # a baseline variant run_config accepts among its policies: torch.compile(DDP(model))
# A baseline variant run_config accepts among its policies: the floor's step with one all-reduce of the whole
# gradient running beside it (``overlap_bound_step``): what perfect overlap of every byte would give on this machine.
OVERLAP_BOUND = "overlap-bound"
BASELINE_CHOICES = (COMPILED_DDP, OVERLAP_BOUND)  # what --policies also takes besides the policies
# Kept here (not imported from bench_models) so that building the CLI parser does not import torch:
# `deft-compile simulate` must work without it. tests/test_bench.py checks they match bench_models.
MODEL_NAMES = ("mlp", "vgg", "resnet", "gpt2", "vgg11", "vgg16", "vgg19", "resnet18", "resnet50", "resnet101",
               "gpt2-tiny", "gpt2-mini", "mlp-teacher", "vgg16-bn", "gpt2-small-hf", "bert-base-hf", "vgg16-bn-tiny",
               "gpt2-hf-tiny", "resnet50-teacher", "vgg16-bn-teacher")
DEFAULT_MODELS = ("vgg19", "resnet101", "gpt2-mini")
FINAL_LOSS_STEPS = 5
STAT_NOTE = (
    "step ms = median over the interleaved blocks of each block's mean step time (a step's time is the slowest rank's;\n"
    "  a mean, so steps of an update period that communicate nothing do not hide the ones that do); median = per-step\n"
    "  median; vs floor / vs DDP = ratios of step ms in this run; paired = median over rounds of the block-mean ratio\n"
    "  to DDP's block of the same round; exposed ms = step ms - floor's step ms; loss @ N = mean over ranks of\n"
    "  steps N-4..N, N the step count every variant reached (all draw the same batches in order; a closed loop's\n"
    "  trials make its run longer); sim ms = the plan simulated on its measured profile; retraced = timed steps\n"
    "  that captured a new graph (Preserver re-plans), left out of the timing.")


# --------------------------------------------------------------------------- worker


def preserver_seconds(runner: Any) -> float:
    """Seconds the Preserver of a ``deft_compile`` step has spent on its own measurements so far (staleness
    probes, copies and paired replays; ``overheads``), 0 for a runner without one. The simulator models the
    communication schedule, not these, so the bench times a step both with and without them."""
    overheads = getattr(runner, "overheads", None)
    if not overheads:
        return 0.0
    return float(overheads["probe_seconds"]) + float(overheads["attribution_seconds"])


def overlap_bound_step(local_step: Callable[..., Any], gradient_bytes: int, group: Any) -> Callable[..., Any]:
    """The fastest that a schedule all-reducing every gradient byte every step can run on this machine.

    ``local_step`` is the floor's step (no communication); one all-reduce of ``gradient_bytes`` is launched
    before it and waited for after it: every byte overlapped with the whole step, with no dependency, bucket
    or flatten copy in the way. What it adds to the floor is what communicating costs even when perfectly
    hidden: on CPU, gloo's copies, reductions and the loopback's kernel work take cores the compute needs
    (in ``--emulate-accelerator`` they run on their own core, as on an accelerator). A plan below it sends
    fewer bytes (update periods); a target below it cannot be met here by hiding communication."""
    import torch
    import torch.distributed as dist

    buffer = torch.zeros(max(1, gradient_bytes // 4))  # zeros: sums stay zero, the bytes are what count

    def run(*args: Any, **kwargs: Any) -> Any:
        work = dist.all_reduce(buffer, group=group, async_op=True)
        loss = local_step(*args, **kwargs)
        work.wait()
        return loss

    return run


def eager_step(module: Any, optimizer: Any, loss_fn: Any):
    """An eager training step (zero_grad, loss, backward, step) returning the detached loss: the DDP and floor
    baselines of every benchmark. ``loss_fn(module(inputs), targets)``, or ``module(*args)`` without one."""

    def run(*args: Any, **kwargs: Any) -> Any:
        optimizer.zero_grad(set_to_none=True)
        if loss_fn is not None:
            inputs, targets = args
            loss = loss_fn(module(inputs, **kwargs), targets)
        else:
            loss = module(*args, **kwargs)
        loss.backward()
        optimizer.step()
        return loss.detach()

    return run


def _settle(name: str, call: Callable[[str], tuple[float, bool]], plan: Any) -> None:
    """Warm up a plan with an update period further, until one whole cycle runs without capturing a graph.

    With a period K the first cycles meet new graph variants (a phase with an accumulator carried in,
    for example); timing those steps would time compilation. Every rank captures the same graphs at the same
    steps (the same plan, phases and shapes), so each decides alone and all stop at the same step
    (``_warmed_up_alike`` checks). Bounded: at most 4 cycles + 4 steps.
    """
    if plan is None:
        return
    from deft_compile.debug.artifacts import plan_cycle

    cycle, quiet, extra = plan_cycle(plan), 0, 0
    if cycle <= 1:  # no period: the graphs of the warm-up are final (and DDP-equal runs keep equal step counts)
        return
    while quiet < cycle and extra < 4 * cycle + 4:
        _, retraced = call(name)
        extra += 1
        quiet = 0 if retraced else quiet + 1


def _settle_closed_loop(call: Callable[[str], tuple[float, bool]], name: str, step: Any, limit: int = 1000) -> None:
    """Warm up until closed-loop planning (``deft_compile.step.closed_loop``) settled on a plan: its measured
    trials switch plans and retrace, which the timed steps must not include. A Preserver that starts
    synchronous (``PreserverConfig.start_synchronous``) first trades once its prices exist, after
    ``staleness_every`` steps, and the closed loop then duels the traded plan: the warm-up runs past that
    first trade too. Bounded: 1000 steps, room for windows and duel blocks of short steps stretched to
    ``ClosedLoopConfig.max_window_steps`` (five candidates and four duel rounds of 50-step windows are ~700).

    Each rank decides alone: the closed loop's and the Preserver's decisions are agreed across ranks at the
    same steps, so every rank leaves at the same step (``_warmed_up_alike`` checks). No flag is all-reduced
    after every step: that is a synchronisation between steps that training does not have, and its packets
    queue behind the gradients a delayed or priority plan leaves in flight (on the shaped link, whatever the
    group: 33-46 ms for a 1-element all-reduce started 5 ms after a 16 MB one at 500 Mbit/s), so the closed
    loop's trials would time such plans with part of their carried communication done outside the timed
    steps."""
    loop = getattr(step, "closed_loop", None)
    if loop is None:
        return
    preserver = getattr(step, "preserver", None)
    first_trade = (preserver.config.staleness_every + 1 if preserver is not None and preserver.start_synchronous
                   else 0)
    for _ in range(limit):
        if loop.state == "settled" and step.step_count >= first_trade:
            return
        call(name)


def _warmed_up_alike(name: str, steps: int, control: Any) -> None:
    """Raise if the ranks ran different numbers of warm-up steps of ``name`` (a decision not agreed across
    ranks): their timed steps would not pair collectives. One all-reduce after the warm-up, not one per step."""
    import torch
    import torch.distributed as dist

    counts = torch.tensor([float(steps), -float(steps)], dtype=torch.float64)
    dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=control)
    if counts[0].item() != -counts[1].item():
        raise RuntimeError(f"bench: the ranks warmed up {name} for different numbers of steps "
                           f"({-counts[1].item():.0f} to {counts[0].item():.0f}): a decision was not agreed")


def _progress_bar(cfg: dict[str, Any], variants: int) -> Any:
    """Rank 0's progress bar over every step the run takes (warm-ups and timed blocks of all variants)."""
    from tqdm import tqdm

    total = variants * (cfg["warmup"] + cfg["rounds"] * (cfg["block"] + 1))
    return tqdm(total=total, desc=cfg.get("label", "bench"), unit="step", file=sys.stderr, dynamic_ncols=True,
                leave=True)


def bench_worker(rank: int, world_size: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """One rank of one (model, network) configuration: every variant, interleaved. Returns plain data."""
    import torch
    import torch.distributed as dist

    from deft_compile.step.profiler import measure_allreduce
    from deft_compile.tools.bench_models import resolve_model
    from deft_compile.tools.emulation import new_group

    preset = resolve_model(cfg["model"])
    torch.manual_seed(0)
    base = preset.build()
    batch_size = cfg["batch"] or preset.default_batch
    pool = [preset.batch(batch_size, torch.Generator().manual_seed(10_000 * (rank + 1) + i))
            for i in range(cfg["batch_pool"])]
    grad_bytes = sum(p.numel() * p.element_size() for p in base.parameters() if p.requires_grad)
    solo = [new_group(ranks=[r]) for r in range(world_size)][rank]  # new_group is collective: every rank makes all
    control = new_group(ranks=list(range(world_size)))  # the warm-up's check, beside the gradients in flight
    # the overlap bound's all-reduce on a group of its own, its threads placed as a step's (emulation)
    bound_group = new_group(ranks=list(range(world_size))) if OVERLAP_BOUND in cfg["variants"] else None
    allreduce_ms = measure_allreduce(None, [grad_bytes], repeats=cfg["link_repeats"], warmup=1)[0][1]

    runners, models, compiled = _variants(cfg, preset, base, solo, bound_group, grad_bytes)

    progress = _progress_bar(cfg, len(runners)) if rank == 0 and cfg["progress"] else None
    counters = {name: 0 for name in runners}
    losses: dict[str, list[float]] = {name: [] for name in runners}

    own_seconds: dict[str, float] = {name: 0.0 for name in runners}

    def call(name: str) -> tuple[float, bool]:
        """Run one step of ``name``; (seconds, whether it captured a new graph: a retrace, e.g. after a re-plan).
        The Preserver's own time in the step (its staleness probes, copies and replays) goes to
        ``own_seconds[name]``."""
        args, kwargs = pool[counters[name] % len(pool)]
        counters[name] += 1
        traces = getattr(runners[name], "trace_count", 0)
        own = preserver_seconds(runners[name])
        started = time.perf_counter()
        loss = runners[name](*args, **kwargs)
        elapsed = time.perf_counter() - started
        own_seconds[name] = preserver_seconds(runners[name]) - own
        losses[name].append(float(loss))
        if progress is not None:
            progress.update()
        return elapsed, getattr(runners[name], "trace_count", 0) != traces

    warmup_s: dict[str, float] = {}
    for name in runners:
        if progress is not None:
            progress.set_postfix_str(f"warm-up {name}")
        dist.barrier()
        started = time.perf_counter()
        for _ in range(cfg["warmup"]):
            call(name)
        _settle_closed_loop(call, name, runners[name])
        _settle(name, call, getattr(runners[name], "plan", None))
        warmup_s[name] = time.perf_counter() - started
        _warmed_up_alike(name, counters[name], control)

    names = list(runners)
    samples: dict[str, list[float]] = {name: [] for name in names}
    schedule: dict[str, list[float]] = {name: [] for name in names}  # the same steps without the Preserver's time
    traced: dict[str, list[float]] = {name: [] for name in names}
    # per block, this rank's start and end of the timed steps on the host's monotonic clock (perf_counter), which
    # the local workers share: the block's wall time runs from the first rank's start to the last rank's end
    spans: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(cfg["rounds"]):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            if progress is not None:
                progress.set_postfix_str(f"round {round_index + 1}/{cfg['rounds']} {name}")
            dist.barrier()
            call(name)  # absorbs whatever the previous block left on the link
            begun = time.perf_counter()
            for _ in range(cfg["block"]):
                seconds, retraced = call(name)
                samples[name].append(seconds * 1e3)
                schedule[name].append((seconds - own_seconds[name]) * 1e3)
                traced[name].append(1.0 if retraced else 0.0)
            spans[name] += [begun, time.perf_counter()]
    if progress is not None:
        progress.close()
    dist.barrier()

    by_rank, block_wall = _agree_samples(names, world_size, samples, spans, schedule, traced, losses)
    for step in compiled.values():
        if step.pending:
            step.flush()
    identical, max_diff, max_rel = _compare_ddp_wfbp(models)
    compiled_rel = _compare_ddp_wfbp(models, COMPILED_DDP)[2]  # torch.compile's own difference from DDP's numbers
    measured = _measured_timeline(cfg, compiled, pool[0], rank)

    # what a user lives through: from a variant's first call, its warm-up (compiles, planning, closed-loop trials)
    # and its timed steps (this rank's own wall clock; the interleaved blocks of the other variants left out)
    first_call_s = {name: warmup_s[name] + sum(end - begin for begin, end in zip(spans[name][::2], spans[name][1::2]))
                    for name in names}
    result: dict[str, Any] = {"samples_ms": samples, "samples_by_rank_ms": by_rank, "block_wall_ms": block_wall,
                              "schedule_ms": schedule, "retraced": traced, "losses": losses, "warmup_s": warmup_s,
                              "first_call_s": first_call_s,
                              "overheads": {n: {k: v for k, v in s.overheads.items() if isinstance(v, (int, float))}
                                            for n, s in compiled.items()},
                              "identical_ddp_wfbp": identical, "max_abs_diff_ddp_wfbp": max_diff,
                              "max_rel_diff_ddp_wfbp": max_rel, "max_rel_diff_ddp_compiled": compiled_rel,
                              "wfbp_compiler": compiled["wfbp"].compiler if "wfbp" in compiled else None}
    if rank == 0:
        result.update(
            params=sum(p.numel() for p in base.parameters()),
            gradient_bytes=grad_bytes,
            batch=batch_size,
            allreduce_all_ms=allreduce_ms,
            **_plans_record(compiled),
            measured_timeline=measured,
        )
    return result


def _plans_record(compiled: dict[str, Any]) -> dict[str, Any]:
    """What rank 0 reports of every compiled step: plans, profiles, plan history, closed loop, Preserver."""
    return dict(
        plans={n: s.plan.to_json() for n, s in compiled.items()},
        profiles={n: s.profile.to_json() for n, s in compiled.items()},
        # the closed loop's record too (measured and predicted ms per candidate, the fitted factors and
        # contention): what a reader needs to see why a plan was kept
        plan_history={n: [{k: v for k, v in h.items()
                           if isinstance(v, (str, int, float, bool, type(None))) or k == "closed_loop"}
                          for h in json.loads(json.dumps(s.plan_history, default=float))]
                      for n, s in compiled.items()},
        trace_counts={n: s.trace_count for n, s in compiled.items()},
        # the closed loop's own time for the plan that runs (consecutive steps of that plan alone, median,
        # slowest rank): beside the rounds' time of the same plan it shows what interleaving costs
        closed_loop_ms={n: s.closed_loop.measured[s.plan.hash()][1] for n, s in compiled.items()
                        if s.closed_loop is not None and s.plan.hash() in s.closed_loop.measured},
        preserver={n: s.preserver is not None for n, s in compiled.items()},
        preserver_dismissed={n: [e.reason for e in s.preserver.dismissed] for n, s in compiled.items()
                             if s.preserver is not None},
    )


def _variants(cfg: dict[str, Any], preset: Any, base: Any, solo: Any, bound_group: Any,
              grad_bytes: int) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Every variant's (runner, model) from one copy of ``base`` each: (runners, models, the compiled steps)."""
    import torch
    import torch.nn as nn

    from deft_compile import DeftConfig, deft_compile
    from deft_compile.planner.closed_loop import ClosedLoopConfig
    from deft_compile.preserver import PreserverConfig

    runners: dict[str, Any] = {}
    models: dict[str, nn.Module] = {}
    compiled: dict[str, Any] = {}
    for name in cfg["variants"]:
        model = copy.deepcopy(base)
        optimizer = preset.optimizer(model)
        models[name] = model
        if name == "ddp":
            runners[name] = eager_step(nn.parallel.DistributedDataParallel(model), optimizer, preset.loss_fn)
        elif name == COMPILED_DDP:  # torch.compile(DDP): Dynamo splits the graph at DDP's buckets (DDPOptimizer)
            ddp = nn.parallel.DistributedDataParallel(model)
            runners[name] = eager_step(torch.compile(ddp), optimizer, preset.loss_fn)
        elif name in ("floor", OVERLAP_BOUND):
            step = deft_compile(model, optimizer, preset.loss_fn, policy="wfbp", process_group=solo,
                                config=DeftConfig(compiler=cfg["compiler"]))
            if step.world_size != 1:
                raise RuntimeError("the floor must train locally (one-rank group)")
            runners[name] = step if name == "floor" else overlap_bound_step(step, grad_bytes, bound_group)
        else:
            policy, settings = POLICY_VARIANTS.get(name, (name, {}))
            links = tuple(cfg["extra_links"]) if policy == "deft" else ()
            step = deft_compile(model, optimizer, preset.loss_fn, policy=policy,
                                config=DeftConfig(links=links, compiler=cfg["compiler"],
                                                  contention=cfg.get("contention", 0.0),
                                                  preserver=PreserverConfig(**settings.get("preserver", {})),
                                                  closed_loop=ClosedLoopConfig(**settings.get("closed_loop", {}))))
            runners[name] = compiled[name] = step
    return runners, models, compiled


def _agree_samples(names: list[str], world_size: int, samples: dict, spans: dict, schedule: dict, traced: dict,
                   losses: dict) -> tuple[dict[str, list[list[float]]], dict[str, list[float]]]:
    """Across ranks, in place: a step's time is the slowest rank's (``samples``, ``schedule``), a retrace any
    rank's (``traced``), a loss the ranks' mean. Returns every rank's own step times and each block's wall time
    (last rank's end - first rank's start, ms)."""
    import torch
    import torch.distributed as dist

    def gathered(values: list[float]) -> torch.Tensor:
        """Every rank's ``values``, stacked: (rank, value)."""
        mine = torch.tensor(values, dtype=torch.float64)
        out = [torch.zeros_like(mine) for _ in range(world_size)]
        dist.all_gather(out, mine)
        return torch.stack(out)

    by_rank: dict[str, list[list[float]]] = {}  # every rank's own step times
    block_wall: dict[str, list[float]] = {}  # per block: (last rank's end - first rank's start) in ms
    for name in names:
        times = gathered(samples[name])
        by_rank[name] = times.tolist()
        samples[name] = times.max(dim=0).values.tolist()  # a step's time is the slowest rank's
        spans_by_rank = gathered(spans[name]).view(world_size, -1, 2)  # rank, block, (start, end)
        block_wall[name] = ((spans_by_rank[:, :, 1].max(dim=0).values
                             - spans_by_rank[:, :, 0].min(dim=0).values) * 1e3).tolist()
        times = torch.tensor(schedule[name], dtype=torch.float64)  # the same steps without the Preserver's time
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        schedule[name] = times.tolist()
        flags = torch.tensor(traced[name], dtype=torch.float64)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        traced[name] = [bool(f) for f in flags.tolist()]
        mean_losses = torch.tensor(losses[name], dtype=torch.float64)
        dist.all_reduce(mean_losses)
        losses[name] = (mean_losses / world_size).tolist()
    return by_rank, block_wall


def _compare_ddp_wfbp(models: dict[str, Any], other: str = "wfbp") -> tuple[bool | None, float | None, float | None]:
    """(identical, max |difference|, max relative difference) of DDP's and ``other``'s trained parameters (same
    batches, same number of steps), agreed across ranks; the relative difference of a tensor is its largest
    |difference| over DDP's largest |value|. (None, None, None) unless both ran."""
    import torch
    import torch.distributed as dist

    if "ddp" not in models or other not in models:
        return None, None, None
    pairs = [(a.detach(), b.detach()) for a, b in zip(models["ddp"].parameters(), models[other].parameters())
             if a.numel()]
    same = all(torch.equal(a, b) for a, b in pairs)
    differences = [float((a - b).abs().max()) for a, b in pairs]
    relative = [d / (float(a.abs().max()) or 1.0) for d, (a, _) in zip(differences, pairs)]
    flags = torch.tensor([0.0 if same else 1.0, max(differences, default=0.0), max(relative, default=0.0)],
                         dtype=torch.float64)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return not bool(flags[0].item()), float(flags[1].item()), float(flags[2].item())


def _measured_timeline(cfg: dict[str, Any], compiled: dict[str, Any], batch: Any, rank: int) -> dict | None:
    """With ``measured_timeline``: a measured timeline of ``deft``'s plan cycle on ``batch``; rank 0 returns the
    share of its time the main thread waited (``_wait_share``)."""
    import torch.distributed as dist

    if not (cfg.get("measured_timeline") and "deft" in compiled):
        return None
    from deft_compile.debug.artifacts import measured_timeline, plan_cycle

    step = compiled["deft"]
    target = Path(cfg["measured_timeline"]) if rank == 0 else Path(cfg["measured_timeline"]).with_name(
        f"measured_rank{rank}.json")
    args, kwargs = batch
    dist.barrier()
    measured_timeline(lambda: step(*args, **kwargs), target, steps=plan_cycle(step.plan), gantt=rank == 0)
    if step.pending:
        step.flush()
    return _wait_share(target) if rank == 0 else None


def _wait_share(trace: Path) -> dict[str, float] | None:
    """From a measured_timeline trace: the main thread's time in ``wait_tensor`` and the profiled span, ms."""
    try:
        data = json.loads(trace.read_text())
    except (OSError, ValueError):
        return None
    spans = [ev for ev in (data["traceEvents"] if isinstance(data, dict) else data) if ev.get("ph") == "X"]
    steps = [ev for ev in spans if str(ev.get("name", "")).startswith("deft_compile.step")]
    if not steps:
        return None
    pid, tid = steps[0]["pid"], steps[0]["tid"]
    waits = [ev for ev in spans if ev["pid"] == pid and ev["tid"] == tid and "wait_tensor" in str(ev.get("name", ""))]
    return {"steps": len(steps), "step_ms": sum(ev["dur"] for ev in steps) / 1000.0,
            "wait_tensor_ms": sum(ev["dur"] for ev in waits) / 1000.0}


# --------------------------------------------------------------------------- networks


def parse_rate(text: str | None) -> str | None:
    """``none``/``unshaped``/``0`` -> None (unshaped); otherwise a tc rate such as ``1gbit``, ``200mbit``."""
    if text is None or text.strip().lower() in ("none", "unshaped", "0", ""):
        return None
    value = text.strip().lower()
    digits = value.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = value[len(digits):]
    try:
        float(digits)
    except ValueError:
        raise ValueError(f"bandwidth {text!r}: use a tc rate like 1gbit, 500mbit, or 'none'") from None
    if unit in ("", "g", "gb", "gbps"):
        raise ValueError(f"bandwidth {text!r}: give the unit, e.g. {digits}gbit or {digits}mbit")
    if unit not in ("kbit", "mbit", "gbit", "tbit", "bit"):
        raise ValueError(f"bandwidth {text!r}: unit must be bit, kbit, mbit or gbit")
    return value


def shaping_available() -> str | None:
    """None when shaped namespaces can be made here, else the reason (no root, no ip/tc)."""
    from deft_compile.tools.netns import NetnsError, check_prerequisites

    try:
        check_prerequisites()
    except NetnsError as error:
        return str(error)
    return None


@contextlib.contextmanager
def network(bandwidth: str | None, links: int, workers: int, bandwidth2: str | None = None,
            prefix: str = "deftbench") -> Iterator[dict[str, Any]]:
    """Yield ``{"launch": run_local_workers kwargs, "extra_links": (...), "description": str, "namespaces": [...]}``.

    Unshaped single link: the machine's own loopback, no namespace. Otherwise a
    ``ShapedLoopback`` (``links == 1``) or ``TwoHostLinks`` (``links == 2``),
    deleted on exit whatever happens (the netns module also cleans up at
    interpreter exit and on SIGTERM/SIGHUP).
    """
    from deft_compile.tools.netns import ShapedLoopback, TwoHostLinks

    if links not in (1, 2):
        raise ValueError("links must be 1 or 2")
    if links == 1 and bandwidth is None:
        yield {"launch": {}, "extra_links": (), "namespaces": [],
               "description": "unshaped loopback (127.0.0.1, no namespace)"}
        return
    if links == 2:
        if workers != 2:
            raise ValueError("--links 2 supports exactly 2 workers (two hosts joined by two veth links)")
        rate2 = bandwidth2 if bandwidth2 is not None else bandwidth
        with TwoHostLinks(rates=(bandwidth, rate2), name_prefix=prefix) as hosts:
            yield {"launch": hosts.launch_kwargs(2), "extra_links": ("gloo:link2",), "namespaces": list(hosts.hosts),
                   "description": f"two hosts (namespaces {', '.join(hosts.hosts)}) joined by link1 "
                                  f"{bandwidth or 'unshaped'} and link2 {rate2 or 'unshaped'} (veth, tc tbf each end)"}
        return
    with ShapedLoopback(name_prefix=prefix, rate=bandwidth) as lo:
        yield {"launch": lo.launch_kwargs(workers), "extra_links": (), "namespaces": [lo.name],
               "description": f"loopback shaped to {bandwidth} (tc tbf, one qdisc shared by all workers) "
                              f"in namespace {lo.name}"}


# --------------------------------------------------------------------------- analysis


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``values`` with linear interpolation (numpy's default)."""
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _blocks(times: Sequence[float], retraced: Sequence[bool], block: int) -> list[list[float]]:
    """The timed steps per block, without the steps that captured a new graph (compile time, not step time)."""
    out = []
    for i in range(0, len(times), block):
        kept = [t for t, r in zip(times[i:i + block], retraced[i:i + block]) if not r]
        out.append(kept)
    return out


def slower_rank_block_ms(by_rank: dict[str, list[list[float]]], retraced: dict[str, list[bool]],
                         block: int) -> dict[str, float]:
    """Per variant: the median over blocks of the slower rank's mean step in the block (each rank's own times).

    ``step_ms`` averages the per-step maximum over ranks, which could charge a plan whose ranks do not meet at
    the end of every step twice for jitter (rank 0's step i and rank 1's step i are not the same stretch of
    time when the gradients are waited for in the next step). A rank's block mean is that rank's own time for
    the block per step. Measured: equal to ``step_ms`` within 2 % in accelerator emulation, 4-9 % lower for
    ``deft`` on the transformers in normal mode, where the wall clock (``wall_block_ms``) sided with ``step_ms``
    (within 0.8 %): a rank's own block misses the skew between ranks at the block's ends. A record, not a
    basis (docs/BENCH_CLI.md, "Timing")."""
    out: dict[str, float] = {}
    for name, ranks in by_rank.items():
        flags = retraced.get(name) or [False] * len(ranks[0])
        per_block = [_blocks(times, flags, block) for times in ranks]
        maxima = [max(statistics.fmean(rank[i]) for rank in per_block) for i in range(len(per_block[0]))
                  if all(rank[i] for rank in per_block)]
        if maxima:
            out[name] = statistics.median(maxima)
    return out


def wall_block_ms(walls: dict[str, list[float]], retraced: dict[str, list[bool]], block: int) -> dict[str, float]:
    """Per variant: the median over blocks of the block's wall-clock time per timed step, from the first rank's
    start to the last rank's end (``block_wall_ms``, one entry per block). No choice of per-step statistic: the
    time the block took. Blocks with a step that captured a graph are left out (its compile is in the span)."""
    out: dict[str, float] = {}
    for name, spans in walls.items():
        flags = retraced.get(name) or [False] * (len(spans) * block)
        kept = [ms / block for i, ms in enumerate(spans) if not any(flags[i * block:(i + 1) * block])]
        if kept:
            out[name] = statistics.median(kept)
    return out


def analyse(value: dict[str, Any], block: int) -> dict[str, dict[str, Any]]:
    """Rows per variant from rank 0's result (every number from this one run).

    ``step_ms``, the basis of every ratio, is the median over blocks of the block's mean step time: a
    mean, so a plan with an update period K (some steps communicate nothing) is charged for its
    communicating steps; a median over blocks, so one disturbed block does not decide. Steps that
    captured a new graph (the Preserver's re-plans) are left out and counted in ``retraced_steps``.
    """
    from deft_compile.planner.plan import Plan, Profile
    from deft_compile.planner.simulator import simulate

    samples = value["samples_ms"]
    retraced = value.get("retraced") or {n: [False] * len(s) for n, s in samples.items()}

    def per_block(times_by_name: dict[str, list[float]]) -> tuple[dict[str, list[list[float]]], dict[str, float]]:
        """Non-empty blocks per variant, and the median over them of the block's mean step."""
        kept = {n: [b for b in _blocks(s, retraced[n], block) if b] for n, s in times_by_name.items()}
        return kept, {n: statistics.median([statistics.fmean(b) for b in bl]) for n, bl in kept.items() if bl}

    blocks, step = per_block(samples)
    _, schedule_step = per_block(value.get("schedule_ms") or {})
    slower_rank = slower_rank_block_ms(value.get("samples_by_rank_ms") or {}, retraced, block)
    wall = wall_block_ms(value.get("block_wall_ms") or {}, retraced, block)
    floor, ddp = step.get("floor"), step.get("ddp")
    # variants train different numbers of steps (a closed loop's trials lengthen its warm-up); every variant draws
    # the same batches in the same order, so losses compare like with like at the step count all of them reached
    equal_steps = min((len(losses) for losses in value["losses"].values()), default=0)
    rows: dict[str, dict[str, Any]] = {}
    for name, times in samples.items():
        kept = [t for b in blocks[name] for t in b]
        loss_tail = value["losses"][name][-FINAL_LOSS_STEPS:]
        equal_tail = value["losses"][name][max(0, equal_steps - FINAL_LOSS_STEPS):equal_steps]
        paired = None
        if "ddp" in blocks and name in step:
            ratios = [statistics.fmean(a) / statistics.fmean(b) for a, b in zip(blocks[name], blocks["ddp"]) if a and b]
            paired = statistics.median(ratios) if ratios else None
        row: dict[str, Any] = {
            "step_ms": step.get(name),
            "median_ms": statistics.median(kept) if kept else None,
            "mean_ms": statistics.fmean(kept) if kept else None,
            "p10_ms": quantile(kept, 0.1) if kept else None,
            "p90_ms": quantile(kept, 0.9) if kept else None,
            "vs_floor": step[name] / floor if floor and name in step else None,
            "vs_ddp": step[name] / ddp if ddp and name in step else None,
            "speedup_vs_ddp": ddp / step[name] if ddp and name in step else None,
            "paired_vs_ddp": paired,
            "exposed_comm_ms": step[name] - floor if floor is not None and name in step else None,
            "final_loss": statistics.fmean(loss_tail) if loss_tail else None,
            "steps_trained": len(value["losses"][name]),
            "equal_steps": equal_steps,
            "loss_at_equal_steps": statistics.fmean(equal_tail) if equal_tail else None,
            "warmup_s": value["warmup_s"][name],
            # wall-clock from the variant's first call (warm-up with its compiles, planning and trials, then the timed
            # steps), and the compile and planning seconds inside it
            "first_call_s": (value.get("first_call_s") or {}).get(name),
            "compile_s": (value.get("overheads") or {}).get(name, {}).get("compile_seconds"),
            "planning_s": (value.get("overheads") or {}).get(name, {}).get("planning_seconds"),
            "timed_steps": len(times),
            "retraced_steps": sum(1 for r in retraced[name] if r),
            # the same statistic without the Preserver's own measurements (probes, copies, replays): the time of
            # the communication schedule, which is what the simulator predicts
            "schedule_ms": schedule_step.get(name),
            "preserver_ms": (step[name] - schedule_step[name]) if name in step and name in schedule_step else None,
            # each rank's own block mean, the slower rank's, median over blocks (a record: it misses the skew
            # between ranks at a block's ends, see ``slower_rank_block_ms``)
            "slower_rank_ms": slower_rank.get(name),
            # the block's wall-clock time per step, first rank's start to last rank's end, median over blocks
            "wall_block_ms": wall.get(name),
        }
        if name in value.get("plans", {}):
            plan = Plan.from_json(value["plans"][name])
            profile = Profile.from_json(value["profiles"][name])
            row.update(items=len(plan.items), delayed_items=sum(1 for i in plan.items if i.delay == 1),
                       max_period=max((i.period for i in plan.items), default=1), plan_hash=plan.hash(),
                       plan_changes=len(value["plan_history"][name]) - 1, traces=value["trace_counts"][name],
                       closed_loop_ms=value.get("closed_loop_ms", {}).get(name))
            if profile.forward_ms + profile.backward_ms > 0:  # wfbp plans from sizes only: nothing to simulate
                timeline = simulate(profile, plan, record=False)
                row.update(predicted_ms=timeline.iteration_ms, predicted_exposed_ms=timeline.exposed_comm_ms)
        rows[name] = row
    return rows


def simulated_timeline_png(value: dict[str, Any], policy: str, path: str | os.PathLike) -> str | None:
    """Gantt of ``policy``'s plan simulated on its measured profile (``gantt_png(simulate(profile, plan))``)."""
    from deft_compile.debug.artifacts import gantt_png, gantt_title, plan_cycle
    from deft_compile.planner.plan import Plan, Profile
    from deft_compile.planner.simulator import simulate

    if policy not in value.get("plans", {}):
        return None
    plan, profile = Plan.from_json(value["plans"][policy]), Profile.from_json(value["profiles"][policy])
    if profile.forward_ms + profile.backward_ms <= 0:
        return None
    timeline = simulate(profile, plan)
    drawn = gantt_png(timeline, path, "simulated from the measured profile - " + gantt_title(profile, plan, timeline),
                      plan=plan, steps=max(3, plan_cycle(plan)))  # a whole update-period cycle
    return str(path) if drawn is not None else None


# --------------------------------------------------------------------------- driver


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Turn SIGTERM into KeyboardInterrupt while the bench runs, so ``with`` blocks delete their namespaces and
    the interpreter exits normally (multiprocessing's atexit then terminates the daemon workers). Without it a
    SIGTERM kills the parent at once and leaves its workers running. Main thread only; restored afterwards."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_config(model: str, bandwidth: str | None, *, policies: Sequence[str], workers: int = 2, links: int = 1,
               bandwidth2: str | None = None, steps: int = 20, warmup: int = 3, rounds: int = 4,
               batch: int | None = None, progress: bool = True, timeout_s: float = 900.0,
               include_ddp: bool = True, measured_timeline: str | None = None, prefix: str = "deftbench",
               label: str | None = None, network_info: dict[str, Any] | None = None,
               compiler: str | None = None, contention: float | None = 0.0) -> dict[str, Any]:
    """One launch: every variant of one model on one network. Returns the run's record (rows, samples, plans).

    ``compiler`` runs the compiled variants' graphs (``DeftConfig.compiler``; None: the library's default, what a
    user gets). Every row counts the wall-clock from a variant's first call (``first_call_s``: its warm-up, compiles,
    planning and closed-loop trials, then its timed steps) and reports the compile and planning seconds apart.
    ``contention`` is the compiled variants' ``DeftConfig.contention`` (None: measured).
    """
    from deft_compile.tools.launcher import run_local_workers

    rounds = max(1, min(rounds, steps))
    block = max(1, math.ceil(steps / rounds))
    variants = ["floor"] + (["ddp"] if include_ddp else []) + list(policies)
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        net = network_info or stack.enter_context(network(bandwidth, links, workers, bandwidth2, prefix))
        cfg = {"model": model, "batch": batch, "variants": variants, "warmup": warmup, "rounds": rounds,
               "block": block, "progress": progress, "extra_links": list(net["extra_links"]), "batch_pool": 8,
               "link_repeats": 3, "measured_timeline": measured_timeline, "compiler": compiler or default_compiler(),
               "contention": contention,
               "label": label or f"{model} @ {bandwidth or 'unshaped'}"}
        results = run_local_workers(bench_worker, workers, (cfg,), timeout_s=timeout_s, collective_timeout_s=300.0,
                                    **net["launch"])
    elapsed = time.perf_counter() - started
    value = results[0].value
    rows = analyse(value, block)
    return {
        "model": model, "bandwidth": bandwidth, "bandwidth2": (bandwidth2 or bandwidth) if links == 2 else None,
        "links": links, "workers": workers, "network": net["description"], "namespaces": net["namespaces"],
        "params": value["params"], "gradient_bytes": value["gradient_bytes"], "batch_per_worker": value["batch"],
        "allreduce_all_ms": value["allreduce_all_ms"],
        "coverage_rate": value["allreduce_all_ms"] / rows["floor"]["step_ms"] if rows["floor"]["step_ms"] else None,
        "steps": {"warmup": warmup, "rounds": rounds, "block": block, "timed": rounds * block},
        "retraced": value["retraced"],
        "identical_ddp_wfbp": value["identical_ddp_wfbp"], "max_abs_diff_ddp_wfbp": value["max_abs_diff_ddp_wfbp"],
        "max_rel_diff_ddp_wfbp": value.get("max_rel_diff_ddp_wfbp"), "wfbp_compiler": value.get("wfbp_compiler"),
        "max_rel_diff_ddp_compiled": value.get("max_rel_diff_ddp_compiled"),
        "rows": rows, "samples_ms": value["samples_ms"], "samples_by_rank_ms": value.get("samples_by_rank_ms"),
        "block_wall_ms": value.get("block_wall_ms"),
        "schedule_ms": value.get("schedule_ms"),
        "losses": value["losses"], "plans": value["plans"], "profiles": value["profiles"],
        "plan_history": value["plan_history"], "preserver": value["preserver"],
        "preserver_dismissed": value["preserver_dismissed"],
        "measured_timeline": value.get("measured_timeline"), "wall_s": elapsed,
    }


def rate_for(gradient_bytes: int, floor_ms: float, coverage: float) -> str:
    """A first guess of the shaped rate at which all-reducing ``gradient_bytes`` over 2 workers takes
    ``coverage x floor_ms``: a 2-worker ring sends the gradient's bytes once per worker, and both workers'
    traffic crosses the one shaped loopback qdisc (docs/LINKS.md), so twice the bytes go through it.
    ``calibrate_rate`` corrects the guess with measurements."""
    mbit = 2 * gradient_bytes * 8 / (coverage * floor_ms / 1e3) / 1e6
    return f"{max(1, int(round(mbit)))}mbit"


def calibrate_rate(model: str, target: float, common: dict[str, Any], *, tries: int = 3,
                   log: Callable[[str], None] = print) -> tuple[str, float | None, dict[str, Any]]:
    """A ``tc`` rate at which DDP's coverage rate (all-reduce of all gradients / no-communication floor step,
    as ``run_config`` measures them) is within 15 % of ``target``. One unshaped launch gives the floor and the
    gradient bytes for ``rate_for``'s guess; then shape, measure, and rescale by measured / target, at most
    ``tries`` times (protocol overhead and the shaper's burst put the first guess off by up to 2x). The rate
    returned is always one that was measured. Returns (rate, its measured coverage rate, the unshaped run)."""
    probe_options = {**common, "policies": [], "include_ddp": False}
    unshaped = run_config(model, None, **probe_options)
    rate = rate_for(unshaped["gradient_bytes"], unshaped["rows"]["floor"]["step_ms"], target)
    measured = None
    for attempt in range(tries):
        measured = run_config(model, rate, **probe_options).get("coverage_rate")
        log(f"{model}: {rate} gives coverage rate {measured if measured is None else round(measured, 2)} "
            f"(target {target:g})")
        if not measured or abs(measured / target - 1) <= 0.15 or attempt == tries - 1:
            break
        rate = f"{max(1, int(round(int(rate[:-4]) * measured / target)))}mbit"
    return rate, measured, unshaped


def format_table(runs: Sequence[dict[str, Any]]) -> str:
    """The results table: one line per (model, network, variant)."""
    header = (f"{'model':<12}{'network':<14}{'variant':<14}{'step ms':>9}{'median':>8}{'vs floor':>9}{'vs DDP':>8}"
              f"{'paired':>8}{'exposed ms':>11}{'loss @ N':>11}{'sim ms':>8}{'retraced':>9}{'wall s':>8}"
              f"{'compile s':>10}")
    lines = [header, "-" * len(header)]
    for run in runs:
        net = (run["bandwidth"] or "unshaped") + (f"+{run['bandwidth2'] or 'unsh.'}" if run["links"] == 2 else "")
        for name, row in run["rows"].items():
            def fmt(key: str, pattern: str) -> str:
                return pattern.format(row[key]) if row.get(key) is not None else "-"

            lines.append(f"{run['model']:<12}{net:<14}{name:<14}{fmt('step_ms', '{:.1f}'):>9}"
                         f"{fmt('median_ms', '{:.1f}'):>8}{fmt('vs_floor', '{:.2f}x'):>9}"
                         f"{fmt('vs_ddp', '{:.2f}x'):>8}{fmt('paired_vs_ddp', '{:.2f}x'):>8}"
                         f"{fmt('exposed_comm_ms', '{:.1f}'):>11}{fmt('loss_at_equal_steps', '{:.4f}'):>11}"
                         f"{fmt('predicted_ms', '{:.1f}'):>8}{row.get('retraced_steps', 0):>9}"
                         f"{fmt('first_call_s', '{:.1f}'):>8}{fmt('compile_s', '{:.1f}'):>10}")
    return "\n".join(lines)


def plot(runs: Sequence[dict[str, Any]], path: str | os.PathLike) -> str | None:
    """Grouped bars: median step time / floor per variant, one group per (model, network)."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install 'deft-compile[plot]')", file=sys.stderr)
        return None
    variants: list[str] = []
    for run in runs:
        variants += [v for v in run["rows"] if v not in variants]
    groups = [f"{r['model']}\n{r['bandwidth'] or 'unshaped'}" + (f"+{r['bandwidth2'] or 'unshaped'}" if r["links"] == 2
                                                                  else "") for r in runs]
    width = 0.8 / max(1, len(variants))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(runs) * max(1, len(variants)) / 3), 4.2))
    try:
        for k, variant in enumerate(variants):
            xs, ys = [], []
            for g, run in enumerate(runs):
                row = run["rows"].get(variant)
                if row and row.get("vs_floor") is not None:
                    xs.append(g + (k - (len(variants) - 1) / 2) * width)
                    ys.append(row["vs_floor"])
            ax.bar(xs, ys, width, label=variant)
            for x, y in zip(xs, ys):
                ax.text(x, y, f"{y:.2f}", ha="center", va="bottom", fontsize=7)
        ax.axhline(1.0, color="black", linewidth=0.6, linestyle="--")
        ax.set_xticks(range(len(runs)), groups, fontsize=8)
        ax.set_ylabel("step time / no-communication floor\n(median of block means, same run)")
        ax.set_title(f"deft-compile bench: {runs[0]['workers']} workers, ratios within each run")
        ax.legend(fontsize=8, ncol=min(6, len(variants)), loc="upper center", bbox_to_anchor=(0.5, -0.14),
                  frameon=False)
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110, bbox_inches="tight")
    finally:
        plt.close(fig)
    return str(path)


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)


def _run_grid(args: argparse.Namespace, models: list[str], bandwidths: list[str | None], bandwidth2: str | None,
              policies: list[str], infos: dict[str, Any], plot_path: Path | None, runs: list[dict[str, Any]]) -> None:
    """Every (model, bandwidth) launch in turn; appends to ``runs`` as each finishes (kept if interrupted)."""
    for model in models:
        for bandwidth in bandwidths:
            run = run_config(model, bandwidth, policies=policies, workers=args.workers, links=args.links,
                             bandwidth2=bandwidth2, steps=args.steps, warmup=args.warmup, rounds=args.rounds,
                             batch=args.batch, progress=not args.no_progress, timeout_s=args.timeout,
                             compiler=args.compiler, contention=None if args.measure_contention else 0.0)
            run["model_info"] = infos[model]
            if plot_path is not None and "deft" in policies:
                png = plot_path.with_name(f"{plot_path.stem}_{_slug(model)}_{_slug(bandwidth or 'unshaped')}"
                                          f"{'_2links' if args.links == 2 else ''}_deft_timeline.png")
                run["deft_timeline_png"] = simulated_timeline_png(run, "deft", png)
            runs.append(run)
            print(f"\n{run['model']} on {run['network']}: all-reduce of all gradients "
                  f"{run['allreduce_all_ms']:.1f} ms, coverage rate {run['coverage_rate']:.2f}, "
                  f"wall {run['wall_s']:.0f} s" + (f"; DDP and wfbp parameters bit-identical: {run['identical_ddp_wfbp']} "
                                                  f"(max |diff| {run['max_abs_diff_ddp_wfbp']:.2g})"
                                                  if run["identical_ddp_wfbp"] is not None else ""))
            print(format_table([run]))


def run_bench(args: argparse.Namespace) -> int:
    """``deft-compile bench`` (``--time-to-accuracy`` is dispatched by ``deft_compile.tools.cli``)."""
    # --steps, --bandwidth and --timeout default to None so --time-to-accuracy can tell "not given"; here:
    args.steps = 20 if args.steps is None else args.steps
    args.bandwidth = "1gbit" if args.bandwidth is None else args.bandwidth
    args.timeout = 900.0 if args.timeout is None else args.timeout
    from deft_compile.tools.bench_models import describe, resolve_model
    from deft_compile.tools.netns import created_namespaces

    models = [m.strip() for m in args.models.split(",") if m.strip()]
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICY_CHOICES + BASELINE_CHOICES]
    if unknown:
        print(f"unknown policies {unknown}; choose from {', '.join(POLICY_CHOICES + BASELINE_CHOICES)}",
              file=sys.stderr)
        return 2
    try:
        bandwidths = [parse_rate(b) for b in args.bandwidth.split(",")]
        bandwidth2 = parse_rate(args.bandwidth2) if args.bandwidth2 else None
        infos = {m: describe(resolve_model(m)) for m in models}
    except ValueError as error:
        print(f"deft-compile bench: {error}", file=sys.stderr)
        return 2
    if args.links == 2 and args.workers != 2:
        print("deft-compile bench: --links 2 needs --workers 2", file=sys.stderr)
        return 2
    needs_root = args.links == 2 or any(b is not None for b in bandwidths)
    if needs_root:
        reason = shaping_available()
        if reason is not None:
            print(f"deft-compile bench: {reason}\n  (run as root with iproute2, or use --bandwidth none)", file=sys.stderr)
            return 2
    if args.workers > (os.cpu_count() or 1):
        print(f"note: {args.workers} workers on {os.cpu_count()} CPUs: compute is oversubscribed", file=sys.stderr)
    for name, info in infos.items():
        print(f"model {name}: {info['description']}; {info['params'] / 1e6:.2f} M parameters, "
              f"{info['gradient_bytes'] / MiB:.1f} MiB of gradients")
    runs: list[dict[str, Any]] = []
    started = time.perf_counter()
    plot_path = Path(args.plot) if args.plot else None
    try:
        with sigterm_as_interrupt():
            _run_grid(args, models, bandwidths, bandwidth2, policies, infos, plot_path, runs)
    except KeyboardInterrupt:
        print(f"\ninterrupted; namespaces left by this run: {created_namespaces() or 'none'}", file=sys.stderr)
        _write(args, runs, time.perf_counter() - started, interrupted=True)
        return 130
    elapsed = time.perf_counter() - started
    if len(runs) > 1:
        print("\nall runs (ratios are within each run; absolute ms depend on the machine and its load):")
        print(format_table(runs))
    print(STAT_NOTE)
    _write(args, runs, elapsed)
    if plot_path is not None and runs:
        if plot(runs, plot_path):
            print(f"plot: {plot_path}")
        for run in runs:
            if run.get("deft_timeline_png"):
                print(f"deft timeline (simulated): {run['deft_timeline_png']}")
    print(f"wall time {elapsed:.0f} s; namespaces left: {created_namespaces() or 'none'}")
    return 0


def _write(args: argparse.Namespace, runs: list[dict[str, Any]], elapsed: float, interrupted: bool = False) -> None:
    if not args.json:
        return
    import torch
    from deft_compile.tools.provenance import provenance, command_line

    payload = {"provenance": provenance(),
               "command": command_line() if sys.argv[1:2] == ["bench"] else None,
               "config": {k: v for k, v in vars(args).items() if k != "func"},
               "host": {"cpus": os.cpu_count(), "torch": torch.__version__, "load_avg": os.getloadavg()},
               "wall_s": elapsed, "interrupted": interrupted, "runs": runs}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(payload, indent=1))
    print(f"results: {args.json}")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench", help="benchmark policies against torch DDP and the no-communication floor on shaped links",
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="models: " + ", ".join(MODEL_NAMES) + ", or module:function / path.py:function returning "
               "(model, optimizer_factory, batch_factory, loss_fn); see deft_compile/tools/bench_models.py")
    parser.add_argument("--models", "--model", default=",".join(DEFAULT_MODELS),
                        help=f"comma-separated models (default {','.join(DEFAULT_MODELS)})")
    parser.add_argument("--policies", default=",".join(DEFAULT_POLICIES),
                        help=f"comma-separated deft_compile policies from {','.join(POLICY_CHOICES)} "
                             f"(default {','.join(DEFAULT_POLICIES)}); torch DDP and the floor always run; "
                             f"baselines: {COMPILED_DDP} (torch.compile(DDP)), {OVERLAP_BOUND} (the floor's step with "
                             f"the whole gradient all-reduced beside it: the best hiding communication can do here)")
    parser.add_argument("--workers", type=int, default=2, help="local workers, one intra-op thread each (default 2)")
    parser.add_argument("--bandwidth", default=None,
                        help="comma-separated tc rates (1gbit, 200mbit) or 'none' for the unshaped loopback "
                             "(default 1gbit; shaping needs root and iproute2; with --time-to-accuracy one rate, "
                             "default: calibrated so that DDP's coverage rate is --coverage)")
    parser.add_argument("--bandwidth2", default=None, help="rate of link2 with --links 2 (default: --bandwidth)")
    parser.add_argument("--links", type=int, choices=(1, 2), default=1,
                        help="1: shaped loopback shared by all workers; 2: two hosts joined by two shaped veth links, "
                             "deft uses both (2 workers)")
    parser.add_argument("--steps", type=int, default=None,
                        help="timed steps per variant (default 20; with --time-to-accuracy: training steps, default 300)")
    parser.add_argument("--warmup", type=int, default=3, help="discarded steps per variant (default 3)")
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds the timed steps are split into")
    parser.add_argument("--batch", type=int, default=None, help="batch per worker (default: the model's)")
    parser.add_argument("--json", help="write every number (samples, plans, profiles) to this file")
    parser.add_argument("--plot", help="write a bar chart (step time / floor) to this PNG, and deft's simulated "
                                       "timeline next to it")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds before one launch's workers are killed (default 900; --time-to-accuracy: 6 h)")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--measure-contention", action="store_true",
                        help="the compiled variants measure Profile.contention on their first step "
                             "(DeftConfig(contention=None)); default 0, an accelerator's")
    parser.add_argument("--compiler", choices=COMPILERS, default=None,
                        help="what runs the compiled variants' graphs (DeftConfig.compiler; default: the library's, "
                             "$DEFT_COMPILER or inductor; aten runs the kernels eager DDP runs, so ratios measure the "
                             "schedule alone)")
    tta = parser.add_argument_group(
        "time to accuracy",
        "--time-to-accuracy trains a GPT-2 (transformers config, bytes) on the stdlib's sources with DDP, deft, deft "
        "without the Preserver and deft without update periods, same weights and batches, and reports validation "
        "loss against wall-clock time and the time each needs to reach DDP's final validation loss "
        "(docs/TIME_TO_ACCURACY.md). Uses --steps, --bandwidth, --workers, --batch, --compiler, --json, --plot "
        "(PNG name stem: <stem>_time.png, <stem>_steps.png), --timeout, --no-progress; ignores the others.")
    tta.add_argument("--time-to-accuracy", action="store_true", help="run the time-to-accuracy benchmark instead (from a checkout: benchmarks/tta.py)")
    tta.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="seeds, one launch each (default 0 1)")
    tta.add_argument("--size", choices=("tiny", "small", "medium"), default="small",
                     help="GPT-2 size: tiny 0.1 M (tests), small 6.1 M (default), medium 10 M parameters")
    tta.add_argument("--eval-every", type=int, default=None, help="steps between validation losses (default 25)")
    tta.add_argument("--chunk", type=int, default=None,
                     help="steps a variant trains before the next runs, round-robin (default 25)")
    tta.add_argument("--coverage", type=float, default=1.0,
                     help="DDP coverage rate the calibrated link aims at (default 1.0)")
    parser.set_defaults(func=run_bench)
