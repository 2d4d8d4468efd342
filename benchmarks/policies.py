"""Every scheduling policy on a real slow link, against torch DDP and the no-communication floor.

    sudo python benchmarks/policies.py [--rate 1gbit] [--rounds 3] [--block 10] [--json out.json] [--trace-dir DIR]

Needs root and iproute2 (``deft_compile.tools.netns``). Two workers run inside one
private network namespace whose ``lo`` is shaped with ``tc tbf`` (docs/LINKS.md),
one intra-op thread each (the launcher sets it). In the same processes, in
interleaved blocks, the same VGG-style CNN (conv stack + large fully-connected
layers, SGD with momentum) is trained by:

* ``floor``    the compiled step on a one-rank group (``dist.new_group([rank])``:
               ``resolve_group`` answers "local", so the same graph runs with no
               collective), both workers busy at once as in every other run;
* ``eager``    plain eager training, no communication (how much the compiled step
               itself costs against eager);
* ``ddp``      torch ``DistributedDataParallel`` (eager, same bucket caps);
* ``wfbp``, ``bytescheduler``, ``usbyte``, ``deft``: ``deft_compile`` with that
               policy. Non-static policies profile on their first step (measured
               compute, link alpha/beta, agreed across ranks) and solve.

Warm-up steps (tracing, profiling, the first graph without carried state) are
discarded. Then ``--rounds`` rounds run one block of ``--block`` timed steps per
variant, in a rotated order each round; each block starts with a barrier (which
also drains collectives a previous block left in flight) and one untimed step.
A step's time is the slower rank's.

Reported per variant: median step ms, ratio to the floor, ratio to DDP, and for
the compiled policies the simulator's iteration time for that policy's plan on
that policy's own measured profile, with its error against the measured step.
``wfbp`` plans without measuring (its profile has zero times), so its plan, and
DDP's schedule, are simulated on the DeFT step's measured profile. The coverage
rate is an all-reduce of every gradient (one flat tensor, timed on the shaped
link) over the floor's step time. Quote ratios, not milliseconds.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from deft_compile import DeftConfig, deft_compile
from deft_compile.tools.emulation import new_group
from deft_compile.tools.bench import eager_step, quantile
from deft_compile.tools.launcher import run_local_workers
from deft_compile.tools.netns import ShapedLoopback, check_prerequisites
from deft_compile.planner.plan import Plan, Profile
from deft_compile.planner.link_fit import fit_alpha_beta
from deft_compile.step.profiler import measure_allreduce
from deft_compile.planner.simulator import coverage_rate, simulate

MiB = 1 << 20
COMPILED = ("wfbp", "bytescheduler", "usbyte", "deft")
STATIC = ("wfbp",)  # policies whose plan needs no measurement (PolicyRuntime.needs_profile in deft_compile.step.policy_runtime)
VARIANTS = ("floor", "eager", "ddp", *COMPILED)


# --------------------------------------------------------------------------- model


def vgg(width: int, fc: int, image: int, classes: int = 10) -> nn.Sequential:
    """VGG-style: four stages of two 3x3 convs + max-pool, then three fully-connected layers."""
    channels = [width, 2 * width, 4 * width, 4 * width]
    layers: list[nn.Module] = []
    c_in = 3
    for c_out in channels:
        layers += [nn.Conv2d(c_in, c_out, 3, padding=1), nn.ReLU(), nn.Conv2d(c_out, c_out, 3, padding=1), nn.ReLU(),
                   nn.MaxPool2d(2)]
        c_in = c_out
    features = c_in * (image // 16) ** 2
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(features, fc), nn.ReLU(), nn.Linear(fc, fc), nn.ReLU(),
                         nn.Linear(fc, classes))


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


# --------------------------------------------------------------------------- worker (one per rank, in the namespace)


def _renice(niceness: int) -> None:
    """Set the nice value of every thread of this process (Linux nice is per thread; later threads inherit it)."""
    for tid in os.listdir("/proc/self/task"):
        os.setpriority(os.PRIO_PROCESS, int(tid), niceness)


def _cpu_jiffies(pids: list[int]) -> tuple[int, int]:
    """(busy jiffies of the whole machine incl. steal, jiffies of the processes ``pids``)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    ours = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read().rsplit(")", 1)[1].split()
        ours += int(stat[11]) + int(stat[12])  # utime, stime (fields 14, 15)
    return user + nice + system + irq + softirq + steal, ours


