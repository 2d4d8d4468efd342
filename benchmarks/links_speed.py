"""DeFT's speed on real shaped links (docs/LINKS.md), measured, not simulated.

    sudo python benchmarks/links_speed.py [--part two-links|period|both] [--rounds 8] [--block 8] [--repeats 2] [--json docs/img/links_speed.json]

Needs root and iproute2 (``deft_compile.tools.netns``). 2 workers, one intra-op
thread each. Every comparison is made inside one run: the variants live in the
same two processes and are timed in interleaved blocks (rotated order each
round; every block starts with a barrier and one untimed step that absorbs
what the previous block left on the link). A step's time is the slower rank's;
reported are medians and their ratios. The machine's 2 cores are shared with
other jobs, so the script can repeat the whole measurement (``--repeats``).

Part ``two-links``: ``TwoHostLinks`` (two namespaces joined by link1 shaped to
1 Gbit/s and link2 to 500 Mbit/s; the default gloo group on link1). A
communication-bound MLP (fixed random batch) is trained by

* ``ddp``          torch DDP (link1 only), for reference;
* ``deft-1link``   ``deft_compile(policy="deft")`` with ``DeftConfig()``'s link only;
* ``deft-2links``  the same with ``DeftConfig(links=("gloo:link2",))``.

Both deft variants use ``plan_options={"allow_period": False}`` so the ratio
isolates what the second link buys (an update period would hide the
difference); ``--allow-period`` lifts that. They profile on their first step
(measured compute and per-link alpha/beta) and solve; the Preserver is on (the
default) and its decisions are reported. Target: deft-2links ≥ 1.35× faster
than deft-1link when communication is the bottleneck.

Part ``period``: ``ShapedLoopback`` at 1 Gbit/s (one shared medium). A wide MLP
whose all-reduce is ~3× its compute is trained on scikit-learn's digits by
torch DDP and by deft with the default config (K chosen by the solver, delays
allowed, Preserver on), same initial weights, same batches, same number of
steps. Reported: the speedup (median step time ratio), the measured coverage
rate, the plan (which buckets are delayed, which K) and every Preserver
decision, and the accuracy cost (final test accuracy and loss of each).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from convergence import ROOT, DigitsTask, plan_summary  # noqa: E402

from deft_compile import DeftConfig, deft_compile  # noqa: E402
from deft_compile.tools.bench import eager_step  # noqa: E402
from deft_compile.tools.launcher import run_local_workers  # noqa: E402
from deft_compile.tools.netns import ShapedLoopback, TwoHostLinks, check_prerequisites  # noqa: E402
from deft_compile.preserver import PreserverConfig  # noqa: E402
from deft_compile.tools.presets import mlp  # noqa: E402
from deft_compile.step.profiler import measure_allreduce  # noqa: E402

MiB = 1 << 20


def timed_rounds(runners: dict[str, Callable], batch_of: Callable[[str], tuple], cfg: dict[str, Any]) -> dict[str, list[float]]:
    """Warm-up, then ``rounds`` rounds of one block per runner (rotated order); per-step ms, slower rank."""
    for name, run in runners.items():
        dist.barrier()
        for _ in range(cfg["warmup"]):
            run(*batch_of(name))
    names = list(runners)
    samples: dict[str, list[float]] = {n: [] for n in names}
    for r in range(cfg["rounds"]):
        for name in names[r % len(names):] + names[: r % len(names)]:
            run = runners[name]
            dist.barrier()
            run(*batch_of(name))  # absorbs what the previous block left in flight
            for _ in range(cfg["block"]):
                batch = batch_of(name)
                started = time.perf_counter()
                loss = run(*batch)
                float(loss)
                samples[name].append((time.perf_counter() - started) * 1e3)
    dist.barrier()
    for name in names:
        t = torch.tensor(samples[name], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        samples[name] = t.tolist()
    return samples


def _step_record(step) -> dict[str, Any]:
    record = plan_summary(step)
    record["profile_links"] = [l.to_dict() for l in step.profile.links]
    record["compute_ms"] = step.profile.forward_ms + step.profile.backward_ms
    return record


# --------------------------------------------------------------------------- part 1: two links vs one


def two_links_worker(rank: int, world_size: int, cfg: dict[str, Any]) -> dict[str, Any]:
    torch.manual_seed(0)
    base = mlp(width=cfg["width"], depth=cfg["depth"], inputs=cfg["inputs"])
    data = torch.Generator().manual_seed(100 + rank)
    batch = (torch.randn(cfg["batch"], cfg["inputs"], generator=data),
             torch.randint(0, 10, (cfg["batch"],), generator=data))
    nbytes = sum(p.numel() * p.element_size() for p in base.parameters())
    flat_ms = measure_allreduce(None, [nbytes], repeats=3, warmup=1)[0][1]
    caps = {"bucket_cap_mb": cfg["bucket_cap_mb"], "first_bucket_mb": 1.0}
    options = {} if cfg["allow_period"] else {"allow_period": False}
    runners: dict[str, Callable] = {}
    steps = {}
    for name in cfg["variants"]:
        model = copy.deepcopy(base)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        if name == "ddp":
            runners[name] = eager_step(
                nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cfg["bucket_cap_mb"]), optimizer, F.cross_entropy)
        else:
            links = ("gloo:link2",) if name == "deft-2links" else ()
            step = deft_compile(model, optimizer, F.cross_entropy, policy="deft",
                                config=DeftConfig(links=links, plan_options=dict(options), **caps))
            runners[name] = steps[name] = step
    samples = timed_rounds(runners, lambda name: batch, cfg)
    for step in steps.values():
        step.flush()
    out: dict[str, Any] = {"samples_ms": samples}
    if rank == 0:
        out.update(params=sum(p.numel() for p in base.parameters()), bytes=nbytes, allreduce_all_link1_ms=flat_ms,
                   steps={n: _step_record(s) for n, s in steps.items()})
    return out


def run_two_links(cfg: dict[str, Any]) -> dict[str, Any]:
    with TwoHostLinks(rates=(cfg["rate1"], cfg["rate2"])) as links:
        results = run_local_workers(two_links_worker, 2, (cfg,), timeout_s=600, **links.launch_kwargs(2))
        sent = {link: links.sent_bytes(0, link) for link in links.interfaces}
    value = results[0].value
    value["rank0_sent_bytes"] = sent
    return value


# --------------------------------------------------------------------------- part 2: K at coverage rate ~3 vs DDP


def period_worker(rank: int, world_size: int, cfg: dict[str, Any]) -> dict[str, Any]:
    task = DigitsTask(batch_per_rank=cfg["batch"], lr=cfg["lr"])
    flat = {k: v.flatten(1) for k, v in task.data.items() if k.startswith("x")}
    task.data.update(flat)
    torch.manual_seed(cfg["seed"])
    base = mlp(width=cfg["width"], depth=cfg["depth"], inputs=64)
    nbytes = sum(p.numel() * p.element_size() for p in base.parameters())
    flat_ms = measure_allreduce(None, [nbytes], repeats=3, warmup=1)[0][1]
    total_steps = cfg["warmup"] + cfg["rounds"] * (cfg["block"] + 1)
    batches = task.batches(cfg["seed"], rank, world_size, total_steps)
    cursor = {}
    runners: dict[str, Callable] = {}
    models = {}
    steps = {}
    for name in cfg["variants"]:
        model = copy.deepcopy(base)
        optimizer = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9)
        models[name] = model
        cursor[name] = 0
        if name == "ddp":
            runners[name] = eager_step(nn.parallel.DistributedDataParallel(model), optimizer, F.cross_entropy)
        else:
            preserver = PreserverConfig() if name == "deft" else PreserverConfig(enabled=False)
            step = deft_compile(model, optimizer, F.cross_entropy, policy="deft", config=DeftConfig(preserver=preserver))
            runners[name] = steps[name] = step

    def batch_of(name):
        b = batches[cursor[name]]
        cursor[name] += 1
        return b

    samples = timed_rounds(runners, batch_of, cfg)
    for step in steps.values():
        step.flush()
    out: dict[str, Any] = {"samples_ms": samples}
    if rank == 0:
        out.update(params=sum(p.numel() for p in base.parameters()), bytes=nbytes, allreduce_all_ms=flat_ms,
                   trained_steps=dict(cursor), samples_per_variant={n: c * cfg["batch"] * world_size for n, c in cursor.items()},
                   final={n: task.evaluate(m) for n, m in models.items()},
                   steps={n: _step_record(s) for n, s in steps.items()})
    return out


def run_period(cfg: dict[str, Any]) -> dict[str, Any]:
    with ShapedLoopback(rate=cfg["rate"]) as lo:
        results = run_local_workers(period_worker, 2, (cfg,), timeout_s=600, **lo.launch_kwargs(2))
    return results[0].value


# --------------------------------------------------------------------------- report


def medians(value: dict[str, Any]) -> dict[str, float]:
    return {n: statistics.median(s) for n, s in value["samples_ms"].items()}


def report_two_links(value: dict[str, Any]) -> dict[str, Any]:
    med = medians(value)
    out = {"median_ms": med}
    if "deft-1link" in med and "deft-2links" in med:
        out["speedup_2links_over_1link"] = med["deft-1link"] / med["deft-2links"]
    if "ddp" in med:
        out["speedup_over_ddp"] = {n: med["ddp"] / m for n, m in med.items() if n != "ddp"}
    out["coverage_rate_link1"] = {n: value["allreduce_all_link1_ms"] / s["compute_ms"] for n, s in value["steps"].items()}
    return out


def report_period(value: dict[str, Any]) -> dict[str, Any]:
    med = medians(value)
    out: dict[str, Any] = {"median_ms": med, "final": value["final"]}
    for n in med:
        if n != "ddp" and "ddp" in med:
            out[f"speedup_{n}_over_ddp"] = med["ddp"] / med[n]
            out[f"accuracy_cost_{n}_points"] = value["final"]["ddp"]["test_accuracy"] - value["final"][n]["test_accuracy"]
    compute = next(iter(value["steps"].values()))["compute_ms"] if value["steps"] else None
    if compute:
        out["coverage_rate_measured"] = value["allreduce_all_ms"] / compute
    return out


def print_plans(value: dict[str, Any]) -> None:
    for name, record in value["steps"].items():
        print(f"\n  {name}: links {[(l['name'], round(l['alpha_ms'], 2), round(l['beta_ms_per_byte'] * MiB, 2)) for l in record['profile_links']]} "
              f"(alpha ms, beta ms/MiB); compute T_F+T_B {record['compute_ms']:.1f} ms; "
              f"delayed {record['delayed_buckets']}/{record['buckets']} buckets, periodic {record['periodic_buckets']} (K<={record['max_period']})")
        for line in record["table"].splitlines():
            print("    " + line)
        for h in record["plan_history"]:
            print(f"    plan_history: step {h['step']}: {h['reason']} (delayed items {h['delayed_items']}, max K {h['max_period']})")


def _repeat(repeats: int, label: str, cfg: dict[str, Any], run: Callable, report: Callable,
            summary: Callable[[dict, dict], str]) -> list[dict[str, Any]]:
    """Run one part ``repeats`` times; a progress line per repeat, the plans after the first."""
    records = []
    for r in range(repeats):
        t0 = time.perf_counter()
        value = run(cfg)
        rep = report(value)
        records.append({"config": cfg, "report": rep, "raw": value})
        print(f"[{label}, repeat {r + 1}] median ms {({k: round(v, 1) for k, v in rep['median_ms'].items()})}; "
              f"{summary(value, rep)} ({time.perf_counter() - t0:.0f} s)", flush=True)
        if r == 0:
            print_plans(value)
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["two-links", "period", "both"], default="both")
    parser.add_argument("--repeats", type=int, default=2, help="repeat each measurement (shared CPU)")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--block", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps per variant first (tracing, profiling, every graph of a K cycle)")
    parser.add_argument("--allow-period", action="store_true", help="two-links part: let deft choose K too")
    parser.add_argument("--width", type=int, default=1024, help="two-links MLP width")
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16, help="two-links batch per rank (small: communication-bound)")
    parser.add_argument("--period-width", type=int, default=1024)
    parser.add_argument("--period-depth", type=int, default=3)
    parser.add_argument("--period-batch", type=int, default=128)
    parser.add_argument("--period-rounds", type=int, default=24)
    parser.add_argument("--period-variants", nargs="+", default=["ddp", "deft"], choices=["ddp", "deft", "deft-nopres"])
    parser.add_argument("--json", default=str(ROOT / "docs" / "img" / "links_speed.json"))
    args = parser.parse_args(argv)
    check_prerequisites()
    started = time.perf_counter()
    from deft_compile.tools.provenance import provenance, script_command
    record: dict[str, Any] = {"command": script_command(__file__, argv),
                              "two_links": [], "period": []}

    record["provenance"] = provenance(command=record["command"])
    if args.part in ("two-links", "both"):
        cfg = {"inputs": args.width, "width": args.width, "depth": args.depth, "batch": args.batch,
               "bucket_cap_mb": 4.0, "allow_period": args.allow_period, "rate1": "1gbit", "rate2": "500mbit",
               "variants": ["ddp", "deft-1link", "deft-2links"], "warmup": args.warmup, "rounds": args.rounds,
               "block": args.block}
        record["two_links"] = _repeat(args.repeats, "two links", cfg, run_two_links, report_two_links, lambda value, rep: (
            f"deft 2 links / 1 link speedup {rep.get('speedup_2links_over_1link', float('nan')):.2f}x; "
            f"CR on link1 {({k: round(v, 2) for k, v in rep['coverage_rate_link1'].items()})}; "
            f"rank 0 sent {({k: f'{v / MiB:.0f} MiB' for k, v in value['rank0_sent_bytes'].items()})}"))
    if args.part in ("period", "both"):
        cfg = {"width": args.period_width, "depth": args.period_depth, "batch": args.period_batch, "lr": 0.05,
               "seed": 0, "rate": "1gbit", "variants": args.period_variants, "warmup": args.warmup,
               "rounds": args.period_rounds, "block": args.block}
        record["period"] = _repeat(args.repeats, "K vs DDP on shaped lo 1 Gbit/s", cfg, run_period, report_period,
                                   lambda value, rep: (
            "; ".join(f"{k} {v:.2f}" for k, v in rep.items() if k.startswith(("speedup", "accuracy", "coverage")))
            + f"; final {({n: {k: round(x, 4) for k, x in f.items()} for n, f in rep['final'].items()})}; "
            f"steps trained {value['trained_steps']}"))
    record["elapsed_s"] = time.perf_counter() - started
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(record, indent=1))
    print(f"\nwrote {args.json} in {record['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
