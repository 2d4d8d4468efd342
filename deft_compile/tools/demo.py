"""``deft-compile demo``: torch DDP and deft_compile side by side on 2 local workers.

With no arguments and no cluster: 2 local gloo workers (one intra-op thread
each) train the ``mlp`` preset on a learnable synthetic task (labels from a
fixed linear teacher) with

* ``floor``: the same compiled step with no communication (one-rank groups);
* ``torch DDP``;
* ``torch.compile(DDP)``: DDP around ``torch.compile(model)``, Inductor, the eager optimizer;
* ``deft_compile wfbp``: DDP's schedule compiled: DDP's parameters bit for bit on the aten route, to round-off on
  Inductor, within ``DRIFT_MULTIPLE`` times ``torch.compile(DDP)``'s own difference from DDP in the same run
  (``wfbp_check``; the demo fails beyond it);
* ``deft_compile deft``: the default policy with its default Preserver.

When this machine can make network namespaces (root and iproute2's ``ip`` and
``tc``), the workers run inside a private namespace whose loopback is shaped
to ``--bandwidth`` (default 3 Gbit/s), so communication costs what it would on
a slow link; otherwise they run on the unshaped loopback and the demo says so.
The namespace is deleted at the end, on error and on Ctrl-C.

It is ``deft_compile.tools.bench`` with a fixed selection: variants run in the same
processes in interleaved blocks, so the ratios compare like with like.
Exposed communication = mean step - mean floor step (measured, same run; the
"mean" is the median over interleaved blocks of each block's mean step time).
The timeline PNGs: deft's plan simulated on its measured profile
(``gantt_png(simulate(step.profile, step.plan))``) and a measured
``torch.profiler`` timeline of deft's steps on rank 0.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

DEMO_MODEL = "mlp-teacher"
DEMO_BANDWIDTH = "3gbit"
LABELS = {"floor": "no-communication floor", "ddp": "torch DDP", "ddp-compiled": "torch.compile(DDP)",
          "wfbp": "deft_compile wfbp", "deft": "deft_compile deft"}
#: On Inductor, ``wfbp``'s trained parameters may differ from DDP's (relative to each tensor's largest value) by this
#: many times ``torch.compile(DDP)``'s own difference from DDP on the same batches and steps: both are the same
#: computation with kernels that round differently from ATen's (fused multiply-adds, other summation orders), so they
#: differ by small factors, while a defect (a gradient missed, applied twice, a wrong scale) is off by an update's
#: size, orders of magnitude more. On the aten route ``wfbp`` is DDP's numbers bit for bit.
DRIFT_MULTIPLE = 10
#: the yardstick's floor: one float32 unit in the last place of a tensor's largest value, where torch.compile happens
#: to reproduce DDP's numbers exactly on this model and host
ULP_FLOOR = 2.0 ** -23


@dataclass
class DemoRow:
    name: str
    median_ms: float
    mean_ms: float | None
    speedup_vs_ddp: float | None
    exposed_ms: float | None
    loss: float | None  # mean over the last 5 of the first N steps, N the count every variant reached


def wfbp_check(run: dict[str, Any]) -> tuple[bool, str]:
    """Whether ``wfbp``'s parameters are within the bound of its compiler from DDP's, and the line saying so: bit for
    bit on the aten route; on Inductor within ``DRIFT_MULTIPLE`` times ``torch.compile(DDP)``'s difference from DDP
    measured in the same run (at least one float32 ulp, ``ULP_FLOOR``). Without that measurement an Inductor
    ``wfbp`` fails the check: there is nothing to bound it by."""
    compiler = run.get("wfbp_compiler") or "aten"
    relative = run.get("max_rel_diff_ddp_wfbp")
    if run.get("identical_ddp_wfbp") is None or relative is None:
        return True, "torch DDP and deft_compile wfbp: not both run"
    if compiler == "aten":
        bound, expect = 0.0, "bit-identical"
    else:
        yardstick = run.get("max_rel_diff_ddp_compiled")
        if yardstick is None:
            return False, (f"parameters of torch DDP and deft_compile wfbp ({compiler}): {relative:.2g} apart, and no "
                           "torch.compile(DDP) run to bound the round-off by: FAILED")
        bound = DRIFT_MULTIPLE * max(yardstick, ULP_FLOOR)
        expect = (f"within {DRIFT_MULTIPLE} x torch.compile(DDP)'s own difference from DDP ({yardstick:.2g}; round-off) "
                  f"= {bound:.2g} of each tensor's largest value")
    ok = relative <= bound
    measured = "bit-identical" if run["identical_ddp_wfbp"] else f"largest relative difference {relative:.2g}"
    return ok, (f"parameters of torch DDP and deft_compile wfbp ({compiler}) on every rank: {measured}; expected "
                f"{expect}: {'ok' if ok else 'FAILED'}")


def demo_rows(run: dict[str, Any]) -> list[DemoRow]:
    """Table rows from a ``deft_compile.tools.bench.run_config`` record."""
    rows = []
    for variant, row in run["rows"].items():
        rows.append(DemoRow(LABELS.get(variant, variant), row["median_ms"], row.get("step_ms"), row.get("speedup_vs_ddp"),
                            row.get("exposed_comm_ms"), row.get("loss_at_equal_steps")))
    return rows


def format_demo_table(rows: list[DemoRow], equal_steps: int | None = None) -> str:
    loss_header = f"loss @ {equal_steps}" if equal_steps else "loss"
    header = (f"{'run':<24}{'median step ms':>15}{'mean step ms':>13}{'speedup vs DDP':>16}{'exposed comm ms':>17}"
              f"{loss_header:>12}")
    lines = [header, "-" * len(header)]
    for row in rows:
        speedup = f"{row.speedup_vs_ddp:.2f}x" if row.speedup_vs_ddp is not None else "-"
        exposed = "-" if row.exposed_ms is None or row.name == LABELS["floor"] else f"{row.exposed_ms:.1f}"
        loss = f"{row.loss:.4f}" if row.loss is not None else "-"
        mean = f"{row.mean_ms:.1f}" if row.mean_ms is not None else "-"
        lines.append(f"{row.name:<24}{row.median_ms:>15.1f}{mean:>13}{speedup:>16}{exposed:>17}{loss:>12}")
    return "\n".join(lines)


def choose_network(bandwidth: str | None) -> tuple[str | None, str | None]:
    """``(rate, note)``: the rate to shape to, or None with the reason the demo runs unshaped."""
    from deft_compile.tools.bench import shaping_available

    if bandwidth is None:
        return None, "unshaped: --bandwidth none"
    reason = shaping_available()
    if reason is not None:
        return None, f"unshaped: {reason}"
    return bandwidth, None


def run_demo(steps: int = 40, batch: int | None = None, *, bandwidth: str | None = DEMO_BANDWIDTH,
             out: str | os.PathLike = "deft-demo", model: str = DEMO_MODEL, warmup: int = 3, rounds: int = 4,
             progress: bool = True) -> int:
    """Run the demo, print the table, write the timeline PNGs and ``results.json``; returns an exit code."""
    from deft_compile.tools.bench import (COMPILED_DDP, network, parse_rate, run_config, sigterm_as_interrupt,
                                          simulated_timeline_png)
    from deft_compile.tools.netns import NetnsError, created_namespaces

    started = time.perf_counter()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rate, note = choose_network(parse_rate(bandwidth) if bandwidth is not None else None)
    print(f"deft_compile demo: 2 local gloo workers (1 thread each), model {model}, "
          f"{steps} timed steps per run after {warmup} warm-up steps")
    options = dict(policies=("wfbp", "deft", COMPILED_DDP), workers=2, steps=steps, warmup=warmup, rounds=rounds, batch=batch,
                   progress=progress, timeout_s=600.0, measured_timeline=str(out / "timeline_measured.json"),
                   prefix="deftdemo", label="demo (rank 0)")
    try:
        with sigterm_as_interrupt(), network(rate, 1, 2, prefix="deftdemo") as net:
            print(f"network: {net['description']}" + (f" - {note}" if note else ""))
            run = run_config(model, rate, network_info=net, **options)
    except NetnsError as error:  # e.g. root without CAP_NET_ADMIN in a container
        print(f"network: could not build a shaped namespace ({error}); running unshaped instead")
        rate, note = None, "unshaped: namespace creation failed"
        try:
            with sigterm_as_interrupt(), network(None, 1, 2) as net:
                run = run_config(model, None, network_info=net, **options)
        except KeyboardInterrupt:
            print("\ninterrupted", file=sys.stderr)
            return 130
    except KeyboardInterrupt:
        print(f"\ninterrupted; namespaces left: {created_namespaces() or 'none'}", file=sys.stderr)
        return 130
    print(f"\nall-reduce of all gradients ({run['gradient_bytes'] / 2**20:.1f} MiB) on this network: "
          f"{run['allreduce_all_ms']:.1f} ms; floor step {run['rows']['floor']['step_ms']:.1f} ms "
          f"(coverage rate {run['coverage_rate']:.2f})\n")
    equal_steps = next(iter(run["rows"].values()), {}).get("equal_steps")
    print(format_demo_table(demo_rows(run), equal_steps))
    ok, check_line = wfbp_check(run)
    deft_row = run["rows"].get("deft", {})
    print(f"\n{check_line}")
    print(f"deft's plan: {deft_row.get('items')} items, {deft_row.get('delayed_items')} delayed, "
          f"max update period {deft_row.get('max_period')}; Preserver re-plans: {deft_row.get('plan_changes')}"
          + "".join(f"\n  step {h['step']}: {h['reason']}" for h in run["plan_history"].get("deft", [])[1:]))
    print(f"{run['steps']['timed']} timed steps per run in {run['steps']['rounds']} interleaved rounds; a step's time "
          "is the slower rank's.\nmean step ms = median over the rounds of the block's mean step time (deft's update "
          "period makes\n  some steps communicate nothing: the mean charges the ones that do; the median step does not);\n"
          "speedup vs DDP and exposed comm (= mean step - floor's mean step) use the mean; loss @ N = mean over both\n"
          "  ranks of steps N-4..N, N the steps every run reached (each draws the same batches in order; deft's\n"
          f"  closed loop trains more warm-up steps). Network: {'shaped ' + rate if rate else note}. Ratios are from this run; "
          "absolute ms depend on the machine and its load.")
    png = simulated_timeline_png(run, "deft", out / "timeline_simulated.png")
    measured_png = out / "timeline_measured.png"
    if png:
        print(f"timeline (deft's plan simulated on its measured profile): {png}")
    if measured_png.exists():
        share = run.get("measured_timeline") or {}
        extra = (f": {share['steps']} step(s), {share['step_ms']:.1f} ms, {share['wait_tensor_ms']:.1f} ms in wait_tensor"
                 if share else "")
        print(f"timeline (deft measured with torch.profiler on rank 0){extra}: {measured_png}")
    from deft_compile.tools.provenance import provenance

    record = {"provenance": provenance(), **{k: v for k, v in run.items() if k not in ("profiles",)}}
    record["network_note"] = note
    record["table"] = [asdict(r) for r in demo_rows(run)]
    (out / "results.json").write_text(json.dumps(record, indent=1))
    print(f"results: {out / 'results.json'}; wall time {time.perf_counter() - started:.0f} s")
    return 0 if ok else 1
