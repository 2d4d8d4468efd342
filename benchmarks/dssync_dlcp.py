"""DS-Sync and DLCP beside DDP and DeFT, 4 gloo workers: accuracy on digits, speed on a shaped link.

    python benchmarks/dssync_dlcp.py [--parts digits shaped] [--seeds 0 1 2] [--out docs/img]   # shaped: root
    python benchmarks/dssync_dlcp.py --quick --out /tmp/dd                                     # seconds, for tests

Two parts, each in one launch of 4 local gloo workers (one intra-op thread each,
``torch.set_num_threads(1)``; the machine has 2 cores, so 4 workers are
oversubscribed and every timing is a ratio measured in the same run):

* ``digits`` (convergence + time/step on the machine's unshaped loopback): the
  digits task of ``benchmarks/convergence.py`` (``DigitsTask``, ``DigitsCNN``,
  SGD momentum 0.9, lr 0.05). Every variant starts from the same initial weights
  (``torch.manual_seed(seed)``) and sees the same per-rank batches (one seeded
  global batch of 4·B samples per step, rank r takes its B). The variants train
  *interleaved* in the same processes: blocks of ``--block`` steps per variant
  in a rotated order, so their step times are taken under the same load.

  - ``ddp``     torch ``DistributedDataParallel`` (the convergence run's bucket caps);
  - ``deft``    ``policy="deft"`` planned on the convergence run's synthetic slow-link profile
                (``slow_link_profile``, comm/compute 0.7, ``allow_period=False``, Preserver off:
                the delays stay in the plan all run, as in docs/CONVERGENCE.md's ``deft-delay``);
  - ``deft-K``  the same with update periods allowed (comm/compute 2.0: CONVERGENCE.md's ``deft-delay-K``);
  - ``dssync``  ``policy="dssync"``, ``group_size=2`` of 4, regrouped every step (``shuffle_every=1``);
  - ``dssync-params``  the same with ``average="parameters"``: local steps, then the pair averages its
                parameters (model averaging) instead of its gradients;
  - ``dlcp``    ``policy="dlcp"`` planned on the same kind of synthetic profile with a deadline of
                ``--dlcp-deadline`` × the profile's time for an all-reduce of every gradient, so it
                drops chunks (``--dlcp-max-loss`` bounds the dropped squared-gradient mass per step).

  After the last step every compiled step is ``flush()``-ed; the script then checks
  across all ranks that the replicas are bit-identical (for ``dssync`` it also
  records how far apart they were before the flush) and rank 0 evaluates the final
  model on the fixed 20 % test split. Intermediate evaluations (curves) use rank 0's
  replica, which for ``dssync`` is one replica of its group before any global average;
  for ``dssync`` every evaluation also records how far the replicas are apart and the
  test accuracy of their average (what ``flush()`` would give at that step).
  Time per step: the slower rank's, mean over the steps of the run (the first 2 and
  steps that captured a new graph left out), quoted as a ratio to DDP's.

* ``shaped`` (speed, needs root + iproute2): the 4 workers in one private network
  namespace whose ``lo`` is shaped with ``tc tbf`` (``ShapedLoopback``; a shared medium:
  every byte of every worker crosses one qdisc), one launch per ``--rates`` entry. The
  VGG-style CNN of ``benchmarks/policies.py`` on a fixed random batch per rank, SGD
  momentum. Variants in the same processes, interleaved in rotated blocks (a barrier and
  one untimed step start each block):

  - ``floor``   the compiled step on a one-rank group: no communication;
  - ``ddp``     torch DDP;
  - ``deft``    measured profile, ``allow_period=False``, Preserver off;
  - ``deft-K``  the same with update periods allowed (the solver's default);
  - ``dssync``  as above;
  - ``dlcp``    planned on ``deft``'s measured profile, deadline ``--dlcp-deadline`` × its
                predicted all-reduce of every gradient.

  A block is whole cycles of the variant's plan (update periods K), and warm-up runs until
  a whole cycle captures no new graph. Reported: time per step (slower rank) = median over
  rounds of the block mean; ratios to DDP and to the floor; the paired ratio (median over
  rounds of the block ratio to DDP's block of that round); DLCP's chunks sent and dropped
  mass; the link's all-reduce times (whole world, and DS-Sync's two pairs at once). The
  namespace is deleted at the end, also on Ctrl-C and SIGTERM.

Outputs (``--out``, default ``docs/img``): ``dssync_dlcp.json`` (every number, the
load average before/after each part) and ``dssync_dlcp.png`` (matplotlib, if installed).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from convergence import ROOT, VARIANTS as CONVERGENCE_VARIANTS, DigitsTask, build_runner, slow_link_profile  # noqa: E402

from deft_compile import DeftConfig, deft_compile  # noqa: E402
from deft_compile.tools.bench import eager_step, quantile  # noqa: E402
from deft_compile.tools.launcher import run_local_workers  # noqa: E402
from deft_compile.preserver import PreserverConfig  # noqa: E402
from deft_compile.planner.solvers import dssync_partition  # noqa: E402

WORLD = 4
DIGITS_VARIANTS = ("ddp", "deft", "deft-K", "dssync", "dssync-params", "dlcp")
DEFT_DIGITS = {"deft": "deft-delay", "deft-K": "deft-delay-K"}  # benchmarks/convergence.py VARIANTS
SHAPED_VARIANTS = ("floor", "ddp", "deft", "deft-K", "dssync", "dssync-params", "dlcp")


# --------------------------------------------------------------------------- shared helpers (in the workers)


def _flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _replica_spread(model: nn.Module, world_size: int) -> tuple[bool, float]:
    """(every rank holds bit-identical parameters, largest |difference| to rank 0's); collective."""
    flat = _flat_params(model)
    gathered = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(gathered, flat)
    identical = all(torch.equal(g, gathered[0]) for g in gathered)
    spread = max(float((g - gathered[0]).abs().max()) for g in gathered)
    return identical, spread


def _slower_rank(samples: list[float]) -> list[float]:
    times = torch.tensor(samples, dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return times.tolist()


def _rotated(names: list[str], index: int) -> list[str]:
    k = index % len(names)
    return names[k:] + names[:k]


def _dssync_warmup(world_size: int, group_size: int, seed: int, shuffle_every: int, limit: int = 64) -> int:
    """Steps until every grouping DS-Sync can draw has appeared (a new group means a new gloo group and a new graph)."""
    groups = world_size // group_size
    possible = math.factorial(world_size) // (math.factorial(group_size) ** groups * math.factorial(groups))
    seen: set = set()
    for t in range(limit):
        seen.add(tuple(dssync_partition(world_size, group_size, t, seed=seed, shuffle_every=shuffle_every)))
        if len(seen) >= possible:
            return t + 1
    return limit


def dlcp_max_loss(name: str) -> float:
    """``dlcp-0.1`` -> 0.1: DLCP variants are named after their bound on the dropped mass."""
    return float(name.split("-", 1)[1])


def expand_variants(variants: list[str], max_losses: list[float]) -> list[str]:
    """``dlcp`` stands for one variant per ``--dlcp-max-loss`` value."""
    out = []
    for name in variants:
        out += [f"dlcp-{m:g}" for m in max_losses] if name == "dlcp" else [name]
    return out


def _deft_plan_facts(step) -> dict[str, Any]:
    """How much of deft's plan is delayed and periodic (by bytes), and its largest K."""
    items, profile = step.plan.items, step.profile
    total = sum(i.nbytes(profile) for i in items)
    return {"items": len(items), "delayed_items": sum(1 for i in items if i.delay),
            "delayed_bytes_share": sum(i.nbytes(profile) for i in items if i.delay) / total,
            "periodic_items": sum(1 for i in items if i.period > 1),
            "periodic_bytes_share": sum(i.nbytes(profile) for i in items if i.period > 1) / total,
            "max_period": max((i.period for i in items), default=1)}


_deft_plan_facts.keys = ("items", "delayed_items", "delayed_bytes_share", "periodic_items", "periodic_bytes_share",
                         "max_period")


def _plan_line(facts: dict[str, Any]) -> str:
    return (f"{facts['delayed_items']}/{facts['items']} items delayed ({facts['delayed_bytes_share']:.0%} of the bytes), "
            f"{facts['periodic_items']} with a period ({facts['periodic_bytes_share']:.0%} of the bytes, K <= {facts['max_period']})")


def _dssync_probe(model: nn.Module, world_size: int, task: Any, rank: int, step: int) -> dict[str, Any] | None:
    """How far DS-Sync's replicas are apart, and (rank 0) the test accuracy of their average; collective."""
    flat = _flat_params(model)
    mean = flat.clone()
    dist.all_reduce(mean)
    mean /= world_size
    spread = torch.tensor([float((flat - mean).norm() / mean.norm()), float((flat - mean).abs().max())],
                          dtype=torch.float64)
    dist.all_reduce(spread, op=dist.ReduceOp.MAX)
    if rank != 0:
        return None
    averaged = copy.deepcopy(model)
    torch.nn.utils.vector_to_parameters(mean, averaged.parameters())
    return {"step": step, "relative_distance_to_mean": float(spread[0]), "max_abs_to_mean": float(spread[1]),
            "averaged": task.evaluate(averaged), "rank0": task.evaluate(model)}


def _dlcp_stats(step) -> list[float] | None:
    """[chunks sent, dropped mass fraction] of DLCP's single item this step (None without a deadline)."""
    stats = step.last_stats
    if not stats:
        return None
    if len(stats) != 1:
        raise RuntimeError(f"expected one DLCP item (one dtype), got {sorted(stats)}")
    return list(next(iter(stats.values())))


# --------------------------------------------------------------------------- part 1: digits (worker)


def digits_worker(rank: int, world_size: int, cfg: dict[str, Any]) -> dict[str, Any]:
    task = DigitsTask(batch_per_rank=cfg["batch"])
    seed, steps, block = cfg["seed"], cfg["steps"], cfg["block"]
    batches = task.batches(seed, rank, world_size, steps)
    models, optimizers, runners, steps_of = {}, {}, {}, {}
    for name in cfg["variants"]:
        torch.manual_seed(seed)  # the same initial weights for every variant
        model = task.make_model()
        optimizer = task.make_optimizer(model)
        models[name], optimizers[name] = model, optimizer
        if name == "ddp":
            runners[name], _ = build_runner(task, None, model, optimizer, batches[0], world_size)
            continue
        if name in DEFT_DIGITS:
            run, step = build_runner(task, CONVERGENCE_VARIANTS[DEFT_DIGITS[name]], model, optimizer, batches[0],
                                     world_size, PreserverConfig(enabled=False))
        elif name in ("dssync", "dssync-params"):
            options = {"group_size": cfg["group_size"], "shuffle_every": cfg["shuffle_every"], "seed": seed,
                       "average": "parameters" if name == "dssync-params" else "gradients"}
            step = deft_compile(model, optimizer, task.loss_fn, policy="dssync",
                                config=DeftConfig(plan_options=options, **task.bucket_caps))
        elif name.startswith("dlcp-"):
            scratch = copy.deepcopy(model)
            profile = slow_link_profile(scratch, task.make_optimizer(scratch), task.loss_fn, batches[0], world_size,
                                        cfg["dlcp_profile_comm_over_compute"])
            link = profile.links[0]
            deadline = cfg["dlcp_deadline"] * link.cost(profile.total_bytes)
            options = {"deadline_ms": deadline, "max_loss": dlcp_max_loss(name), "chunk_bytes": cfg["dlcp_chunk_bytes"]}
            step = deft_compile(model, optimizer, task.loss_fn, policy="dlcp", profile=profile,
                                config=DeftConfig(plan_options=options, **task.bucket_caps))
        else:
            raise ValueError(f"unknown digits variant {name!r}")
        runners[name] = steps_of[name] = step

    names = list(runners)
    losses = {n: [] for n in names}
    times = {n: [] for n in names}
    traced = {n: [] for n in names}
    evals: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    dlcp_stats: dict[str, list[list[float] | None]] = {n: [] for n in names if n.startswith("dlcp-")}
    block_load: list[float] = []
    dssync_track: list[dict[str, Any]] = []  # replica spread and the averaged model's accuracy at each evaluation
    for b, start in enumerate(range(0, steps, block)):
        end = min(start + block, steps)
        for name in _rotated(names, b):
            run, step = runners[name], steps_of.get(name)
            dist.barrier()
            for t in range(start, end):
                inputs, targets = batches[t]
                before = step.trace_count if step is not None else 0
                started = time.perf_counter()
                loss = run(inputs, targets)
                elapsed = (time.perf_counter() - started) * 1e3
                losses[name].append(float(loss))
                times[name].append(elapsed)
                traced[name].append(step is not None and step.trace_count != before)
                if name in dlcp_stats:
                    dlcp_stats[name].append(_dlcp_stats(step))
        if "dssync" in models and end % cfg["eval_every"] == 0:
            probe = _dssync_probe(models["dssync"], world_size, task, rank, end)  # collective: every rank
            if probe is not None:
                dssync_track.append(probe)
        if rank == 0:
            block_load.append(os.getloadavg()[0])
            if end % cfg["eval_every"] == 0 and end < steps:
                for name in names:
                    evals[name].append({"step": end, **task.evaluate(models[name])})

    result: dict[str, Any] = {"variants": {}}
    for name in names:
        step = steps_of.get(name)
        entry: dict[str, Any] = {}
        if name.startswith("dssync"):
            identical, spread = _replica_spread(models[name], world_size)
            entry["before_flush"] = {"replicas_identical": identical, "max_abs_diff": spread}
        if rank == 0:  # rank 0's replica before flush() (for dssync: one replica of its last group)
            entry["final_before_flush"] = task.evaluate(models[name])
        if step is not None:
            step.flush()  # apply every pending gradient (deft), the residual (dlcp), the global average (dssync)
        identical, spread = _replica_spread(models[name], world_size)
        entry["after_flush"] = {"replicas_identical": identical, "max_abs_diff": spread}
        entry["step_ms"] = _slower_rank(times[name])
        traced_any = torch.tensor([float(x) for x in traced[name]], dtype=torch.float64)
        dist.all_reduce(traced_any, op=dist.ReduceOp.MAX)
        entry["traced"] = [bool(x) for x in traced_any.tolist()]
        mean_loss = torch.tensor(losses[name], dtype=torch.float64)
        dist.all_reduce(mean_loss)
        entry["train_loss"] = (mean_loss / world_size).tolist()
        if step is not None:
            entry["trace_count"] = step.trace_count
            entry["plan_items"] = len(step.plan.items)
            entry["plan_options"] = {k: v for k, v in step.plan.options.items() if isinstance(v, (int, float, str, type(None)))}
            if name in DEFT_DIGITS:
                entry.update(_deft_plan_facts(step))
            if name in dlcp_stats:
                entry["chunks"] = step.plan.metadata["chunks"]
                entry["chunk_budget"] = step.plan.options["chunk_budget"]
                entry["stats"] = dlcp_stats[name]
        if rank == 0:
            entry["evals"] = evals[name] + [{"step": steps, **task.evaluate(models[name])}]
            entry["final"] = entry["evals"][-1]
        result["variants"][name] = entry
    if rank == 0:
        result["block_load"] = block_load
        if "dssync" in models:
            result["variants"]["dssync"]["track"] = dssync_track
        result["params"] = sum(p.numel() for p in models[names[0]].parameters())
    return result


# --------------------------------------------------------------------------- part 2: shaped link (worker)


def _allreduce_ms(group: Any, nbytes: int, repeats: int) -> float:
    """Median over ``repeats`` of the slowest rank's all-reduce time of ``nbytes`` over ``group``; every rank of the
    world starts together (a world barrier first), so disjoint groups run at the same time, as DS-Sync's pairs do."""
    tensor = torch.ones(nbytes // 4)
    dist.all_reduce(tensor, group=group)  # warm-up (connections)
    times = torch.zeros(repeats, dtype=torch.float64)
    for index in range(repeats):
        dist.barrier()
        started = time.perf_counter()
        dist.all_reduce(tensor, group=group)
        times[index] = (time.perf_counter() - started) * 1e3
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return statistics.median(times.tolist())


def shaped_worker(rank: int, world_size: int, cfg: dict[str, Any]) -> dict[str, Any]:
    from policies import _ForeignLoad, make_optimizer, vgg_setup

    from deft_compile.debug.artifacts import plan_cycle
    from deft_compile.tools.emulation import new_group

    base, inputs, targets, total_bytes = vgg_setup(rank, cfg)
    solo = [new_group(ranks=[r]) for r in range(world_size)][rank]  # new_group is collective: every rank makes every one

    # The link before training: an all-reduce of every gradient over all 4 ranks, and over DS-Sync's pairs with both
    # pairs at once (a world barrier before each repeat), each the slowest rank's median.
    pairs = {}
    for groups in sorted({tuple(dssync_partition(world_size, cfg["group_size"], t, seed=0)) for t in range(16)}):
        for g in groups:
            if g not in pairs:
                pairs[g] = new_group(ranks=list(g))
    mine = next(pairs[g] for g in dssync_partition(world_size, cfg["group_size"], 0, seed=0) if rank in g)
    link: dict[str, Any] = {"allreduce_all_ms": _allreduce_ms(None, total_bytes, cfg["link_repeats"]),
                            "pair_allreduce_all_ms": _allreduce_ms(mine, total_bytes, cfg["link_repeats"])}

    caps = {"bucket_cap_mb": cfg["bucket_cap_mb"], "first_bucket_mb": cfg["first_bucket_mb"]}
    runners: dict[str, Any] = {}
    steps_of: dict[str, Any] = {}
    warmups = {n: cfg["warmup"] for n in cfg["variants"]}
    dlcp_info: dict[str, dict[str, Any]] = {}
    progress = rank == 0 and cfg["progress"]

    def build(name: str) -> None:
        model = copy.deepcopy(base)
        optimizer = make_optimizer(model)
        if name == "floor":
            runners[name] = deft_compile(model, optimizer, F.cross_entropy, policy="wfbp", process_group=solo)
            steps_of[name] = runners[name]
        elif name == "ddp":
            runners[name] = eager_step(
                nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cfg["bucket_cap_mb"]), optimizer, F.cross_entropy)
        elif name in ("deft", "deft-K"):  # deft: delays only; deft-K: update periods allowed too (the solver's default)
            options = {"allow_period": False} if name == "deft" else {}
            config = DeftConfig(plan_options=options, preserver=PreserverConfig(enabled=False), **caps)
            runners[name] = steps_of[name] = deft_compile(model, optimizer, F.cross_entropy, policy="deft", config=config)
        elif name in ("dssync", "dssync-params"):
            options = {"group_size": cfg["group_size"], "shuffle_every": 1, "seed": 0,
                       "average": "parameters" if name == "dssync-params" else "gradients"}
            runners[name] = steps_of[name] = deft_compile(model, optimizer, F.cross_entropy, policy="dssync",
                                                          config=DeftConfig(plan_options=options, **caps))
            warmups[name] = max(cfg["warmup"], _dssync_warmup(world_size, cfg["group_size"], 0, 1) + 1)
        elif name.startswith("dlcp-"):
            profile = steps_of["deft"].profile  # measured on this link by deft's first step, agreed across ranks
            full = profile.links[0].cost(profile.total_bytes)
            deadline = cfg["dlcp_deadline"] * full
            options = {"deadline_ms": deadline, "max_loss": dlcp_max_loss(name), "chunk_bytes": cfg["dlcp_chunk_bytes"]}
            runners[name] = steps_of[name] = deft_compile(model, optimizer, F.cross_entropy, policy="dlcp", profile=profile,
                                                          config=DeftConfig(plan_options=options, **caps))
            dlcp_info[name] = {"predicted_allreduce_all_ms": full, "deadline_ms": deadline, "max_loss": dlcp_max_loss(name)}
        else:
            raise ValueError(f"unknown shaped variant {name!r}")

    names = list(cfg["variants"])
    if any(n.startswith("dlcp-") for n in names) and "deft" not in names:
        raise ValueError("dlcp plans on deft's measured profile: include deft")
    order = sorted(names, key=lambda n: n.startswith("dlcp-"))  # dlcp after deft has profiled
    pids: list[Any] = [None] * world_size
    dist.all_gather_object(pids, os.getpid())
    warmup_s: dict[str, float] = {}
    cycles: dict[str, int] = {}
    for name in order:
        build(name)
        dist.barrier()
        started = time.perf_counter()
        for _ in range(warmups[name]):
            runners[name](inputs, targets)
        # Then whole cycles of the plan (update periods K) until one captures no new graph on any rank, so the
        # timed blocks below (whole cycles too) time steps, not tracing.
        step = steps_of.get(name)
        cycles[name] = plan_cycle(step.plan) if step is not None and step.plan is not None else 1
        for _ in range(4 if step is not None else 0):
            before = step.trace_count
            for _ in range(max(2, cycles[name])):
                runners[name](inputs, targets)
                warmups[name] += 1
            new = torch.tensor([float(step.trace_count != before)])
            dist.all_reduce(new, op=dist.ReduceOp.MAX)
            if not new.item():
                break
        warmup_s[name] = time.perf_counter() - started
        if progress:
            print(f"  [shaped] warm-up {name}: {warmups[name]} steps in {warmup_s[name]:.1f} s "
                  f"(plan cycle {cycles[name]})", flush=True)

    samples = {n: [] for n in names}
    traced = {n: [] for n in names}
    blocks = {n: [] for n in names}  # (round, first sample index, count)
    foreign = {n: [] for n in names}
    dlcp_stats: dict[str, list[list[float] | None]] = {n: [] for n in names if n.startswith("dlcp-")}
    for r in range(cfg["rounds"]):
        for name in _rotated(names, r):
            run, step = runners[name], steps_of.get(name)
            dist.barrier()
            run(inputs, targets)  # absorbs whatever the previous block left on the link
            first = len(samples[name])
            length = math.ceil(cfg["block"] / cycles[name]) * cycles[name]  # whole cycles of a periodic plan
            with _ForeignLoad(pids) as load:
                for _ in range(length):
                    before = step.trace_count if step is not None else 0
                    started = time.perf_counter()
                    run(inputs, targets)
                    samples[name].append((time.perf_counter() - started) * 1e3)
                    traced[name].append(step is not None and step.trace_count != before)
                    if name in dlcp_stats:
                        dlcp_stats[name].append(_dlcp_stats(step))
            foreign[name].append(load.cores)
            blocks[name].append((r, first, length))
        if progress:
            print(f"  [shaped] round {r + 1}/{cfg['rounds']} done", flush=True)
    dist.barrier()
    out: dict[str, Any] = {"samples_ms": {}, "traced": {}, "blocks": blocks, "warmup_s": warmup_s,
                           "warmup_steps": warmups, "cycles": cycles}
    for name in names:
        out["samples_ms"][name] = _slower_rank(samples[name])
        flags = torch.tensor([float(x) for x in traced[name]], dtype=torch.float64)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        out["traced"][name] = [bool(x) for x in flags.tolist()]
    for step in steps_of.values():
        step.flush()
    if rank == 0:
        deft_step = steps_of.get("deft")
        out.update(
            params=sum(p.numel() for p in base.parameters()),
            gradient_bytes=total_bytes,
            link=link,
            foreign_cores=foreign,
            dlcp={n: {**dlcp_info[n], "stats": dlcp_stats[n], "chunks": steps_of[n].plan.metadata["chunks"],
                      "chunk_budget": steps_of[n].plan.options["chunk_budget"]} for n in dlcp_stats},
            profile_link=({"alpha_ms": deft_step.profile.links[0].alpha_ms,
                           "beta_ms_per_mib": deft_step.profile.links[0].beta_ms_per_byte * (1 << 20)}
                          if deft_step is not None else None),
            profile_compute_ms=(sum(p.forward_ms + p.backward_ms for p in deft_step.profile.params)
                                if deft_step is not None else None),
            plans={n: s.plan.table(s.profile) for n, s in steps_of.items() if s.plan is not None},
            plan_items={n: len(s.plan.items) for n, s in steps_of.items() if s.plan is not None},
            deft_plans={n: _deft_plan_facts(s) for n, s in steps_of.items() if n in ("deft", "deft-K")},
            trace_counts={n: s.trace_count for n, s in steps_of.items()},
        )
    return out


# --------------------------------------------------------------------------- analysis (parent)


def _kept(times: list[float], traced: list[bool], skip_first: int = 0) -> list[float]:
    """Step times without the first ``skip_first`` steps and without steps that captured a graph (compile time)."""
    return [t for i, (t, r) in enumerate(zip(times, traced)) if not r and i >= skip_first]


def dlcp_summary(stats: list[list[float] | None], chunks: int) -> dict[str, Any]:
    """Chunks sent and dropped squared-gradient mass over the steps (``total - kept`` can round to ±1e-7: clamped at 0)."""
    stats = [s for s in stats if s is not None]
    if not stats:
        return {"steps_with_stats": 0}
    sent = [s[0] for s in stats]
    dropped = [max(0.0, s[1]) for s in stats]
    return {"steps_with_stats": len(stats), "chunks": chunks,
            "chunks_sent_mean": statistics.fmean(sent), "chunks_sent_min": min(sent), "chunks_sent_max": max(sent),
            "sent_share_mean": statistics.fmean(sent) / chunks,
            "steps_dropping_share": sum(1 for x in sent if x < chunks) / len(sent),
            "dropped_mass_mean": statistics.fmean(dropped), "dropped_mass_median": statistics.median(dropped),
            "dropped_mass_max": max(dropped), "dropped_mass_raw_max": max(s[1] for s in stats)}


def summarise_digits(runs: dict[int, dict[str, Any]], variants: list[str], skip_first: int) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for name in variants:
        per_seed = [runs[s]["variants"][name] for s in sorted(runs)]
        accuracy = [e["final"]["test_accuracy"] for e in per_seed]
        test_loss = [e["final"]["test_loss"] for e in per_seed]
        before = [e["final_before_flush"]["test_accuracy"] for e in per_seed]
        # The mean over the whole run: a periodic plan (deft-K) has cheap steps that do not communicate, so a
        # median would pick those; 600 steps are whole cycles of any K <= 4 up to the few traced steps left out.
        kept = [_kept(e["step_ms"], e["traced"], skip_first) for e in per_seed]
        means = [statistics.fmean(k) for k in kept]
        medians = [statistics.median(k) for k in kept]
        rows[name] = {"test_accuracy": statistics.fmean(accuracy), "accuracy_per_seed": accuracy,
                      "test_loss": statistics.fmean(test_loss), "test_loss_per_seed": test_loss,
                      "accuracy_before_flush_per_seed": before,
                      "accuracy_before_flush": statistics.fmean(before),
                      "mean_step_ms_per_seed": means, "median_step_ms_per_seed": medians,
                      "replicas_identical_after_flush": [e["after_flush"]["replicas_identical"] for e in per_seed]}
        if name.startswith("dssync"):
            rows[name]["before_flush_max_abs_diff"] = [e["before_flush"]["max_abs_diff"] for e in per_seed]
            if all(e.get("track") for e in per_seed):
                rows[name]["relative_distance_to_mean"] = {
                    str(p["step"]): [e["track"][i]["relative_distance_to_mean"] for e in per_seed]
                    for i, p in enumerate(per_seed[0]["track"])}
                rows[name]["averaged_accuracy_before_flush"] = [e["track"][-1]["averaged"]["test_accuracy"]
                                                                for e in per_seed]
        if name in DEFT_DIGITS:
            rows[name]["plan"] = {k: per_seed[0][k] for k in _deft_plan_facts.keys}
        if name.startswith("dlcp-"):
            options = per_seed[0]["plan_options"]
            rows[name].update(max_loss=options["max_loss"], deadline_ms=options["deadline_ms"],
                              chunk_budget=per_seed[0]["chunk_budget"],
                              **dlcp_summary([x for e in per_seed for x in e["stats"]], per_seed[0]["chunks"]))
    if "ddp" in rows:
        for name, row in rows.items():
            row["accuracy_diff_points"] = row["test_accuracy"] - rows["ddp"]["test_accuracy"]
            ratios = [m / d for m, d in zip(row["mean_step_ms_per_seed"], rows["ddp"]["mean_step_ms_per_seed"])]
            row["time_ratio_to_ddp_per_seed"] = ratios
            row["time_ratio_to_ddp"] = statistics.fmean(ratios)
    return rows


def _block_means(value: dict[str, Any], name: str) -> dict[int, float]:
    """Per round: the mean step time of this variant's block (whole plan cycles); blocks that traced are left out."""
    out = {}
    for r, first, count in value["blocks"][name]:
        if not any(value["traced"][name][first:first + count]):
            out[r] = statistics.fmean(value["samples_ms"][name][first:first + count])
    return out


def summarise_shaped(value: dict[str, Any], variants: list[str]) -> dict[str, Any]:
    """Time per step of a variant: the median over rounds of its block mean (a block is whole cycles of the plan, so a
    periodic plan's steps that do not communicate are weighted right); ratios to DDP's and the floor's."""
    means = {n: _block_means(value, n) for n in variants}
    per_step = {n: statistics.median(m.values()) for n, m in means.items()}
    rows: dict[str, Any] = {}
    for name in variants:
        row = {"ms_per_step": per_step[name], "blocks": len(means[name]), "steps": len(value["samples_ms"][name]),
               "block_means_ms": means[name], "cycle": value["cycles"][name],
               "step_median_ms": statistics.median(value["samples_ms"][name]),
               "p10_ms": quantile(value["samples_ms"][name], 0.1), "p90_ms": quantile(value["samples_ms"][name], 0.9),
               "foreign_cores_mean": statistics.fmean(value["foreign_cores"][name])}
        if "ddp" in per_step:
            row["vs_ddp"] = per_step[name] / per_step["ddp"]
            ratios = [means[name][r] / means["ddp"][r] for r in means[name] if r in means["ddp"]]
            row["paired_vs_ddp"] = statistics.median(ratios) if ratios else float("nan")
        if "floor" in per_step:
            row["vs_floor"] = per_step[name] / per_step["floor"]
        if name in value["dlcp"]:
            d = value["dlcp"][name]
            row.update(deadline_ms=d["deadline_ms"], max_loss=d["max_loss"], chunk_budget=d["chunk_budget"],
                       **dlcp_summary(d["stats"], d["chunks"]))
        rows[name] = row
    return rows


# --------------------------------------------------------------------------- report and plot


def _dlcp_line(name: str, row: dict[str, Any], where: str) -> str:
    if not row.get("steps_with_stats"):
        return f"{name}: no DLCP statistics"
    return (f"{name} ({where}): deadline {row['deadline_ms']:.3g} ms -> budget {row['chunk_budget']} of {row['chunks']} chunks, "
            f"max_loss {row['max_loss']}; sent {row['chunks_sent_min']:.0f}..{row['chunks_sent_max']:.0f} "
            f"(mean {row['sent_share_mean']:.0%}); {row['steps_dropping_share']:.0%} of steps drop; dropped mass "
            f"mean {row['dropped_mass_mean']:.3f}, max {row['dropped_mass_max']:.3f}")


def print_digits(rows: dict[str, Any], seeds: list[int]) -> None:
    print(f"\ndigits, 4 workers, seeds {seeds}: final test accuracy (after flush) and time per step vs DDP (same run)")
    print(f"{'variant':<10}{'acc %':>8}{'Δ pts':>8}{'loss':>8}{'t/DDP':>7}{'pre-flush':>10}  per seed: accuracy | time ratio")
    for name, row in rows.items():
        per = " / ".join(f"{a:.2f}" for a in row["accuracy_per_seed"])
        ratio = " / ".join(f"{r:.2f}" for r in row.get("time_ratio_to_ddp_per_seed", []))
        print(f"{name:<10}{row['test_accuracy']:>8.2f}{row.get('accuracy_diff_points', 0.0):>+8.2f}{row['test_loss']:>8.4f}"
              f"{row.get('time_ratio_to_ddp', float('nan')):>7.2f}{row['accuracy_before_flush']:>10.2f}  {per} | {ratio}")
    for name in DEFT_DIGITS:
        if name in rows:
            print(f"{name}: {_plan_line(rows[name]['plan'])}")
    if "dssync" in rows:
        r = rows["dssync"]
        print(f"dssync: replicas identical after flush {r['replicas_identical_after_flush']}; "
              f"max |difference| between replicas before flush {[f'{x:.3g}' for x in r['before_flush_max_abs_diff']]}")
        if "relative_distance_to_mean" in r:
            points = list(r["relative_distance_to_mean"].items())
            shown = [points[i] for i in sorted({0, len(points) // 2, len(points) - 1})]
            print("dssync: replicas' largest ||w_r - mean|| / ||mean|| (per seed) at step "
                  + "; ".join(f"{k}: {', '.join(f'{x:.3f}' for x in v)}" for k, v in shown))
    for name, row in rows.items():
        if name.startswith("dlcp-"):
            print(_dlcp_line(name, row, "synthetic slow-link profile"))


def print_shaped(rows: dict[str, Any], value: dict[str, Any], rate: str, deadline: float) -> None:
    link = value["link"]
    print(f"\nshaped link: tbf {rate} on one shared lo, 4 workers; model {value['params'] / 1e6:.2f} M parameters "
          f"({value['gradient_bytes'] / (1 << 20):.2f} MiB of gradients)")
    print(f"all-reduce of every gradient: {link['allreduce_all_ms']:.1f} ms over 4 ranks, "
          f"{link['pair_allreduce_all_ms']:.1f} ms over DS-Sync pairs (both pairs at once)")
    if "floor" in rows:
        print(f"coverage rate (all-reduce of every gradient / floor step): {link['allreduce_all_ms'] / rows['floor']['ms_per_step']:.2f}")
    print(f"{'variant':<10}{'ms/step':>10}{'blocks':>7}{'vs DDP':>8}{'paired':>8}{'vs floor':>9}{'non-worker CPU':>15}")
    for name, row in rows.items():
        print(f"{name:<10}{row['ms_per_step']:>10.1f}{row['blocks']:>7}{row.get('vs_ddp', float('nan')):>8.2f}"
              f"{row.get('paired_vs_ddp', float('nan')):>8.2f}{row.get('vs_floor', float('nan')):>9.2f}"
              f"{row['foreign_cores_mean']:>14.2f}c")
    for name, facts in value["deft_plans"].items():
        print(f"{name}: {_plan_line(facts)}")
    for name, row in rows.items():
        if name.startswith("dlcp-"):
            print(_dlcp_line(name, row, f"{deadline} × the all-reduce on deft's measured profile"))


def plot(record: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return False
    digits, shaped = record.get("digits"), record.get("shaped")
    panels = (["acc", "spread", "dtime", "drop"] if digits else []) + (["stime"] if shaped else [])
    if not panels:
        return False
    columns = min(3, len(panels))
    rows_n = math.ceil(len(panels) / columns)
    fig, grid = plt.subplots(rows_n, columns, figsize=(5.5 * columns, 4.3 * rows_n), squeeze=False)
    axes = [ax for row in grid for ax in row]
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    axes = axes[:len(panels)]
    ax_of = dict(zip(panels, axes))
    if digits:
        runs, seeds = digits["runs"], sorted(digits["runs"], key=int)
        lowest = 100.0
        for name in digits["variants"]:
            steps = [e["step"] for e in runs[seeds[0]]["variants"][name]["evals"]]
            acc = [statistics.fmean(runs[s]["variants"][name]["evals"][i]["test_accuracy"] for s in seeds)
                   for i in range(len(steps))]
            ax_of["acc"].plot(steps, acc, marker=".", label=name)
            lowest = min(lowest, *acc)
        if "dssync" in digits["variants"] and all(runs[s]["variants"]["dssync"].get("track") for s in seeds):
            tracks = [runs[s]["variants"]["dssync"]["track"] for s in seeds]
            steps = [p["step"] for p in tracks[0]]
            acc = [statistics.fmean(t[i]["averaged"]["test_accuracy"] for t in tracks) for i in range(len(steps))]
            ax_of["acc"].plot(steps, acc, ls="--", color="C3", label="dssync, average of the 4 replicas")
            lowest = min(lowest, *acc)
            for s, t in zip(seeds, tracks):
                ax_of["spread"].plot(steps, [p["relative_distance_to_mean"] for p in t], marker=".", label=f"seed {s}")
            ax_of["spread"].set(title="DS-Sync: max_r ||w_r - mean|| / ||mean||", xlabel="step", ylabel="relative distance")
            ax_of["spread"].legend()
        ax_of["acc"].set(title=f"digits: test accuracy (rank 0, mean of {len(seeds)} seed(s))",
                         xlabel="step",
                         ylabel="%", ylim=(85.0 if steps[-1] >= 200 else min(90.0, lowest - 1), 100))
        ax_of["acc"].legend()
        rows = digits["summary"]
        names = list(rows)
        ax_of["dtime"].bar(names, [rows[n].get("time_ratio_to_ddp", float("nan")) for n in names], color="C0")
        ax_of["dtime"].axhline(1.0, color="k", lw=0.8)
        ax_of["dtime"].set(title="digits (unshaped lo): time/step / DDP", ylabel="ratio")
        for name in names:
            if name.startswith("dlcp-"):
                stats = runs[seeds[0]]["variants"][name]["stats"]
                dropped = [max(0.0, s[1]) if s is not None else float("nan") for s in stats]
                ax_of["drop"].plot(range(1, len(dropped) + 1), dropped, lw=0.7, label=f"digits {name}")
                ax_of["drop"].axhline(rows[name]["max_loss"], color="k", ls=":", lw=0.8)
        if shaped:
            rate = shaped["rates"][0]
            for name, d in shaped["runs"][rate]["value"]["dlcp"].items():
                s = [max(0.0, x[1]) if x is not None else float("nan") for x in d["stats"]]
                ax_of["drop"].plot(range(1, len(s) + 1), s, lw=0.7, ls="--", label=f"shaped {rate} {name} (timed steps)")
        ax_of["drop"].set(title="DLCP: dropped squared-gradient mass (dotted: bounds)", xlabel="step", ylabel="fraction")
        ax_of["drop"].legend(fontsize=7)
    if shaped:
        names, rates = shaped["variants"], shaped["rates"]
        width = 0.8 / len(rates)
        for k, rate in enumerate(rates):
            rows = shaped["runs"][rate]["summary"]
            ax_of["stime"].bar([i + (k - (len(rates) - 1) / 2) * width for i in range(len(names))],
                               [rows[n].get("vs_ddp", float("nan")) for n in names], width, label=rate, color=f"C{k + 1}")
        ax_of["stime"].set_xticks(range(len(names)), names)
        ax_of["stime"].axhline(1.0, color="k", lw=0.8)
        ax_of["stime"].set(title="shaped lo, 4 workers: time/step / DDP", ylabel="ratio")
        ax_of["stime"].legend()
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


# --------------------------------------------------------------------------- driver


def run_digits(args: argparse.Namespace) -> dict[str, Any]:
    variants = expand_variants(args.digits_variants, args.dlcp_max_loss)
    load_before = os.getloadavg()
    started = time.perf_counter()
    runs: dict[int, dict[str, Any]] = {}
    cfg_base = {"batch": args.batch, "steps": args.steps, "block": args.block, "eval_every": args.eval_every,
                "variants": variants, "group_size": 2, "shuffle_every": 1, "dlcp_deadline": args.dlcp_deadline,
                "dlcp_chunk_bytes": args.digits_chunk_bytes, "dlcp_profile_comm_over_compute": 0.7}
    for seed in args.seeds:
        t0 = time.perf_counter()
        results = run_local_workers(digits_worker, WORLD, ({**cfg_base, "seed": seed},), timeout_s=args.timeout,
                                    collective_timeout_s=120.0)
        runs[seed] = results[0].value
        line = ", ".join(f"{n} {runs[seed]['variants'][n]['final']['test_accuracy']:.2f}%" for n in variants)
        print(f"[digits seed {seed}] {line}  ({time.perf_counter() - t0:.0f} s, load {os.getloadavg()[0]:.2f})", flush=True)
    summary = summarise_digits(runs, variants, skip_first=args.skip_first)
    print_digits(summary, args.seeds)
    return {"config": {**cfg_base, "seeds": args.seeds, "world_size": WORLD, "skip_first": args.skip_first,
                       "deft_variant": CONVERGENCE_VARIANTS["deft-delay"]},
            "variants": variants, "summary": summary, "runs": {str(s): v for s, v in runs.items()},
            "load_before": load_before, "load_after": os.getloadavg(), "elapsed_s": time.perf_counter() - started}


def run_shaped(args: argparse.Namespace) -> dict[str, Any]:
    """One launch of 4 workers per rate, each in its own shaped namespace (deleted before the next one starts)."""
    from deft_compile.tools.netns import NETNS_DIR, ShapedLoopback, check_prerequisites

    check_prerequisites()
    variants = expand_variants(args.shaped_variants, args.dlcp_max_loss)
    cfg = {"burst": args.burst, "latency": args.latency, "width": args.width, "fc": args.fc,
           "image": args.image, "batch": args.shaped_batch, "bucket_cap_mb": args.bucket_cap_mb,
           "first_bucket_mb": args.first_bucket_mb, "warmup": args.warmup, "rounds": args.rounds,
           "block": args.shaped_block, "link_repeats": args.link_repeats, "group_size": 2,
           "dlcp_deadline": args.dlcp_deadline, "dlcp_chunk_bytes": args.shaped_chunk_bytes, "variants": variants,
           "progress": True}
    runs: dict[str, Any] = {}
    for rate in args.rates:
        load_before = os.getloadavg()
        started = time.perf_counter()
        with ShapedLoopback(name_prefix="deftdd", rate=rate, burst=args.burst, latency=args.latency) as lo:
            namespace = lo.name
            print(f"[shaped {rate}] namespace {namespace}: lo shaped to {rate}; 4 workers; variants {', '.join(variants)}",
                  flush=True)
            results = run_local_workers(shaped_worker, WORLD, ({**cfg, "rate": rate},), timeout_s=args.timeout,
                                        collective_timeout_s=120.0, **lo.launch_kwargs(WORLD))
        removed = not os.path.exists(os.path.join(NETNS_DIR, namespace))
        value = results[0].value
        summary = summarise_shaped(value, variants)
        print_shaped(summary, value, rate, args.dlcp_deadline)
        print(f"[shaped {rate}] {time.perf_counter() - started:.0f} s, load {load_before[0]:.2f} before, "
              f"{os.getloadavg()[0]:.2f} after; namespace {namespace} removed: {removed}", flush=True)
        runs[rate] = {"summary": summary, "value": value, "namespace": namespace, "namespace_removed": removed,
                      "load_before": load_before, "load_after": os.getloadavg(), "elapsed_s": time.perf_counter() - started}
    return {"config": cfg, "rates": list(args.rates), "variants": variants, "runs": runs}


def _rounded(value: Any) -> Any:
    """Floats to 6 significant digits (the JSON keeps every per-step sample; this halves its size)."""
    if isinstance(value, float):
        return float(f"{value:.6g}")
    if isinstance(value, (list, tuple)):
        return [_rounded(v) for v in value]
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    return value


def write_json(path: Path, record: dict[str, Any]) -> None:
    path.write_text(json.dumps(_rounded(record), separators=(",", ":")))


QUICK = {"seeds": [0], "steps": 20, "block": 5, "eval_every": 10, "width": 8, "fc": 128, "shaped_batch": 8,
         "warmup": 3, "rounds": 2, "shaped_block": 2, "link_repeats": 2, "rates": ["300mbit"]}


def main(argv: list[str] | None = None) -> int:
    from deft_compile.tools.bench import sigterm_as_interrupt
    from deft_compile.tools.netns import created_namespaces

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--parts", nargs="+", default=["digits", "shaped"], choices=["digits", "shaped"])
    parser.add_argument("--out", default=str(ROOT / "docs" / "img"))
    parser.add_argument("--name", default="dssync_dlcp", help="file stem of the JSON and PNG in --out")
    parser.add_argument("--quick", action="store_true",
                        help="seconds instead of minutes (tests): " + ", ".join(f"{k}={v}" for k, v in QUICK.items())
                             + " unless given")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds before a launch's workers are killed")
    parser.add_argument("--replot", action="store_true", help="only redraw the PNG from the JSON in --out")
    digits = parser.add_argument_group("digits")
    digits.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    digits.add_argument("--steps", type=int, default=600)
    digits.add_argument("--batch", type=int, default=16, help="per rank (4 ranks: global 64 = the 2-worker run's 2×32)")
    digits.add_argument("--block", type=int, default=10, help="interleaved steps per variant")
    digits.add_argument("--eval-every", type=int, default=50)
    digits.add_argument("--skip-first", type=int, default=2, help="steps per variant left out of the time median")
    digits.add_argument("--digits-variants", nargs="+", default=list(DIGITS_VARIANTS), choices=DIGITS_VARIANTS)
    digits.add_argument("--digits-chunk-bytes", type=int, default=4096, help="DLCP chunk (the CNN has 290 KB of gradients)")
    shaped = parser.add_argument_group("shaped link (root + iproute2)")
    shaped.add_argument("--rates", nargs="+", default=["300mbit", "500mbit"],
                        help="tbf rate of the namespace's lo (shared by all 4 workers); one launch per rate")
    shaped.add_argument("--burst", default="128kb")
    shaped.add_argument("--latency", default="20ms")
    shaped.add_argument("--width", type=int, default=16, help="VGG first-stage channels")
    shaped.add_argument("--fc", type=int, default=512, help="VGG hidden fully-connected width")
    shaped.add_argument("--image", type=int, default=32)
    shaped.add_argument("--shaped-batch", type=int, default=32, help="per rank")
    shaped.add_argument("--bucket-cap-mb", type=float, default=25.0)
    shaped.add_argument("--first-bucket-mb", type=float, default=1.0)
    shaped.add_argument("--warmup", type=int, default=4, help="untimed steps per variant (dssync: until every grouping ran)")
    shaped.add_argument("--rounds", type=int, default=6)
    shaped.add_argument("--shaped-block", type=int, default=4, help="timed steps per variant per round")
    shaped.add_argument("--link-repeats", type=int, default=3)
    shaped.add_argument("--shaped-variants", nargs="+", default=list(SHAPED_VARIANTS), choices=SHAPED_VARIANTS)
    shaped.add_argument("--shaped-chunk-bytes", type=int, default=65536)
    dlcp = parser.add_argument_group("dlcp")
    dlcp.add_argument("--dlcp-deadline", type=float, default=0.5,
                      help="deadline as a fraction of the profile's time for an all-reduce of every gradient")
    dlcp.add_argument("--dlcp-max-loss", nargs="+", type=float, default=[0.1, 0.5],
                      help="one dlcp variant per bound on the dropped squared-gradient mass per step")
    args = parser.parse_args(argv)
    if args.quick:
        defaults = {a.dest: a.default for a in parser._actions}
        for key, value in QUICK.items():
            if getattr(args, key) == defaults[key]:
                setattr(args, key, value)
    if args.eval_every % args.block:
        parser.error("--eval-every must be a multiple of --block")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.replot:
        png = out_dir / f"{args.name}.png"
        return 0 if plot(json.loads((out_dir / f"{args.name}.json").read_text()), png) else 1
    from deft_compile.tools.provenance import provenance, script_command

    record: dict[str, Any] = {"command": script_command(__file__, argv),
                              "cpus": os.cpu_count(), "torch": torch.__version__, "world_size": WORLD,
                              "intra_op_threads_per_worker": 1, "load_start": os.getloadavg()}
    record["provenance"] = provenance(command=record["command"])
    started = time.perf_counter()
    json_path = out_dir / f"{args.name}.json"
    try:
        with sigterm_as_interrupt():
            if "digits" in args.parts:
                record["digits"] = run_digits(args)
            if "shaped" in args.parts:
                record["shaped"] = run_shaped(args)
    except KeyboardInterrupt:
        print(f"\ninterrupted; namespaces left by this run: {created_namespaces() or 'none'}", file=sys.stderr)
        record["interrupted"] = True
        write_json(json_path, record)
        return 130
    record["load_end"] = os.getloadavg()
    record["elapsed_s"] = time.perf_counter() - started
    write_json(json_path, record)
    png = out_dir / f"{args.name}.png"
    wrote = plot(record, png)
    print(f"\nwrote {json_path}{' and ' + str(png) if wrote else ''} in {record['elapsed_s']:.0f} s "
          f"(load average {record['load_start'][0]:.2f} at start, {record['load_end'][0]:.2f} at end, {os.cpu_count()} CPUs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
