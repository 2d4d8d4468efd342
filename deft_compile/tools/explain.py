"""``deft-compile explain``: trace a preset model on this process, profile it, and show every policy's plan.

No cluster is needed: the step is captured and its compute timed here, on one
process (``deft_compile.step.profiler.profile_model``), and the network is a
*modelled* link (ring all-reduce over ``--world-size`` ranks at
``--bandwidth`` Gbit/s with latency ``--alpha-ms``). The real runtime measures
its link by timing all-reduces on the process group; explain cannot, and says
so in its output. Each policy is then solved with the options the runtime
uses by default (DDP bucket sizes, solver defaults) and simulated.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from deft_compile.planner.plan import LinkCost, Plan, Profile

POLICY_NAMES = ("wfbp", "bytescheduler", "usbyte", "deft")


@dataclass
class Explained:
    """One policy's result as printed in the summary table."""

    policy: str
    iteration_ms: float
    speedup_vs_wfbp: float | None
    exposed_comm_ms: float
    coverage_rate: float
    items: int
    plan_hash: str
    notes: str


def modelled_link(world_size: int, bandwidth_gbps: float, alpha_ms: float) -> LinkCost:
    """Ring all-reduce over ``world_size`` ranks: each rank sends 2(N-1)/N of the buffer at ``bandwidth_gbps``."""
    if world_size < 2:
        raise ValueError("the link model needs --world-size >= 2 (a single process never communicates)")
    if bandwidth_gbps <= 0 or alpha_ms < 0:
        raise ValueError("--bandwidth must be positive and --alpha-ms non-negative")
    bytes_per_ms = bandwidth_gbps * 1e9 / 8 / 1e3
    beta = 2.0 * (world_size - 1) / world_size / bytes_per_ms
    return LinkCost(f"modelled ring x{world_size} {bandwidth_gbps:g} Gbit/s", alpha_ms, beta)


def solver_options(policy: str, *, first_bucket_bytes: int, bucket_cap_bytes: int,
                   allow_period: bool = True) -> dict[str, Any]:
    """The options ``CompiledStep.solver_options`` passes to ``solve`` (DDP bucket sizes), plus ``--no-period``."""
    options: dict[str, Any] = {}
    if policy in ("wfbp", "deft"):
        options["first_bucket_bytes"] = first_bucket_bytes
        options["bucket_cap_bytes"] = bucket_cap_bytes
    if policy == "deft" and not allow_period:
        options["allow_period"] = False
    return options


def _notes(plan: Plan) -> str:
    meta, options = plan.metadata, plan.options
    if plan.policy == "bytescheduler" and "partition_bytes" in options:
        return f"partition {options['partition_bytes'] // 1024} KiB, credit {options.get('credit')}"
    if plan.policy == "usbyte" and "split_layer" in options:
        return f"split layer {options['split_layer']}, scale {options.get('scale', 1):g}"
    if plan.policy == "deft":
        text = (f"delayed {meta.get('delayed_buckets', 0)}/{meta.get('buckets', len(plan.items))} buckets"
                f" (F {meta.get('forward_knapsack', 0)}, B {meta.get('backward_knapsack', 0)}),"
                f" K={meta.get('period', 1)}")
        return text + ("; fell back to WFBP" if "fallback" in meta else "")
    return f"{len(plan.items)} DDP buckets"