class _ForeignLoad:
    """CPU cores used by everything except our workers while a block runs (other jobs, or steal by the host)."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.tick = os.sysconf("SC_CLK_TCK")

    def __enter__(self) -> "_ForeignLoad":
        self.start = (time.perf_counter(), *_cpu_jiffies(self.pids))
        return self

    def __exit__(self, *exc: Any) -> None:
        end = (time.perf_counter(), *_cpu_jiffies(self.pids))
        wall = end[0] - self.start[0]
        foreign = (end[1] - self.start[1]) - (end[2] - self.start[2])
        self.cores = max(0.0, foreign / self.tick / wall) if wall > 0 else 0.0


def vgg_setup(rank: int, cfg: dict[str, Any]) -> tuple[nn.Module, torch.Tensor, torch.Tensor, int]:
    """The benchmark's VGG-style model (seed 0, the same on every rank), this rank's fixed batch, gradient bytes."""
    torch.manual_seed(0)
    base = vgg(cfg["width"], cfg["fc"], cfg["image"])
    data = torch.Generator().manual_seed(1000 + rank)
    inputs = torch.randn(cfg["batch"], 3, cfg["image"], cfg["image"], generator=data)
    targets = torch.randint(0, 10, (cfg["batch"],), generator=data)
    return base, inputs, targets, sum(p.numel() * p.element_size() for p in base.parameters())


def worker(rank: int, world_size: int, cfg: dict[str, Any]) -> dict[str, Any]:
    if cfg["nice"] is not None:
        _renice(cfg["nice"])
    base, inputs, targets, total_bytes = vgg_setup(rank, cfg)
    # Every rank creates every one-rank group (new_group is collective); each uses its own.
    solo = [new_group(ranks=[r]) for r in range(world_size)][rank]

    # The link, before any training: an all-reduce of all gradients as one flat tensor, and a fit.
    flat = measure_allreduce(None, [total_bytes], repeats=cfg["link_repeats"], warmup=1)[0][1]
    fit_sizes = [1 << 16, 1 << 20, 4 << 20, 16 << 20]
    alpha, beta = fit_alpha_beta(measure_allreduce(None, fit_sizes, repeats=3, warmup=1))

    runners: dict[str, Any] = {}
    steps: dict[str, Any] = {}
    caps = dict(bucket_cap_mb=cfg["bucket_cap_mb"], first_bucket_mb=cfg["first_bucket_mb"])
    for name in cfg["variants"]:
        model = copy.deepcopy(base)
        optimizer = make_optimizer(model)
        if name == "eager":
            runners[name] = eager_step(model, optimizer, F.cross_entropy)
        elif name == "ddp":
            ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cfg["bucket_cap_mb"])
            runners[name] = eager_step(ddp, optimizer, F.cross_entropy)
        elif name == "floor":
            step = deft_compile(model, optimizer, F.cross_entropy, policy="wfbp", process_group=solo)
            assert step.world_size == 1, "a one-rank group must mean local training"
            runners[name] = step
        else:
            options = {"allow_period": False} if name == "deft" else {}
            step = deft_compile(model, optimizer, F.cross_entropy, policy=name,
                                config=DeftConfig(plan_options=options, **caps))
            runners[name] = steps[name] = step

    progress = None
    if rank == 0 and cfg["progress"]:
        from tqdm import tqdm

        total = len(runners) * (cfg["warmup"] + cfg["rounds"] * (cfg["block"] + 1))
        progress = tqdm(total=total, desc="steps", unit="step", file=sys.stderr, dynamic_ncols=True)

    pids: list[Any] = [None] * world_size
    dist.all_gather_object(pids, os.getpid())
    warmup_s: dict[str, float] = {}
    warmup_foreign: dict[str, float] = {}
    for name, run in runners.items():
        if progress is not None:
            progress.set_postfix_str(f"warm-up {name}")
        dist.barrier()
        started = time.perf_counter()
        with _ForeignLoad(pids) as load:
            for _ in range(cfg["warmup"]):
                run(inputs, targets)
                if progress is not None:
                    progress.update()
        warmup_s[name] = time.perf_counter() - started
        warmup_foreign[name] = load.cores

    names = list(runners)
    samples: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [0.0, 0.0] for name in names}  # main-thread CPU s, wall s
    foreign: dict[str, list[float]] = {name: [] for name in names}  # per block, rank 0's view of the machine
    for round_index in range(cfg["rounds"]):
        order = names[round_index % len(names):] + names[: round_index % len(names)]
        for name in order:
            run = runners[name]
            if progress is not None:
                progress.set_postfix_str(f"round {round_index + 1}/{cfg['rounds']} {name}")
            dist.barrier()
            run(inputs, targets)  # absorbs whatever the previous block left on the link
            if progress is not None:
                progress.update()
            cpu_started, block_started = time.thread_time(), time.perf_counter()
            with _ForeignLoad(pids) as load:
                for _ in range(cfg["block"]):
                    started = time.perf_counter()
                    run(inputs, targets)
                    samples[name].append((time.perf_counter() - started) * 1e3)
                    if progress is not None:
                        progress.update()
            foreign[name].append(load.cores)
            cpu[name][0] += time.thread_time() - cpu_started
            cpu[name][1] += time.perf_counter() - block_started
    if progress is not None:
        progress.close()
    dist.barrier()
    # A step's time is the slower rank's.
    for name in names:
        times = torch.tensor(samples[name], dtype=torch.float64)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        samples[name] = times.tolist()
    for step in steps.values():
        if step.pending:
            step.flush()

    # Share of the wall time the training thread got a core (1.0 = never starved; lower: waiting or preempted).
    busy = {name: cpu[name][0] / cpu[name][1] for name in names}
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, busy)
    result: dict[str, Any] = {"samples_ms": samples, "warmup_s": warmup_s, "foreign_cores": foreign,
                              "warmup_foreign_cores": warmup_foreign,
                              "thread_busy": {name: [g[name] for g in gathered] for name in names}}
    if rank == 0:
        result.update(
            total_bytes=total_bytes,
            params=sum(p.numel() for p in base.parameters()),
            allreduce_all_ms=flat,
            link_fit={"alpha_ms": alpha, "beta_ms_per_mib": beta * MiB},
            plans={n: s.plan.to_json() for n, s in steps.items()},
            profiles={n: s.profile.to_json() for n, s in steps.items()},
            traces={n: s.trace_count for n, s in steps.items()},
        )
    return result


# --------------------------------------------------------------------------- report (parent)


def analyse(value: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any]:
    samples = value["samples_ms"]
    block, threshold = cfg["block"], cfg["quiet_threshold"]
    quiet_samples = {n: [x for b, f in enumerate(value["foreign_cores"][n]) if f < threshold
                         for x in s[b * block:(b + 1) * block]] for n, s in samples.items()}
    quiet_ok = all(len(q) >= 2 * block for q in quiet_samples.values())
    all_median = {n: statistics.median(s) for n, s in samples.items()}
    # The basis for ratios and prediction errors: steps of blocks during which other jobs used less than
    # `threshold` cores, when every variant has at least two such blocks; otherwise every step.
    median = {n: statistics.median(quiet_samples[n]) for n in samples} if quiet_ok else all_median
    floor = median.get("floor")
    ddp = median.get("ddp")
    # wfbp plans without measuring: its profile has zero times, so it is not a measured profile.
    profiles = {n: Profile.from_json(t) for n, t in value["profiles"].items() if n not in STATIC}
    plans = {n: Plan.from_json(t) for n, t in value["plans"].items()}
    # Profiles measured by the policies that profile; wfbp and DDP are simulated on DeFT's (or any measured one).
    reference = next((profiles[n] for n in ("deft", "usbyte", "bytescheduler") if n in profiles), None)
    rows: dict[str, Any] = {}
    timelines = {}
    for name in samples:
        row: dict[str, Any] = {
            "median_ms": median[name],
            "basis": "quiet blocks" if quiet_ok else "all blocks",
            "all_median_ms": all_median[name],
            "all_vs_floor": all_median[name] / all_median["floor"] if "floor" in all_median else None,
            "quiet_blocks": f"{len(quiet_samples[name]) // block}/{len(samples[name]) // block}",
            "foreign_cores": value["foreign_cores"][name],
            "warmup_foreign_cores": value["warmup_foreign_cores"][name],
            "mean_ms": statistics.fmean(samples[name]),
            "p10_ms": quantile(samples[name], 0.1),
            "p90_ms": quantile(samples[name], 0.9),
            "vs_floor": median[name] / floor if floor else None,
            "vs_ddp": median[name] / ddp if ddp else None,
            "warmup_s": value["warmup_s"][name],
            "thread_busy": value["thread_busy"][name],
            "paired_vs_floor": _paired(samples, name, "floor", cfg["block"]),
            "paired_vs_ddp": _paired(samples, name, "ddp", cfg["block"]),
        }
        plan = plans.get(name) or (plans.get("wfbp") if name == "ddp" else None)
        if name in STATIC or name == "ddp":
            plan = _with_profile(plan, reference)
        profile = profiles.get(name) if name in profiles else reference
        if plan is not None and profile is not None:
            timeline = simulate(profile, plan)
            timelines[name] = timeline
            scaled = simulate(_scaled(profile, floor / _floor_ms(profile)), plan, record=False) if floor else None
            row.update(
                predicted_ms=timeline.iteration_ms,
                prediction_error=(timeline.iteration_ms - median[name]) / median[name],
                profile_compute_ms=_floor_ms(profile),
                rescaled_predicted_ms=scaled.iteration_ms if scaled else None,
                rescaled_prediction_error=(scaled.iteration_ms - median[name]) / median[name] if scaled else None,
                simulated_on="own profile" if name in profiles else "deft's profile",
                sim_compute_ms=timeline.compute_ms,
                sim_exposed_ms=timeline.exposed_comm_ms,
                items=len(plan.items),
                delayed_items=sum(1 for item in plan.items if item.delay == 1),
            )
        elif name == "floor" and reference is not None:
            row.update(predicted_ms=_floor_ms(reference), simulated_on="deft's T_F+T_B+upd")
            row["prediction_error"] = (row["predicted_ms"] - median[name]) / median[name]
        rows[name] = row
    link = {
        "allreduce_all_ms": value["allreduce_all_ms"],
        "fit_alpha_ms": value["link_fit"]["alpha_ms"],
        "fit_beta_ms_per_mib": value["link_fit"]["beta_ms_per_mib"],
    }
    if reference is not None:
        cost = reference.links[0]
        link.update(profiler_alpha_ms=cost.alpha_ms, profiler_beta_ms_per_mib=cost.beta_ms_per_byte * MiB,
                    profiler_predicts_allreduce_all_ms=cost.cost(value["total_bytes"]))
    coverage = {
        "measured": value["allreduce_all_ms"] / floor if floor else None,
    }
    if reference is not None and "wfbp" in plans:
        coverage["simulator_wfbp_buckets"] = coverage_rate(reference, plans["wfbp"])
        coverage["profile_compute_ms"] = _floor_ms(reference)
    sizes_only = {n: Profile.from_json(t) for n, t in value["profiles"].items()}
    return {"rows": rows, "link": link, "coverage": coverage, "plans": plans, "profiles": profiles,
            "table_profiles": {n: profiles.get(n, reference) or sizes_only[n] for n in plans}, "timelines": timelines}


def _with_profile(plan: Plan | None, profile: Profile | None) -> Plan | None:
    """A static plan is valid on any measured profile of the same model (same parameters, same order)."""
    if plan is None or profile is None:
        return None
    plan.validate(profile)
    return plan


def _scaled(profile: Profile, factor: float) -> Profile:
    """The profile with every compute time times ``factor`` (links unchanged)."""
    data = profile.to_dict()
    for param in data["params"]:
        for key in ("forward_ms", "backward_ms", "update_ms"):
            param[key] *= factor
    data["extra_forward_ms"] *= factor
    data["extra_backward_ms"] *= factor
    return Profile.from_dict(data)


def _floor_ms(profile: Profile) -> float:
    return profile.forward_ms + profile.backward_ms + profile.update_ms


def _paired(samples: dict[str, list[float]], name: str, baseline: str, block: int) -> float | None:
    """Median over rounds of (this round's block median / the baseline's block median in the same round).

    Other jobs on the machine come and go within seconds; pairing blocks of the same round
    compares variants under (nearly) the same background load.
    """
    if baseline not in samples:
        return None
    ours, theirs = samples[name], samples[baseline]
    ratios = [statistics.median(ours[i:i + block]) / statistics.median(theirs[i:i + block])
              for i in range(0, min(len(ours), len(theirs)), block)]
    return statistics.median(ratios) if ratios else None


def print_report(value: dict[str, Any], report: dict[str, Any], cfg: dict[str, Any], elapsed: float) -> None:
    link, coverage, rows = report["link"], report["coverage"], report["rows"]
    print(f"\nmodel: VGG-style width={cfg['width']} fc={cfg['fc']} image={cfg['image']} batch={cfg['batch']}/rank, "
          f"{value['params'] / 1e6:.2f} M parameters, {value['total_bytes'] / MiB:.1f} MiB of gradients; "
          f"SGD momentum; 2 workers, 1 thread each")
    print(f"link: tbf {cfg['rate']} on a shared lo; all-reduce of all gradients {link['allreduce_all_ms']:.1f} ms; "
          f"fit alpha {link['fit_alpha_ms']:.2f} ms, beta {link['fit_beta_ms_per_mib']:.2f} ms/MiB")
    if "profiler_alpha_ms" in link:
        print(f"profiler's link (probes <= 4 MiB): alpha {link['profiler_alpha_ms']:.2f} ms, beta "
              f"{link['profiler_beta_ms_per_mib']:.2f} ms/MiB -> predicts {link['profiler_predicts_allreduce_all_ms']:.1f} ms "
              f"for all gradients")
    if coverage.get("measured") is not None:
        extra = ""
        if "simulator_wfbp_buckets" in coverage:
            extra = (f"; simulator CR (wfbp buckets / T_F+T_B of DeFT's profile) {coverage['simulator_wfbp_buckets']:.2f}, "
                     f"profiled compute {coverage['profile_compute_ms']:.1f} ms")
        print(f"coverage rate (all-reduce of all gradients / floor step): {coverage['measured']:.2f}{extra}")
    print()
    basis = next(iter(rows.values()))["basis"]
    print(f"ratios and prediction errors use the steps of {basis} (other jobs < {cfg['quiet_threshold']} cores); "
          f"'all' and 'paired' use every step")
    header = (f"{'variant':<14}{'median ms':>10}{'quiet':>7}{'vs floor':>9}{'vs DDP':>8}{'all':>7}{'paired':>8}"
              f"{'sim ms':>8}{'sim err':>9}{'rescaled':>9}  simulated on (other jobs' cores while profiling)")
    print(header)
    print("-" * len(header))
    for name, row in rows.items():
        def fmt(key: str, pattern: str = "{:.2f}") -> str:
            return pattern.format(row[key]) if row.get(key) is not None else "-"

        where = row.get("simulated_on", "")
        if name in report["profiles"]:
            where += f" ({row['warmup_foreign_cores']:.1f})"
        print(f"{name:<14}{row['median_ms']:>10.1f}{row['quiet_blocks']:>7}{fmt('vs_floor'):>9}{fmt('vs_ddp'):>8}"
              f"{fmt('all_vs_floor'):>7}{fmt('paired_vs_floor'):>8}{fmt('predicted_ms', '{:.1f}'):>8}"
              f"{fmt('prediction_error', '{:+.1%}'):>9}{fmt('rescaled_prediction_error', '{:+.1%}'):>9}  {where}")
    print()
    targets = []
    if "deft" in rows and rows["deft"]["vs_floor"]:
        r = rows["deft"]["vs_floor"]
        targets.append(f"deft / floor = {r:.3f} on {basis} (target <= 1.15): {'met' if r <= 1.15 else 'NOT met'}")
    if "ddp" in rows and rows["ddp"]["vs_floor"]:
        targets.append(f"ddp / floor = {rows['ddp']['vs_floor']:.3f} on {basis} "
                       f"(DDP above the floor by {100 * (rows['ddp']['vs_floor'] - 1):.0f} %)")
    errors = {n: r["prediction_error"] for n, r in rows.items() if n in (*COMPILED, "ddp") and "prediction_error" in r}
    if errors:
        worst = max(errors, key=lambda n: abs(errors[n]))
        ok = all(abs(e) <= 0.20 for e in errors.values())
        targets.append(f"simulator within 20 % for every policy: {'met' if ok else 'NOT met'} "
                       f"(worst {worst} {100 * errors[worst]:+.1f} %)")
    print("targets:\n  " + "\n  ".join(targets))
    print("(quiet: blocks with other jobs below the threshold / all blocks; all: every step's median over the floor's;\n"
          " paired: median over rounds of the block-median ratio to the floor's block in the same round;\n"
          " sim err: the policy's plan simulated on its measured profile; rescaled: the same with every compute time\n"
          " scaled so the profile's compute equals this run's measured floor, i.e. the error left once compute\n"
          " contention during profiling is taken out; the JSON also has each rank's main-thread CPU / wall time.)")
    print(f"\nwall time {elapsed:.0f} s; load average (1 min) {cfg['load'][0]:.2f} before, {cfg['load'][1]:.2f} after "
          f"on {os.cpu_count()} CPUs")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--rate", default="1gbit", help="tbf rate of the namespace's lo (shared by both workers)")
    parser.add_argument("--burst", default="128kb")
    parser.add_argument("--latency", default="20ms")
    parser.add_argument("--width", type=int, default=32, help="channels of the first conv stage (then 2x, 4x, 4x)")
    parser.add_argument("--fc", type=int, default=1280, help="width of the two hidden fully-connected layers")
    parser.add_argument("--image", type=int, default=32, help="input image side")
    parser.add_argument("--batch", type=int, default=48, help="per-rank batch size")
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP and deft_compile bucket cap")
    parser.add_argument("--first-bucket-mb", type=float, default=1.0, help="deft_compile first bucket (DDP: 1 MiB, fixed)")
    parser.add_argument("--warmup", type=int, default=3, help="discarded steps per variant (trace, profile, carries)")
    parser.add_argument("--rounds", type=int, default=8, help="rounds of interleaved blocks")
    parser.add_argument("--block", type=int, default=4, help="timed steps per block")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of " + ",".join(VARIANTS))
    parser.add_argument("--link-repeats", type=int, default=5, help="repeats of the all-gradients all-reduce")
    parser.add_argument("--quiet-threshold", type=float, default=0.3,
                        help="a block is quiet when other processes (and host steal) used fewer cores than this")
    parser.add_argument("--nice", type=int, default=None,
                        help="nice value for the workers (e.g. -10, root only): shields the measurement from other jobs "
                             "on a shared machine, at their expense; off by default")
    parser.add_argument("--json", help="write every number (samples, plans, profiles, predictions) here")
    parser.add_argument("--trace-dir", help="write a Chrome trace of each policy's simulated timeline here")
    parser.add_argument("--no-plans", action="store_true", help="do not print the plan tables")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before the workers are killed")
    args = parser.parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    cfg = {k: getattr(args, k) for k in ("rate", "width", "fc", "image", "batch", "bucket_cap_mb", "first_bucket_mb",
                                          "warmup", "rounds", "block", "link_repeats", "quiet_threshold")}
    cfg.update(variants=variants, progress=not args.no_progress, nice=args.nice)
    if cfg["warmup"] < 3 and any(v in COMPILED for v in variants):
        print("note: fewer than 3 warm-up steps times the second trace of delayed plans", file=sys.stderr)

    check_prerequisites()
    load_before = os.getloadavg()
    started = time.perf_counter()
    with ShapedLoopback(name_prefix="deftpol", rate=args.rate, burst=args.burst, latency=args.latency) as lo:
        results = run_local_workers(worker, 2, (cfg,), timeout_s=args.timeout, collective_timeout_s=120.0,
                                    **lo.launch_kwargs(2))
    elapsed = time.perf_counter() - started
    load_after = os.getloadavg()
    value = results[0].value
    cfg["load"] = (load_before[0], load_after[0])
    report = analyse(value, cfg)
    if not args.no_plans:
        for name, plan in report["plans"].items():
            print(f"\n== plan: {name}")
            print(plan.table(report["table_profiles"][name]))
    print_report(value, report, cfg, elapsed)
    if args.trace_dir:
        directory = Path(args.trace_dir)
        directory.mkdir(parents=True, exist_ok=True)
        for name, timeline in report["timelines"].items():
            (directory / f"{name}.trace.json").write_text(json.dumps(timeline.to_chrome_trace()))
        print(f"Chrome traces of the simulated timelines in {directory}/")
    if args.json:
        from deft_compile.tools.provenance import provenance

        payload = {
            "provenance": provenance(),
            "config": {**cfg, "burst": args.burst, "latency": args.latency, "cpus": os.cpu_count(),
                       "torch": torch.__version__},
            "wall_s": elapsed,
            "params": value["params"],
            "gradient_bytes": value["total_bytes"],
            "link": report["link"],
            "coverage": report["coverage"],
            "results": report["rows"],
            "samples_ms": value["samples_ms"],
            "plans": {n: json.loads(p.to_json()) for n, p in report["plans"].items()},
            "profiles": {n: json.loads(p.to_json()) for n, p in report["profiles"].items()},
            "trace_counts": value["traces"],
        }
        Path(args.json).write_text(json.dumps(payload, indent=1))
        print(f"results written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
