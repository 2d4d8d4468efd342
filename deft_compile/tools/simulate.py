"""``deft-compile simulate``: compare the four policies on a paper-scale profile.

Why a separate module: the planner runs without torch, so this subcommand
must not import the torch-side CLI; ``deft_compile.tools.cli`` only calls
``add_parser`` and dispatches to ``args.func``.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from deft_compile.planner.plan import Profile
from deft_compile.planner.simulator import coverage_rate, simulate
from deft_compile.planner.solvers import solve
from deft_compile.planner.zoo_profiles import MODELS, build_profile, model_summary


@dataclass
class PolicyResult:
    """One row of the comparison table."""

    policy: str
    iteration_ms: float
    speedup_vs_wfbp: float
    exposed_comm_ms: float
    coverage_rate: float
    items: int
    plan_hash: str
    notes: str


def compare_policies(profile: Profile, *, deft_options: dict[str, Any] | None = None,
                     ablation: bool = False, trace_dir: Path | None = None) -> list[PolicyResult]:
    """Solve and simulate every policy on ``profile`` (plus DeFT without period if ``ablation``)."""
    # The scheduling policies the papers compare (DS-Sync changes the training semantics, not just timing).
    runs: list[tuple[str, str, dict[str, Any]]] = [(p, p, {}) for p in ("wfbp", "bytescheduler", "usbyte")]
    runs.append(("deft", "deft", dict(deft_options or {})))
    if ablation:
        runs.append(("deft (no period)", "deft", {**(deft_options or {}), "allow_period": False}))
    results: list[PolicyResult] = []
    wfbp_ms = None
    for label, policy, options in runs:
        plan = solve(profile, policy, **options)
        timeline = simulate(profile, plan)
        if wfbp_ms is None:
            wfbp_ms = timeline.iteration_ms
        meta = plan.metadata
        if policy == "bytescheduler":
            notes = f"partition {plan.options['partition_bytes'] // 1024} KiB, credit {plan.options['credit']}"
        elif policy == "usbyte":
            notes = f"split layer {plan.options['split_layer']}, scale {plan.options['scale']:g}"
        elif policy == "deft":
            notes = (f"delayed {meta.get('delayed_buckets', 0)}/{meta.get('buckets', len(plan.items))}"
                     f" (F {meta.get('forward_knapsack', 0)}, B {meta.get('backward_knapsack', 0)}),"
                     f" K={meta.get('period', 1)} on {meta.get('periodic_buckets', 0)}")
            if "fallback" in meta:
                notes += "; fell back to WFBP"
        else:
            notes = f"{len(plan.items)} DDP buckets"
        results.append(PolicyResult(
            policy=label, iteration_ms=timeline.iteration_ms,
            speedup_vs_wfbp=wfbp_ms / timeline.iteration_ms,
            exposed_comm_ms=timeline.exposed_comm_ms, coverage_rate=coverage_rate(profile, plan),
            items=len(plan.items), plan_hash=plan.hash(), notes=notes))
        if trace_dir is not None:
            trace_dir.mkdir(parents=True, exist_ok=True)
            name = label.replace(" ", "_").replace("(", "").replace(")", "")
            (trace_dir / f"{name}.trace.json").write_text(json.dumps(timeline.to_chrome_trace()))
    return results


def format_table(profile: Profile, results: list[PolicyResult]) -> str:
    """The printed comparison: a profile header, then one line per policy."""
    summary = model_summary(profile)
    link = profile.links[0]
    lines = [
        f"{profile.name}: {summary['params'] / 1e6:.1f}M params, {summary['grad_mb']:.0f} MB of "
        f"gradients, T_F {summary['forward_ms']:.1f} ms, T_B {summary['backward_ms']:.1f} ms, "
        f"update {summary['update_ms']:.2f} ms",
        "links: " + "; ".join(f"{l.name} (alpha {l.alpha_ms * 1000:.0f} us, "
                              f"{1 / l.beta_ms_per_byte / 1e6:.2f} GB/s effective)"
                              for l in profile.links),
        f"all-reduce of all gradients on link 0: {link.cost(profile.total_bytes):.1f} ms",
        "",
        f"{'policy':<18} {'iter ms':>9} {'speedup':>8} {'exposed ms':>11} {'CR':>6}  notes",
    ]
    for r in results:
        lines.append(f"{r.policy:<18} {r.iteration_ms:>9.2f} {r.speedup_vs_wfbp:>7.2f}x "
                     f"{r.exposed_comm_ms:>11.2f} {r.coverage_rate:>6.2f}  {r.notes}")
    return "\n".join(lines)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``simulate`` on an argparse subparsers object; sets ``func=run``."""
    parser = subparsers.add_parser(
        "simulate", help="compare WFBP, ByteScheduler, US-Byte and DeFT in simulation",
        description="Plan and simulate the four policies on an analytic A100 profile "
                    "(see deft_compile/planner/zoo_profiles.py for every assumption).")
    parser.add_argument("--model", choices=MODELS, default="resnet101")
    parser.add_argument("--gpus", type=int, default=16, help="total GPUs (default 16)")
    parser.add_argument("--gpus-per-node", type=int, default=4)
    parser.add_argument("--bandwidth", type=float, default=25.0,
                        help="inter-node NIC bandwidth per node, Gbit/s (default 25)")
    parser.add_argument("--intra-bandwidth", type=float, default=2000.0,
                        help="intra-node (NVLink) bandwidth, Gbit/s (default 2000)")
    parser.add_argument("--efficiency", type=float, default=0.4,
                        help="fraction of the 312 TFLOP/s A100 peak reached by matmuls (default 0.4)")
    parser.add_argument("--batch", type=int, default=None,
                        help="per-GPU batch (default: 64 images for CNNs, 8 x 1024 tokens for GPT-2)")
    parser.add_argument("--extra-link-bandwidth", type=float, default=0.0,
                        help="add a second (host NIC) link of this many Gbit/s for DeFT (default none)")
    parser.add_argument("--max-period", type=int, default=4, help="DeFT's largest update period K")
    parser.add_argument("--no-period", action="store_true", help="forbid DeFT's update period")
    parser.add_argument("--ablation", action="store_true", help="also show DeFT without period")
    parser.add_argument("--json", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument("--trace-dir", type=Path, default=None,
                        help="write one Chrome trace per policy into this folder")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Run the comparison described by ``args``; prints the table, returns 0."""
    profile = build_profile(args.model, gpus=args.gpus, gpus_per_node=args.gpus_per_node,
                            inter_gbps=args.bandwidth, intra_gbps=args.intra_bandwidth,
                            efficiency=args.efficiency, batch=args.batch,
                            extra_link_gbps=args.extra_link_bandwidth)
    deft_options = {"max_period": args.max_period, "allow_period": not args.no_period}
    results = compare_policies(profile, deft_options=deft_options, ablation=args.ablation,
                               trace_dir=args.trace_dir)
    print(format_table(profile, results))
    if args.json is not None:
        from deft_compile.tools.provenance import provenance

        payload = {"provenance": provenance(),
                   "model": args.model, "gpus": args.gpus, "gpus_per_node": args.gpus_per_node,
                   "bandwidth_gbps": args.bandwidth, "intra_bandwidth_gbps": args.intra_bandwidth,
                   "efficiency": args.efficiency, "profile": model_summary(profile),
                   "links": [l.to_dict() for l in profile.links],
                   "results": [asdict(r) for r in results]}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(payload, indent=2, sort_keys=True))
    return 0