def explain_profile(profile: Profile, policies: list[str], *, first_bucket_bytes: int, bucket_cap_bytes: int,
                    allow_period: bool = True, dump: Path | None = None
                    ) -> list[tuple[Explained, Plan, Any]]:
    """Solve and simulate each policy; with ``dump`` write ``dump/<policy>/`` artifacts. Returns (row, plan, timeline)."""
    from deft_compile.debug.artifacts import log_structured, write_plan_artifacts
    from deft_compile.planner.simulator import coverage_rate, simulate
    from deft_compile.planner.solvers import solve

    results = []
    wfbp_ms = None
    if "wfbp" in policies:
        order = ["wfbp"] + [p for p in policies if p != "wfbp"]
    else:
        order = list(policies)
        wfbp_plan = solve(profile, "wfbp", **solver_options("wfbp", first_bucket_bytes=first_bucket_bytes,
                                                            bucket_cap_bytes=bucket_cap_bytes))
        wfbp_ms = simulate(profile, wfbp_plan, record=False).iteration_ms
    for policy in order:
        plan = solve(profile, policy, **solver_options(policy, first_bucket_bytes=first_bucket_bytes,
                                                        bucket_cap_bytes=bucket_cap_bytes,
                                                        allow_period=allow_period))
        timeline = simulate(profile, plan)
        log_structured(f"explain_plan_{policy}", plan.to_dict)
        if policy == "wfbp":
            wfbp_ms = timeline.iteration_ms
        row = Explained(policy=policy, iteration_ms=timeline.iteration_ms,
                        speedup_vs_wfbp=wfbp_ms / timeline.iteration_ms if wfbp_ms and timeline.iteration_ms else None,
                        exposed_comm_ms=timeline.exposed_comm_ms, coverage_rate=coverage_rate(profile, plan),
                        items=len(plan.items), plan_hash=plan.hash()[:12], notes=_notes(plan))
        if dump is not None:
            write_plan_artifacts(dump / policy, profile, plan, timeline=timeline)
        results.append((row, plan, timeline))
    return results


