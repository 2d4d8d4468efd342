"""A setting where staleness hurts, and what the Preserver does about it.

    python benchmarks/staleness.py [--lr 0.1] [--seeds 0 1] [--steps 300] [--out docs/img]

The digits CNN of ``benchmarks/convergence.py`` (scikit-learn's bundled
handwritten digits, 2 gloo workers, same batches for every variant) trained
with SGD + momentum 0.9 at twice the convergence run's learning rate (0.1
instead of 0.05), where synchronous SGD still trains well but a one-step
stale gradient pushes momentum SGD past its stability edge:

* ``ddp``            torch DDP;
* ``deft-nopres``    deft, ``PreserverConfig(enabled=False)``: the plan delays
                     ~98 % of the gradient bytes for the whole run;
* ``deft-pres``      deft with the Preserver on (the default ``PreserverConfig()``);
* ``deft-pres-lossonly``  the Preserver with ``staleness_every=0``: only its
                     loss-window checks (falling behind / diverging) can act.

The plan comes from the same synthetic slow-link profile as the convergence
run's ``deft-delay`` variant (``comm_over_compute=0.7``), so the delays really
are in the plan. Reported: final test accuracy and test loss per variant and
seed, the Preserver's log lines (the ``deft_compile`` logger, captured in the
workers), ``step.plan_history`` and the Preserver's events. Writes
``staleness.json`` and ``staleness.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from convergence import ROOT, TASKS, VARIANTS, train  # noqa: E402

from deft_compile.tools.launcher import run_local_workers  # noqa: E402
from deft_compile.preserver import PreserverConfig  # noqa: E402

STALE_VARIANTS: dict[str, tuple[dict | None, PreserverConfig | None]] = {
    "ddp": (None, None),
    "deft-nopres": (VARIANTS["deft-delay"], PreserverConfig(enabled=False)),
    "deft-pres": (VARIANTS["deft-delay"], PreserverConfig()),
    # the Preserver with its staleness error switched off: only the loss-window checks can act
    "deft-pres-lossonly": (VARIANTS["deft-delay"], PreserverConfig(staleness_every=0)),
}


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "Preserver" in message or "new plan" in message:
            self.lines.append(f"{record.levelname}: {message.splitlines()[0]}")


def worker(rank: int, world_size: int, cfg: dict[str, Any]) -> dict[str, Any]:
    task = TASKS["digits"]()
    logger = logging.getLogger("deft_compile")
    logger.setLevel(logging.INFO)
    out = {}
    for name in cfg["variants"]:
        variant, preserver = STALE_VARIANTS[name]
        handler = _Collect()
        logger.addHandler(handler)
        try:
            out[name] = train(task, variant, rank, world_size, cfg["seed"], cfg["steps"], cfg["eval_every"],
                              lr=cfg["lr"], preserver=preserver)
        finally:
            logger.removeHandler(handler)
        out[name]["log"] = handler.lines
    return out


def plot(runs: dict[int, dict], variants: list[str], lr: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import torch

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    seeds = sorted(runs)
    for v in variants:
        curve = torch.tensor([runs[s][v]["train_loss"] for s in seeds]).mean(0)
        smooth = torch.nn.functional.avg_pool1d(curve.view(1, 1, -1), 10, 1).view(-1)
        axes[0].plot(range(10, len(curve) + 1), smooth.tolist(), label=v)
        steps = [e["step"] for e in runs[seeds[0]][v]["evals"]]
        acc = [statistics.fmean(runs[s][v]["evals"][i]["test_accuracy"] for s in seeds) for i in range(len(steps))]
        axes[1].plot(steps, acc, marker=".", label=v)
    for s in seeds:
        for event in runs[s].get("deft-pres", {}).get("plan", {}).get("plan_history", [])[1:]:
            axes[0].axvline(event["step"], color="gray", alpha=0.4, ls="--")
    axes[0].set(title=f"digits, SGD momentum lr={lr}: training loss (10-step avg)", xlabel="step", yscale="log")
    axes[1].set(title="test accuracy (%)", xlabel="step", ylim=(0, 100))
    for ax in axes:
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle(f"staleness hurts: DDP vs deft without / with the Preserver (mean of {len(seeds)} seed(s); "
                 "dashed: Preserver re-plans)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--variants", nargs="+", default=list(STALE_VARIANTS), choices=list(STALE_VARIANTS))
    parser.add_argument("--out", default=str(ROOT / "docs" / "img"))
    args = parser.parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    runs: dict[int, dict] = {}
    for seed in args.seeds:
        cfg = {"seed": seed, "steps": args.steps, "eval_every": 20, "lr": args.lr, "variants": args.variants}
        runs[seed] = run_local_workers(worker, 2, (cfg,), timeout_s=900)[0].value
        print(f"[seed {seed}] " + ", ".join(
            f"{v}: acc {runs[seed][v]['final']['test_accuracy']:.2f} % loss {runs[seed][v]['final']['test_loss']:.4g}"
            for v in args.variants), flush=True)
    summary: dict[str, Any] = {}
    for v in args.variants:
        finals = [runs[s][v]["final"] for s in args.seeds]
        summary[v] = {"test_accuracy": statistics.fmean(f["test_accuracy"] for f in finals),
                      "test_loss": statistics.fmean(f["test_loss"] for f in finals),
                      "per_seed_accuracy": [f["test_accuracy"] for f in finals],
                      "per_seed_loss": [f["test_loss"] for f in finals]}
        if v != "ddp" and "ddp" in summary:
            summary[v]["accuracy_diff_points"] = summary[v]["test_accuracy"] - summary["ddp"]["test_accuracy"]
            summary[v]["loss_ratio"] = summary[v]["test_loss"] / summary["ddp"]["test_loss"]
            summary[v]["within_bounds"] = summary[v]["accuracy_diff_points"] >= -0.5
    plot(runs, args.variants, args.lr, out_dir / "staleness.png")
    from deft_compile.tools.provenance import provenance, script_command

    record = {"command": script_command(__file__, argv),
              "lr": args.lr, "steps": args.steps, "seeds": args.seeds, "summary": summary, "runs": runs,
              "elapsed_s": time.perf_counter() - started}
    record["provenance"] = provenance(command=record["command"])
    (out_dir / "staleness.json").write_text(json.dumps(record, indent=1))
    print(json.dumps(summary, indent=1))
    for seed in args.seeds:
        for v in args.variants:
            plan = runs[seed][v].get("plan")
            if plan is None:
                continue
            print(f"\nseed {seed} {v}: initial plan delays {plan['plan_history'][0]['delayed_items']} item(s)")
            for line in runs[seed][v]["log"]:
                print("   log:", line)
            for h in plan["plan_history"]:
                print(f"   plan_history: step {h['step']}: {h['reason']} (delayed items {h['delayed_items']}, "
                      f"max K {h['max_period']})")
    first = runs[args.seeds[0]]
    if "deft-nopres" in first:
        print("\nplan (deft-nopres, fixed):\n" + first["deft-nopres"]["plan"]["table"])
    print(f"\nwrote {out_dir / 'staleness.json'}, {out_dir / 'staleness.png'} in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
