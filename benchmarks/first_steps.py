"""The first steps a user lives through: ``deft_compile`` with its defaults, wall-clock from the first call.

    python benchmarks/first_steps.py                          # transformer and cnn, 3 cold + 3 warm launches, 120 steps
    python benchmarks/first_steps.py --models transformer --launches 1 --steps 40 --out /tmp/first

Each launch starts 2 gloo workers (unshaped loopback) that build the model, call ``deft_compile(model, optimizer,
loss_fn)`` with every default (policy ``deft``, Inductor in regions, the closed loop, the Preserver) and time every
call from the first. A launch is *cold* when Inductor's caches start empty (a fresh ``TORCHINDUCTOR_CACHE_DIR``),
*warm* when it reuses the caches a cold launch of the same model filled. Per launch:

* ``stall_share``: the wall time of steps over 3x the median step, over the whole wall time (compiles, planning,
  graph building, the Preserver's probes and closed-loop trials all land in such steps);
* ``stalls_after_first_s``: what the calls after the first that took over 1.5 median steps took beyond the median,
  together (``stalls_after_first``: their index and ms);
* ``replan_steps``: per plan switch after the first compile (the closed loop's trials and duels, the Preserver's
  decisions), the time the switching call and the next one took beyond two median steps, in median steps;
* ``compile_s``, ``planning_s``, ``capture_s``, ``graph_s``, ``probe_s``: the runtime's own accounts (``CompiledStep.overheads``);
* ``--compare-lowering``: the steady step of regional lowering against whole-graph lowering (``inductor-graph``),
  both in one process pair, interleaved blocks after both compiled.

``--variants deft,deft-compile-first`` also launches the defaults with ``DeftConfig(aten_first_call=False)``
(regions compiled from the first call). ``--variants deft,torch.compile`` also launches the anchor, ``torch.compile(DistributedDataParallel(model))`` with
the eager optimizer on the same model, data and steps, timed the same way (its stalls are its compiles and
recompiles), alternating the order across launches; every launch records its processes' peak resident memory.

Models: ``transformer``: GPT-2 layout, 6 blocks x 256, vocab 4096, context 128, batch 8, AdamW; ``cnn``: a ResNet
(4 stages x 2 basic blocks, BatchNorm) on 32x32 images, batch 16, SGD momentum 0.9; ``bert``: ``transformers``'
``BertForMaskedLM`` built from a config (4 layers x 256, 4 heads, vocab 8192, context 128, random weights, its own
loss on every token), batch 8, AdamW: a model none of the runtime's tuning used.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: the ``deft_compile`` variants, by name: their ``DeftConfig`` fields besides the defaults
DEFT_VARIANTS: dict[str, dict[str, Any]] = {"deft": {}, "deft-compile-first": {"aten_first_call": False}}
STALL_FACTOR = 3.0
#: a call after the first that takes over this many median steps is a stall of ``stalls_after_first_s``
LATER_STALL_FACTOR = 1.5


def build(model: str, rank: int, steps: int) -> tuple[Any, Any, Any, list[tuple]]:
    import torch
    import torch.nn.functional as F

    from deft_compile.tools.presets import GPT2Style, ResNetStyle

    torch.manual_seed(0)
    if model == "transformer":
        net = GPT2Style(vocab=4096, dim=256, heads=4, layers=6, context=128)
        optimizer = torch.optim.AdamW(net.parameters(), lr=3e-4, weight_decay=0.1)
        g = torch.Generator().manual_seed(100 + rank)
        batches = [(torch.randint(0, 4096, (8, 128), generator=g), torch.randint(0, 4096, (8, 128), generator=g))
                   for _ in range(steps)]
        return net, optimizer, None, batches
    if model == "cnn":
        net = ResNetStyle()
        optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
        g = torch.Generator().manual_seed(100 + rank)
        batches = [(torch.randn(16, 3, 32, 32, generator=g), torch.randint(0, 10, (16,), generator=g))
                   for _ in range(steps)]
        return net, optimizer, F.cross_entropy, batches
    if model == "bert":
        from deft_compile.tools.presets import hf_bert

        net = hf_bert(layers=4, dim=256, heads=4, vocab=8192, context=128)
        optimizer = torch.optim.AdamW(net.parameters(), lr=3e-4, weight_decay=0.01)
        g = torch.Generator().manual_seed(100 + rank)
        batches = []
        for _ in range(steps):
            tokens = torch.randint(0, 8192, (8, 128), generator=g)
            batches.append((tokens, tokens.clone()))
        return net, optimizer, None, batches
    raise ValueError(f"unknown model {model!r}: transformer, cnn or bert")


def first_steps_worker(rank: int, world_size: int, model: str, steps: int, config: dict | None = None) -> dict[str, Any]:
    """One rank: the defaults (with ``config``'s ``DeftConfig`` fields, if any) from the first call, every call
    timed."""
    from deft_compile import DeftConfig, deft_compile

    net, optimizer, loss_fn, batches = build(model, rank, steps)
    started = time.perf_counter()
    step = deft_compile(net, optimizer, loss_fn, config=DeftConfig(**(config or {})))
    construct_s = time.perf_counter() - started
    times, switched, traced = [], [], []
    for args in batches:
        switches, traces = step.plan_switches, step.trace_count
        begun = time.perf_counter()
        step(*args)
        times.append(time.perf_counter() - begun)
        switched.append(step.plan_switches != switches)
        traced.append(step.trace_count != traces)
    import resource

    return {"construct_s": construct_s, "times": times, "switched": switched, "traced": traced,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "overheads": dict(step.overheads), "compiles": len(step.lowering.history),
            "compile_history": step.lowering.history[-40:], "plan_history": step.plan_history,
            "delayed_items": sum(1 for item in step.plan.items if item.delay), "compiler": step.compiler}


def torch_compile_worker(rank: int, world_size: int, model: str, steps: int) -> dict[str, Any]:
    """One rank of the anchor: ``torch.compile(DistributedDataParallel(model))`` with the eager optimizer, the same
    model, data and steps, every call timed from the first."""
    import resource

    import torch
    from torch.nn.parallel import DistributedDataParallel

    net, optimizer, loss_fn, batches = build(model, rank, steps)
    started = time.perf_counter()
    compiled = torch.compile(DistributedDataParallel(net))
    construct_s = time.perf_counter() - started
    times = []
    for args in batches:
        begun = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        out = compiled(*args[:1]) if loss_fn is not None else compiled(*args)
        loss = loss_fn(out, args[1]) if loss_fn is not None else out
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - begun)
    from torch._dynamo.utils import counters

    return {"construct_s": construct_s, "times": times, "switched": [False] * len(times),
            "traced": [False] * len(times), "overheads": {}, "compiles": int(counters["stats"]["unique_graphs"]),
            "plan_history": [], "delayed_items": 0, "compiler": "torch.compile",
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def summarise(value: dict[str, Any]) -> dict[str, Any]:
    """The launch's figures from one rank's record (see the module docstring)."""
    times = value["times"]
    median = statistics.median(times)
    total = value["construct_s"] + sum(times)
    stalls = [t for t in times if t > STALL_FACTOR * median]
    first_compile = next((i for i, t in enumerate(times) if t <= STALL_FACTOR * median), len(times))
    replans = []
    for i, switched in enumerate(value["switched"]):
        if switched and i >= first_compile:
            cost = sum(times[i: i + 2]) - 2 * median
            replans.append(round(cost / median, 2))
    over = value["overheads"]
    later = [(i, t) for i, t in enumerate(times) if i >= 1 and t > LATER_STALL_FACTOR * median]
    return {"wall_s": total, "median_step_ms": median * 1e3, "stall_share": sum(stalls) / total,
            "stall_steps": len(stalls), "replan_steps": replans, "worst_replan_steps": max(replans, default=0.0),
            "stalls_after_first_s": sum(t - median for _, t in later),
            "stalls_after_first": [[i, round(t * 1e3)] for i, t in later],
            "compile_s": over.get("compile_seconds"), "planning_s": over.get("planning_seconds"),
            "capture_s": over.get("capture_seconds"), "graph_s": over.get("graph_seconds"),
            "probe_s": over.get("probe_seconds"),
            "compiles": value["compiles"], "graphs": over.get("graphs"), "delayed_items": value["delayed_items"],
            "compiler": value["compiler"], "first_steps_ms": [round(t * 1e3) for t in times[:6]],
            "peak_rss_mib": value.get("peak_rss_mib")}


def lowering_worker(rank: int, world_size: int, model: str, rounds: int, block: int) -> dict[str, Any]:
    """Regional against whole-graph lowering, the same synchronous plan (wfbp), interleaved blocks."""
    import torch.distributed as dist

    from deft_compile import DeftConfig, deft_compile

    steps = {}
    for compiler in ("inductor", "inductor-graph"):
        net, optimizer, loss_fn, batches = build(model, rank, 8)  # the same weights and batches for both
        steps[compiler] = deft_compile(net, optimizer, loss_fn, policy="wfbp", config=DeftConfig(compiler=compiler))
        for i in range(4):  # the whole graph compiles on its second call
            steps[compiler](*batches[i])
    samples: dict[str, list[float]] = {c: [] for c in steps}
    for r in range(rounds):
        order = list(steps) if r % 2 == 0 else list(reversed(list(steps)))
        for compiler in order:
            dist.barrier()
            begun = time.perf_counter()
            for i in range(block):
                steps[compiler](*batches[i % len(batches)])
            samples[compiler].append((time.perf_counter() - begun) / block * 1e3)
    ratios = [a / b for a, b in zip(samples["inductor"], samples["inductor-graph"])]
    return {"samples_ms": samples, "ratios": ratios, "compilers": {c: s.compiler for c, s in steps.items()}}


def launch(model: str, steps: int, cache_dir: str, variant: str = "deft") -> dict[str, Any]:
    from deft_compile.tools.launcher import run_local_workers

    env = {"TORCHINDUCTOR_CACHE_DIR": cache_dir}
    if variant == "torch.compile":
        worker, args = torch_compile_worker, (model, steps)
    else:
        worker, args = first_steps_worker, (model, steps, DEFT_VARIANTS[variant])
    results = run_local_workers(worker, 2, args, timeout_s=3600, collective_timeout_s=600,
                                env=env, start_method="spawn")
    return {"rank0": summarise(results[0].value), "rank1": summarise(results[1].value),
            "plan_history": results[0].value["plan_history"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="transformer,cnn", help="comma-separated: transformer, cnn, bert")
    parser.add_argument("--launches", type=int, default=3, help="cold launches per model (each followed by a warm one)")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--compare-lowering", action="store_true", help="also regional vs whole-graph steady step")
    parser.add_argument("--variants", default="deft",
                        help="deft (deft_compile's defaults), deft-compile-first (the defaults with "
                             "DeftConfig(aten_first_call=False): Inductor from the first call) and/or torch.compile "
                             "(torch.compile(DDP(model)) with the eager optimizer), each launch in turn, order "
                             "alternating across launches")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--block", type=int, default=5)
    parser.add_argument("--out", default="first_steps_out")
    parser.add_argument("--modes", default="cold,warm", help="which launches of each pair run: cold, warm or both")
    parser.add_argument("--cache-dir", default=None,
                        help="one Inductor cache folder for every launch (each launch then counts as warm when an "
                             "earlier one filled it) instead of a fresh one per cold launch")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from deft_compile.tools.provenance import provenance, script_command
    report: dict[str, Any] = {"command": script_command(__file__, argv or None),
                              "host": {"cpus": os.cpu_count(), "load_avg": os.getloadavg()}, "models": {}}

    report["provenance"] = provenance(command=report["command"])
    for model in args.models.split(","):
        runs = []
        variants = [v for v in args.variants.split(",") if v]
        for index in range(args.launches):
            order = variants if index % 2 == 0 else list(reversed(variants))
            for variant in order:
                with tempfile.TemporaryDirectory(prefix="deft-inductor-cache-") as fresh:
                    cache = args.cache_dir or fresh
                    for mode in [m for m in args.modes.split(",") if m] if not args.cache_dir else ("warm",):
                        started = time.perf_counter()
                        result = launch(model, args.steps, cache, variant)
                        result.update(mode=mode, launch=index, variant=variant, seconds=time.perf_counter() - started)
                        runs.append(result)
                        r = result["rank0"]
                        print(f"{model} {variant} {mode} #{index}: wall {r['wall_s']:.1f} s, median step "
                              f"{r['median_step_ms']:.1f} ms, stalls {r['stall_share']:.0%} ({r['stall_steps']} steps), "
                              f"compile {r['compile_s'] or 0:.1f} s, {r['compiles']} compiles, stalls after the first call "
                              f"{r['stalls_after_first_s']:.1f} s, peak RSS "
                              f"{r['peak_rss_mib']:.0f} MiB, re-plans (steps) {r['replan_steps']}", flush=True)
                        (out / "first_steps.json").write_text(json.dumps(report | {"partial": {model: runs}}, indent=1))
        report["models"][model] = {"runs": runs}
        for variant in variants:
            for mode in sorted({r["mode"] for r in runs}):
                rows = [r["rank0"] for r in runs if r["mode"] == mode and r["variant"] == variant]
                name = mode if variant == "deft" else f"{variant} {mode}"
                report["models"][model][name] = {
                    key: statistics.median(row[key] or 0.0 for row in rows)
                    for key in ("wall_s", "median_step_ms", "stall_share", "worst_replan_steps", "compile_s",
                                "peak_rss_mib", "stalls_after_first_s")}
                report["models"][model][name]["spread_stall_share"] = [min(r["stall_share"] for r in rows),
                                                                       max(r["stall_share"] for r in rows)]
                report["models"][model][name]["spread_wall_s"] = [min(r["wall_s"] for r in rows),
                                                                  max(r["wall_s"] for r in rows)]
        if args.compare_lowering:
            from deft_compile.tools.launcher import run_local_workers

            values = [r.value for r in run_local_workers(lowering_worker, 2, (model, args.rounds, args.block),
                                                         timeout_s=3600, collective_timeout_s=600,
                                                         start_method="spawn")]
            ratios = values[0]["ratios"]
            report["models"][model]["lowering"] = {"ratios_regional_over_whole": ratios,
                                                   "median_ratio": statistics.median(ratios),
                                                   "samples_ms": values[0]["samples_ms"]}
            print(f"{model}: regional / whole-graph steady step, median of {len(ratios)} interleaved rounds: "
                  f"{statistics.median(ratios):.3f} ({[round(r, 3) for r in ratios]})", flush=True)
        (out / "first_steps.json").write_text(json.dumps(report, indent=1))
    print(json.dumps({m: {k: v for k, v in d.items() if k != "runs"} for m, d in report["models"].items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