def format_summary(rows: list[Explained]) -> str:
    lines = [f"{'policy':<14} {'iter ms':>9} {'vs wfbp':>8} {'exposed ms':>11} {'CR':>6} {'items':>6}  "
             f"{'hash':<12}  notes"]
    for r in rows:
        speedup = f"{r.speedup_vs_wfbp:.2f}x" if r.speedup_vs_wfbp is not None else "-"
        lines.append(f"{r.policy:<14} {r.iteration_ms:>9.3f} {speedup:>8} {r.exposed_comm_ms:>11.3f} "
                     f"{r.coverage_rate:>6.2f} {r.items:>6}  {r.plan_hash:<12}  {r.notes}")
    return "\n".join(lines)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``explain`` on an argparse subparsers object; sets ``func=run``."""
    from deft_compile.tools.presets import PRESET_NAMES

    parser = subparsers.add_parser(
        "explain", help="trace and profile a preset model on this process; print every policy's plan",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=PRESET_NAMES, default="mlp",
                        help="preset (cnn = vgg, transformer = gpt2; see deft_compile/tools/presets.py)")
    parser.add_argument("--policy", action="append", choices=POLICY_NAMES, default=None,
                        help="policy to explain; repeat for several (default: all four)")
    parser.add_argument("--world-size", type=int, default=4,
                        help="data-parallel ranks assumed by the link model (default 4)")
    parser.add_argument("--bandwidth", type=float, default=10.0,
                        help="modelled link bandwidth per rank, Gbit/s (default 10)")
    parser.add_argument("--alpha-ms", type=float, default=0.1, help="modelled all-reduce latency, ms (default 0.1)")
    parser.add_argument("--extra-link-bandwidth", type=float, default=0.0,
                        help="add a second modelled link of this many Gbit/s (DeftConfig.links; DeFT may split "
                             "buckets over both), default none")
    parser.add_argument("--extra-link-alpha-ms", type=float, default=0.2,
                        help="latency of the second link, ms (default 0.2)")
    parser.add_argument("--batch", type=int, default=None, help="per-rank batch (default: the preset's)")
    parser.add_argument("--bucket-cap-mb", type=float, default=None, help="DDP bucket cap (default 25)")
    parser.add_argument("--first-bucket-mb", type=float, default=None, help="DDP first bucket cap (default 1)")
    parser.add_argument("--no-period", action="store_true",
                        help="forbid DeFT's update period K > 1 (as DeftConfig(plan_options={'allow_period': False}))")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of the step per node (median)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dump", type=Path, default=None,
                        help="write plan.txt/plan.json/profile.json/timeline_simulated.{json,png} per policy here")
    parser.add_argument("--json", type=Path, default=None, help="write the summary as JSON here")
    parser.add_argument("--no-tables", action="store_true", help="print the summary only")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Trace, profile, solve and print; returns 0."""
    import torch

    from deft_compile.debug.artifacts import ascii_timeline, describe_timeline, log_structured
    from deft_compile.planner.bucketing import MiB
    from deft_compile.config import DeftConfig
    from deft_compile.tools.presets import get_preset
    from deft_compile.step.profiler import profile_model

    config = DeftConfig(**{k: v for k, v in (("bucket_cap_mb", args.bucket_cap_mb),
                                             ("first_bucket_mb", args.first_bucket_mb)) if v is not None})
    policies = list(dict.fromkeys(args.policy or POLICY_NAMES))
    try:
        link = modelled_link(args.world_size, args.bandwidth, args.alpha_ms)
        links = [link]
        if args.extra_link_bandwidth > 0:
            links.append(modelled_link(args.world_size, args.extra_link_bandwidth, args.extra_link_alpha_ms))
    except ValueError as exc:
        print(f"deft-compile explain: {exc}", file=sys.stderr)
        return 2
    preset = get_preset(args.model)
    batch = args.batch or preset.default_batch
    model, optimizer, loss_fn, call_args, call_kwargs = preset.make(seed=args.seed, batch_size=args.batch)
    profile = profile_model(model, optimizer, loss_fn, call_args, call_kwargs, measure=True, links=links,
                            world_size=args.world_size, repeats=args.repeats)
    profile.name = f"{preset.name} b{batch} x{args.world_size}"
    log_structured("explain_profile", profile.to_dict)

    numel = sum(p.numel for p in profile.params)
    print(f"model: {preset.name} - {preset.description}, batch {batch} per rank")
    print(f"  {numel / 1e6:.2f}M parameters in {len(profile.params)} tensors, "
          f"{profile.total_bytes / MiB:.2f} MiB of gradients, "
          f"{len(profile.buckets(config.first_bucket_bytes, config.bucket_cap_bytes))} DDP buckets "
          f"(first {config.first_bucket_mb:g} MiB, cap {config.bucket_cap_mb:g} MiB)")
    print(f"compute: traced and timed on this process ({torch.get_num_threads()} intra-op threads, median of "
          f"{args.repeats}): T_F {profile.forward_ms:.3f} ms, T_B {profile.backward_ms:.3f} ms, "
          f"update {profile.update_ms:.3f} ms")
    print("link: MODELLED, not measured - explain runs without a cluster, so it cannot time all-reduces.")
    print(f"  ring all-reduce over {args.world_size} ranks at {args.bandwidth:g} Gbit/s, alpha "
          f"{args.alpha_ms:g} ms: {link.cost(profile.total_bytes):.3f} ms for all gradients "
          f"(the runtime measures its link on the real process group instead)")
    for extra in links[1:]:
        print(f"  second link: {extra.name}, alpha {extra.alpha_ms:g} ms: "
              f"{extra.cost(profile.total_bytes):.3f} ms for all gradients")
    print()
    results = explain_profile(profile, policies, first_bucket_bytes=config.first_bucket_bytes,
                              bucket_cap_bytes=config.bucket_cap_bytes, allow_period=not args.no_period,
                              dump=args.dump)
    print(format_summary([row for row, _, _ in results]))
    if not args.no_tables:
        for row, plan, timeline in results:
            print()
            print(f"== {row.policy} ==")
            print(plan.table(profile))
            print(describe_timeline(profile, plan, timeline, row.coverage_rate))
            print("one steady-state iteration (F forward, L loss, B backward, U update, . idle; "
                  "link cells: plan item id):")
            print(ascii_timeline(timeline))
    if args.dump is not None:
        print()
        print(f"artifacts: {args.dump}/<policy>/plan.txt, plan.json, profile.json, timeline_simulated.json "
              f"(open in https://ui.perfetto.dev), timeline_simulated.png")
    if args.json is not None:
        from deft_compile.tools.provenance import provenance

        payload = {"provenance": provenance(), "model": preset.name, "batch": batch, "world_size": args.world_size,
                   "bandwidth_gbps": args.bandwidth, "alpha_ms": args.alpha_ms, "link_modelled": True,
                   "forward_ms": profile.forward_ms, "backward_ms": profile.backward_ms,
                   "update_ms": profile.update_ms, "gradient_bytes": profile.total_bytes,
                   "results": [asdict(row) for row, _, _ in results]}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(payload, indent=2, sort_keys=True))
    return 0
