"""What gradient accumulation's new overlap buys: time per optimizer update with ``accumulation_steps=N``.

With accumulation, DDP (``no_sync()`` on the first N-1 micro-batches) communicates during the
last micro-batch's backward and waits at its end. ``wfbp`` compiled does the same. ``deft`` may
delay buckets: their all-reduce is launched in the next cycle's first micro-batch and waited at
its update point, so it overlaps a whole micro-batch (forward and backward) instead of one
backward (docs/POLICIES.md). Variants run in one process pair on a tc-shaped loopback,
interleaved rounds (order rotating), whole updates timed (N calls each), slower rank's time;
repeat with ``--launches``.

    python benchmarks/accumulation.py --model vgg --bandwidth 1gbit --accumulation 4 --launches 3

Needs root for the shaped namespace (``--bandwidth none``: the plain loopback).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import statistics
import sys
import time
from typing import Any

VARIANTS = ("floor", "ddp", "wfbp", "deft", "deft-no-preserver")


def worker(rank: int, world_size: int, cfg: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    from deft_compile import DeftConfig, deft_compile
    from deft_compile.tools.emulation import new_group
    from deft_compile.preserver import PreserverConfig
    from deft_compile.tools.bench_models import resolve_model

    torch.set_num_threads(1)
    preset = resolve_model(cfg["model"])
    torch.manual_seed(0)
    base = preset.build()
    batch = cfg["batch"] or preset.default_batch
    pool = [preset.batch(batch, torch.Generator().manual_seed(1000 * (rank + 1) + i)) for i in range(4)]  # (args, kwargs)
    steps = cfg["accumulation"]
    solo = [new_group(ranks=[r]) for r in range(world_size)][rank]
    runners = {}
    steps_of = {}
    for name in VARIANTS:
        model = copy.deepcopy(base)
        optimizer = preset.optimizer(model)
        if name == "ddp":
            ddp = nn.parallel.DistributedDataParallel(model)

            def update(ddp=ddp, optimizer=optimizer) -> None:
                for i in range(steps):
                    (inputs, targets), kwargs = pool[i % len(pool)]
                    with contextlib.nullcontext() if i == steps - 1 else ddp.no_sync():
                        (preset.loss_fn(ddp(inputs, **kwargs), targets) / steps).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        else:
            config = DeftConfig(accumulation_steps=steps)
            if name == "deft-no-preserver":  # what the Preserver's probes and decisions cost here
                config = DeftConfig(accumulation_steps=steps, preserver=PreserverConfig(enabled=False))
            policy = {"floor": "wfbp", "deft-no-preserver": "deft"}.get(name, name)
            step = deft_compile(model, optimizer, preset.loss_fn, policy=policy,
                                process_group=solo if name == "floor" else None, config=config)
            steps_of[name] = step

            def update(step=step) -> None:
                for i in range(steps):
                    args, kwargs = pool[i % len(pool)]
                    step(*args, **kwargs)
        runners[name] = update
    for name in VARIANTS:  # warm-up: traces, profiles, deft's closed loop is off under accumulation
        for _ in range(cfg["warmup"]):
            runners[name]()
        step = steps_of.get(name)
        if step is not None:  # until a whole plan cycle (lcm of periods, in updates) traces nothing new
            cycle_calls = math.lcm(*(item.period for item in step.items)) if step.items else steps
            cycle = max(1, cycle_calls // steps)
            quiet, extra = 0, 0
            while quiet < cycle and extra < 4 * cycle + 4:
                before = step.trace_count
                runners[name]()
                extra += 1
                flag = torch.tensor([float(step.trace_count != before)])
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                quiet = 0 if flag.item() else quiet + 1
    samples: dict[str, list[float]] = {name: [] for name in VARIANTS}
    names = list(VARIANTS)
    for round_index in range(cfg["rounds"]):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            dist.barrier()
            runners[name]()  # absorbs what the previous variant left on the link
            for _ in range(cfg["block"]):
                started = time.perf_counter()
                runners[name]()
                samples[name].append((time.perf_counter() - started) * 1e3)
    deft = steps_of["deft"]
    result: dict[str, Any] = {"deft_plan": {"delayed_items": sum(1 for i in deft.plan.items if i.delay),
                                            "max_period": max(i.period for i in deft.plan.items),
                                            "items": len(deft.plan.items)},
                              "deft_traces": deft.trace_count, "plan_changes": len(deft.plan_history)}
    for name in names:
        times = torch.tensor(samples[name], dtype=torch.float64)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        result[name] = statistics.median(times.tolist())
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="vgg")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--bandwidth", default="1gbit", help="tc rate of the shared loopback, or 'none'")
    parser.add_argument("--accumulation", type=int, default=4)
    parser.add_argument("--launches", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--block", type=int, default=2, help="timed updates per variant and round")
    parser.add_argument("--warmup", type=int, default=4, help="untimed updates per variant (deft traces about 2N graphs)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    from deft_compile.tools.bench import network, sigterm_as_interrupt
    from deft_compile.tools.launcher import run_local_workers

    cfg = {"model": args.model, "batch": args.batch, "accumulation": args.accumulation, "rounds": args.rounds,
           "block": args.block, "warmup": args.warmup}
    launches = []
    bandwidth = None if args.bandwidth == "none" else args.bandwidth
    for launch in range(args.launches):
        with sigterm_as_interrupt(), network(bandwidth, 1, 2, prefix="deftacc") as net:  # namespaces go on SIGTERM
            results = run_local_workers(worker, 2, (cfg,), timeout_s=1800, **net["launch"])
        medians = results[0].value
        launches.append(medians)
        ratios = {name: medians[name] / medians["ddp"] for name in VARIANTS}
        print(f"launch {launch + 1}: " + ", ".join(f"{n} {ratios[n]:.2f}" for n in VARIANTS) + " (x DDP per update); "
              f"deft plan {medians['deft_plan']}, {medians['deft_traces']} graphs traced, "
              f"{medians['plan_changes']} plan(s)", flush=True)
    summary = {}
    for name in VARIANTS:
        ratios = [launch[name] / launch["ddp"] for launch in launches]
        summary[name] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
    print(f"\n{args.model}, accumulation {args.accumulation}, {net['description']}, {args.launches} launches")
    print("| variant | time per update / DDP, median (min-max) |\n| --- | --- |")
    for name in VARIANTS:
        s = summary[name]
        print(f"| {name} | {s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f}) |")
    if args.json:
        from deft_compile.tools.provenance import provenance

        with open(args.json, "w") as handle:
            json.dump({"provenance": provenance(), "args": vars(args), "launches": launches, "summary": summary},
                      handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
