"""Does DeFT train as well as DDP on real data? (2 gloo workers, same samples, fixed seeds)

    python benchmarks/convergence.py [--seeds 0 1 2] [--tasks digits charlm] [--out docs/img]

Two real tasks, each trained by torch DDP and by ``deft_compile(policy="deft")``
in the same worker processes, on the same per-rank batches (same number of
samples), from the same initial weights:

* ``digits``: a small CNN on scikit-learn's bundled 8x8 handwritten digits
  (1797 images, shipped inside the package: offline), SGD with momentum;
  metric: final test accuracy (and test loss) on a fixed 20 % split.
* ``charlm``: a 2-layer character-level transformer LM on Python's own
  standard-library sources (``Lib/*.py`` of the running interpreter: offline),
  AdamW lr 3e-3; metric: final validation loss on held
  out text (the last 10 % of the corpus).

Variants:

* ``ddp``             torch ``DistributedDataParallel`` (eager).
* ``deft-delay``      deft, delays only (``allow_period=False``), Preserver off: the plan stays all run.
* ``deft-delay-K``    deft, delays and update periods K > 1 allowed, Preserver off.
* ``deft-delay+P``, ``deft-delay-K+P``  the same with the Preserver on (the default ``PreserverConfig()``).
* ``deft-delay+probe`` (only with ``--variants``): Preserver with synchronous probe windows, staleness error off.

``--merge`` re-runs the given tasks and keeps the other tasks' runs in ``<out>/convergence.json``.

On this machine's fast loopback the solver rightly delays nothing, so the deft
variants plan from a *synthetic slow-link profile* (``slow_link_profile``:
deterministic compute ∝ parameter size, one link whose total all-reduce time is
``comm_over_compute`` × compute; identical on every rank). The plan therefore
contains delays / periods exactly as on a slow network while every number in
training is real. Each run records the plan table, which buckets are delayed,
their K, ``step.plan_history`` and the Preserver's events. The
accuracy comparison is only meaningful where delays / K really are in the plan:
the report says so per run.

Outputs (``--out``, default ``docs/img``): ``convergence.json`` (everything) and
``convergence_<task>.png`` (training-loss and validation-loss curves, seed-mean).
The helpers here (data, models, profiles, training loop) are reused by
``benchmarks/staleness.py`` and ``benchmarks/links_speed.py``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import statistics
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from deft_compile import DeftConfig, deft_compile
from deft_compile.tools.launcher import run_local_workers
from deft_compile.planner.plan import LinkCost, Profile
from lm_models import CausalLM, lm_loss
from deft_compile.preserver import PreserverConfig
from deft_compile.step.profiler import profile_model

ROOT = Path(__file__).resolve().parents[1]

# --------------------------------------------------------------------------- data


def digits_data(seed: int = 0) -> dict[str, torch.Tensor]:
    """scikit-learn's bundled digits (1797 x 8x8, values 0..16), split 80/20 with a fixed permutation."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:  # pragma: no cover - dependency message
        raise SystemExit("scikit-learn is needed for the digits data: pip install scikit-learn") from exc
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(12345))  # split fixed across seeds
    test = order[: len(y) // 5]
    train = order[len(y) // 5:]
    mean, std = x[train].mean(), x[train].std()
    x = (x - mean) / std
    return {"x_train": x[train], "y_train": y[train], "x_test": x[test], "y_test": y[test]}


def corpus_text(max_chars: int = 1_500_000) -> str:
    """Python's standard-library sources (``Lib/*.py`` of this interpreter), sorted by name, concatenated."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    parts, total = [], 0
    for path in sorted(lib.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    return "".join(parts)[:max_chars]


def charlm_data(context: int) -> dict[str, Any]:
    text = corpus_text()
    chars = sorted(set(text))
    lookup = {c: i for i, c in enumerate(chars)}
    ids = torch.tensor([lookup[c] for c in text], dtype=torch.long)
    split = int(len(ids) * 0.9)
    train, val = ids[:split], ids[split:]
    # a fixed validation set: 256 windows evenly spread over the held-out text
    starts = torch.linspace(0, len(val) - context - 2, 256).long()
    val_x = torch.stack([val[s: s + context] for s in starts])
    val_y = torch.stack([val[s + 1: s + context + 1] for s in starts])
    return {"train": train, "val_x": val_x, "val_y": val_y, "vocab": len(chars), "chars": len(text),
            "source": str(Path(sysconfig.get_paths()["stdlib"]) / "*.py")}


# --------------------------------------------------------------------------- models


class DigitsCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 4 * 4, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.conv1(x))
        h = F.max_pool2d(F.relu(self.conv2(h)), 2)
        return self.fc2(F.relu(self.fc1(h.flatten(1))))


# --------------------------------------------------------------------------- tasks


class Task:
    """Data, model, optimizer, per-rank batches and evaluation of one training problem."""

    name = ""
    loss_fn = staticmethod(F.cross_entropy)
    bucket_caps = {"first_bucket_mb": 1.0, "bucket_cap_mb": 25.0}
    lr = 0.0
    # learning-rate schedule: "constant", or "cosine" (linear warm-up over ``warmup`` steps, then cosine
    # decay to 0); the value changes every ``lr_every`` steps.
    schedule = "constant"
    warmup = 0
    lr_every = 1

    def lr_at(self, step: int, steps: int, base: float | None = None) -> float:
        """The learning rate of 0-based ``step`` out of ``steps`` under this task's schedule."""
        base = base or self.lr
        if self.schedule == "constant":
            return base
        step = step - step % self.lr_every
        if step < self.warmup:
            return base * (step + self.lr_every) / (self.warmup + self.lr_every)
        progress = (step - self.warmup) / max(1, steps - self.warmup)
        return base * 0.5 * (1.0 + math.cos(math.pi * progress))

    def make_model(self) -> nn.Module:
        raise NotImplementedError

    def make_optimizer(self, model: nn.Module, lr: float | None = None) -> torch.optim.Optimizer:
        raise NotImplementedError

    def batches(self, seed: int, rank: int, world_size: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        raise NotImplementedError

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        raise NotImplementedError


class DigitsTask(Task):
    name = "digits"
    # several DDP buckets for a 70k-parameter model, so the solver has buckets to choose from
    bucket_caps = {"first_bucket_mb": 0.004, "bucket_cap_mb": 0.0625}

    def __init__(self, batch_per_rank: int = 32, lr: float = 0.05, momentum: float = 0.9, schedule: str = "constant",
                 warmup: int = 0, lr_every: int = 1) -> None:
        self.data = digits_data()
        self.batch_per_rank, self.lr, self.momentum = batch_per_rank, lr, momentum
        self.schedule, self.warmup, self.lr_every = schedule, warmup, lr_every

    def make_model(self) -> nn.Module:
        return DigitsCNN()

    def make_optimizer(self, model: nn.Module, lr: float | None = None) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=lr or self.lr, momentum=self.momentum)

    def batches(self, seed, rank, world_size, steps):
        """Epochs of a seeded permutation; each global batch of world·B samples, rank r takes its B."""
        x, y = self.data["x_train"], self.data["y_train"]
        generator = torch.Generator().manual_seed(seed)
        per_step = self.batch_per_rank * world_size
        order = torch.cat([torch.randperm(len(y), generator=generator)
                           for _ in range(math.ceil(steps * per_step / len(y)) + 1)])
        out = []
        for t in range(steps):
            idx = order[t * per_step + rank * self.batch_per_rank: t * per_step + (rank + 1) * self.batch_per_rank]
            out.append((x[idx], y[idx]))
        return out

    @torch.no_grad()
    def evaluate(self, model):
        logits = model(self.data["x_test"])
        return {"test_loss": float(F.cross_entropy(logits, self.data["y_test"])),
                "test_accuracy": float((logits.argmax(1) == self.data["y_test"]).float().mean() * 100)}


class CharLMTask(Task):
    name = "charlm"
    loss_fn = staticmethod(lm_loss)
    bucket_caps = {"first_bucket_mb": 0.002, "bucket_cap_mb": 0.02}

    def __init__(self, batch_per_rank: int = 16, context: int = 64, lr: float = 3e-3, dim: int = 96,
                 schedule: str = "constant", warmup: int = 0, lr_every: int = 1) -> None:
        self.context, self.batch_per_rank, self.lr, self.dim = context, batch_per_rank, lr, dim
        self.schedule, self.warmup, self.lr_every = schedule, warmup, lr_every
        self.data = charlm_data(context)

    def make_model(self) -> nn.Module:
        # GPT-style small embedding init: with N(0, 1) the tied head starts at loss ~10 and AdamW at 3e-3 spikes
        return CausalLM(self.data["vocab"], dim=self.dim, heads=4, layers=2, context=self.context, ffn=4, embed_std=0.02)

    def make_optimizer(self, model, lr=None):
        return torch.optim.AdamW(model.parameters(), lr=lr or self.lr, weight_decay=0.01)

    def batches(self, seed, rank, world_size, steps):
        train = self.data["train"]
        generator = torch.Generator().manual_seed(seed)
        out = []
        for _ in range(steps):
            starts = torch.randint(0, len(train) - self.context - 1, (world_size * self.batch_per_rank,),
                                   generator=generator)
            mine = starts[rank * self.batch_per_rank: (rank + 1) * self.batch_per_rank]
            out.append((torch.stack([train[s: s + self.context] for s in mine]),
                        torch.stack([train[s + 1: s + self.context + 1] for s in mine])))
        return out

    @torch.no_grad()
    def evaluate(self, model):
        losses = [float(lm_loss(model(x), y)) for x, y in zip(self.data["val_x"].split(64), self.data["val_y"].split(64))]
        return {"val_loss": statistics.fmean(losses)}


TASKS = {"digits": DigitsTask, "charlm": CharLMTask}

# --------------------------------------------------------------------------- deft profiles and plans


def slow_link_profile(model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn, batch, world_size: int,
                      comm_over_compute: float) -> Profile:
    """A deterministic profile of ``model`` (the same on every rank): compute grows with parameter size
    (forward 0.2 ms + 1e-4 ms/element, backward twice that) and one link whose all-reduces total
    ``comm_over_compute`` × the compute. Same recipe as tests/workers.py ``synthetic_profile``."""
    profile = profile_model(model, optimizer, loss_fn, batch, measure=False)
    params = [dataclasses.replace(p, forward_ms=0.2 + p.numel * 1e-4, backward_ms=0.4 + p.numel * 2e-4, update_ms=0.01)
              for p in profile.params]
    compute = sum(p.forward_ms + p.backward_ms for p in params)
    beta = comm_over_compute * compute / sum(p.nbytes for p in params)
    return dataclasses.replace(profile, params=params, links=[LinkCost("slow-synthetic", 0.05, beta)],
                               world_size=world_size)


def plan_summary(step) -> dict[str, Any]:
    """Which buckets (by parameter name) are delayed, with which K, plus the plan table and the Preserver's record."""
    plan, profile = step.plan, step.profile
    items = []
    for item in sorted(plan.items, key=lambda i: i.order):
        names = sorted({profile.params[s.param].name for s in item.slices})
        items.append({"id": item.id, "bucket": item.bucket, "params": names, "bytes": item.nbytes(profile),
                      "link": item.link, "delay": item.delay, "period": item.period, "window": item.window})
    total = sum(i["bytes"] for i in items)
    preserver = step.preserver
    return {
        "table": plan.table(profile),
        "items": items,
        "delayed_buckets": sum(1 for i in items if i["delay"]),
        "periodic_buckets": sum(1 for i in items if i["period"] > 1),
        "buckets": len(items),
        "delayed_bytes_share": sum(i["bytes"] for i in items if i["delay"]) / total if total else 0.0,
        "periodic_bytes_share": sum(i["bytes"] for i in items if i["period"] > 1) / total if total else 0.0,
        "max_period": max((i["period"] for i in items), default=1),
        "metadata": {k: v for k, v in plan.metadata.items() if isinstance(v, (int, float, str))},
        "plan_history": list(step.plan_history),
        "preserver_events": [str(e) for e in (preserver.history if preserver is not None else [])],
        "staleness_log": list(preserver.staleness_log) if preserver is not None else [],
    }


# comm_over_compute per task, chosen so the plan really delays / periodises most of the bytes
# (see the plan tables in docs/CONVERGENCE.md); "preserver": False fixes the plan for the whole run.
VARIANTS: dict[str, dict[str, Any] | None] = {
    "ddp": None,
    "deft-delay": {"comm_over_compute": {"digits": 0.7, "charlm": 0.9},
                   "plan_options": {"allow_period": False}, "preserver": False},
    "deft-delay-K": {"comm_over_compute": {"digits": 2.0, "charlm": 2.0},
                     "plan_options": {"allow_period": True}, "preserver": False},
    "deft-delay+P": {"comm_over_compute": {"digits": 0.7, "charlm": 0.9},
                     "plan_options": {"allow_period": False}, "preserver": True},
    "deft-delay-K+P": {"comm_over_compute": {"digits": 2.0, "charlm": 2.0},
                       "plan_options": {"allow_period": True}, "preserver": True},
}
# Not in the default set (run with --variants): the Preserver with synchronous probe windows instead of the
# staleness error, which is the only default-off check that compares against synchronous training.
EXTRA_VARIANTS: dict[str, dict[str, Any]] = {
    "deft-delay+probe": {"comm_over_compute": {"digits": 0.7, "charlm": 0.9},
                         "plan_options": {"allow_period": False},
                         "preserver": {"probe_every": 50, "probe_window": 5, "staleness_every": 0}},
}
DEFAULT_VARIANTS = list(VARIANTS)
VARIANTS.update(EXTRA_VARIANTS)


def build_runner(task: Task, variant: dict[str, Any] | None, model: nn.Module, optimizer, first_batch,
                 world_size: int, preserver: PreserverConfig | None = None):
    """(callable(inputs, targets) -> loss, deft step or None)."""
    if variant is None:
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=task.bucket_caps["bucket_cap_mb"])

        def run(inputs, targets):
            optimizer.zero_grad(set_to_none=True)
            loss = task.loss_fn(ddp(inputs), targets)
            loss.backward()
            optimizer.step()
            return loss.detach()

        return run, None
    scratch = copy.deepcopy(model)
    coc = variant["comm_over_compute"]
    profile = slow_link_profile(scratch, task.make_optimizer(scratch), task.loss_fn, first_batch, world_size,
                                coc[task.name] if isinstance(coc, dict) else coc)
    if preserver is None:
        setting = variant.get("preserver", True)
        preserver = PreserverConfig(**setting) if isinstance(setting, dict) else PreserverConfig(enabled=setting)
    config = DeftConfig(plan_options=dict(variant.get("plan_options", {})), **task.bucket_caps, preserver=preserver)
    step = deft_compile(model, optimizer, task.loss_fn, policy="deft", profile=profile, config=config)
    return step, step


def train(task: Task, variant: dict[str, Any] | None, rank: int, world_size: int, seed: int, steps: int,
          eval_every: int, lr: float | None = None, preserver: PreserverConfig | None = None) -> dict[str, Any]:
    """Train one variant from the seed's initial weights on the seed's batches; rank 0 evaluates."""
    torch.manual_seed(seed)
    model = task.make_model()
    optimizer = task.make_optimizer(model, lr)
    batches = task.batches(seed, rank, world_size, steps)
    run, step = build_runner(task, variant, model, optimizer, batches[0], world_size, preserver)
    losses, evals = [], []
    started = time.perf_counter()
    for t, (inputs, targets) in enumerate(batches):
        rate = task.lr_at(t, steps, lr)
        for group in optimizer.param_groups:
            group["lr"] = rate
        losses.append(float(run(inputs, targets)))
        if rank == 0 and (t + 1) % eval_every == 0 and t + 1 < steps:
            evals.append({"step": t + 1, **task.evaluate(model)})
    if step is not None:
        step.flush()  # apply the last delayed / accumulated gradients: no sample is lost
    seconds = time.perf_counter() - started
    mean_losses = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(mean_losses)
    result: dict[str, Any] = {"train_loss": (mean_losses / world_size).tolist(), "seconds": seconds}
    if rank == 0:
        evals.append({"step": steps, **task.evaluate(model)})
        result["evals"] = evals
        result["final"] = evals[-1]
        if step is not None:
            result["plan"] = plan_summary(step)
            result["traces"] = step.trace_count
    return result


# --------------------------------------------------------------------------- workers and report


def worker(rank: int, world_size: int, cfg: dict[str, Any]) -> dict[str, Any]:
    task = TASKS[cfg["task"]](**cfg.get("task_kwargs", {}))
    out = {}
    for name in cfg["variants"]:
        out[name] = train(task, VARIANTS[name], rank, world_size, cfg["seed"], cfg["steps"], cfg["eval_every"])
    return out


DEFAULT_STEPS = {"digits": 600, "charlm": 400}
EVAL_EVERY = {"digits": 20, "charlm": 50}


def metric_of(task: str) -> str:
    return "test_accuracy" if task == "digits" else "val_loss"


def summarise(runs: dict[str, dict[int, dict]], variants: list[str]) -> dict[str, Any]:
    """Per task and variant: mean final metrics over seeds, and the comparison with DDP."""
    summary: dict[str, Any] = {}
    for task, by_seed in runs.items():
        keys = ["test_accuracy", "test_loss"] if task == "digits" else ["val_loss"]
        rows = {}
        for v in variants:
            finals = [by_seed[s][v]["final"] for s in sorted(by_seed)]
            rows[v] = {k: statistics.fmean(f[k] for f in finals) for k in keys}
            rows[v]["per_seed"] = {k: [f[k] for f in finals] for k in keys}
        for v in variants:
            if v == "ddp":
                continue
            if task == "digits":
                rows[v]["accuracy_diff_points"] = rows[v]["test_accuracy"] - rows["ddp"]["test_accuracy"]
                rows[v]["loss_ratio"] = rows[v]["test_loss"] / rows["ddp"]["test_loss"]
                rows[v]["met"] = abs(rows[v]["accuracy_diff_points"]) <= 0.5 or rows[v]["accuracy_diff_points"] > 0
            else:
                rows[v]["loss_ratio"] = rows[v]["val_loss"] / rows["ddp"]["val_loss"]
                rows[v]["met"] = rows[v]["loss_ratio"] <= 1.02
        summary[task] = rows
    return summary


def plot(runs: dict[str, dict[int, dict]], variants: list[str], out_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for task, by_seed in runs.items():
        seeds = sorted(by_seed)
        metric = "test_loss" if task == "digits" else "val_loss"
        fig, axes = plt.subplots(1, 3 if task == "digits" else 2, figsize=(15 if task == "digits" else 11, 4))
        for v in variants:
            curves = torch.tensor([by_seed[s][v]["train_loss"] for s in seeds])
            mean = curves.mean(0)
            window = 10
            smooth = torch.nn.functional.avg_pool1d(mean.view(1, 1, -1), window, 1).view(-1)
            axes[0].plot(range(window, len(mean) + 1), smooth.tolist(), label=v)
            steps = [e["step"] for e in by_seed[seeds[0]][v]["evals"]]
            values = [statistics.fmean(by_seed[s][v]["evals"][i][metric] for s in seeds) for i in range(len(steps))]
            axes[1].plot(steps, values, marker=".", label=v)
            if task == "digits":
                acc = [statistics.fmean(by_seed[s][v]["evals"][i]["test_accuracy"] for s in seeds) for i in range(len(steps))]
                axes[2].plot(steps, acc, marker=".", label=v)
        axes[0].set(title=f"{task}: training loss (all-rank mean, 10-step avg)", xlabel="step", ylabel="loss", yscale="log")
        axes[1].set(title=f"{task}: {metric.replace('_', ' ')}", xlabel="step", ylabel="loss")
        axes[1].set_yscale("log")
        if task == "digits":
            axes[2].set(title="digits: test accuracy (%)", xlabel="step", ylim=(80, 100))
        for ax in axes:
            ax.legend()
            ax.grid(alpha=0.3)
        fig.suptitle(f"{task}: DDP vs deft, 2 gloo workers, mean of {len(seeds)} seed(s)")
        fig.tight_layout()
        path = out_dir / f"convergence_{task}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(str(path))
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", default=["digits", "charlm"], choices=sorted(TASKS))
    parser.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, choices=list(VARIANTS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--charlm-seeds", nargs="+", type=int, default=None,
                        help="seeds for charlm (default: --seeds)")
    parser.add_argument("--steps", type=int, default=None, help="override steps for every task")
    parser.add_argument("--out", default=str(ROOT / "docs" / "img"))
    parser.add_argument("--schedule", choices=["cosine", "constant"], default="cosine",
                        help="learning rate: linear warm-up (--warmup steps) then cosine decay to 0, or constant")
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--lr-every", type=int, default=25,
                        help="steps between learning-rate changes (25 reproduces docs/CONVERGENCE.md, measured when "
                             "each new value still retraced; the lr is a graph input now, so 1 costs nothing)")
    parser.add_argument("--merge", action="store_true",
                        help="keep the other tasks' runs already in <out>/convergence.json (re-run one task only)")
    args = parser.parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs: dict[str, dict[int, dict]] = {}
    started = time.perf_counter()
    for task in args.tasks:
        seeds = args.charlm_seeds if task == "charlm" and args.charlm_seeds is not None else args.seeds
        runs[task] = {}
        for seed in seeds:
            cfg = {"task": task, "seed": seed,
                   "task_kwargs": {"schedule": args.schedule, "warmup": args.warmup, "lr_every": args.lr_every}, "steps": args.steps or DEFAULT_STEPS[task],
                   "eval_every": EVAL_EVERY[task], "variants": args.variants}
            t0 = time.perf_counter()
            results = run_local_workers(worker, 2, (cfg,), timeout_s=900)
            runs[task][seed] = results[0].value
            line = ", ".join(
                f"{v} {metric_of(task)}={results[0].value[v]['final'][metric_of(task)]:.4g}" for v in args.variants)
            print(f"[{task} seed {seed}] {line}  ({time.perf_counter() - t0:.0f} s)", flush=True)
            for v in args.variants:
                plan = results[0].value[v].get("plan")
                if plan is not None:
                    print(f"  {v}: delayed buckets {plan['delayed_buckets']}/{plan['buckets']} "
                          f"({plan['delayed_bytes_share']:.0%} of bytes), periodic {plan['periodic_buckets']} "
                          f"(K={plan['max_period']}), plan changes: {[h['reason'] for h in plan['plan_history']]}",
                          flush=True)
    from deft_compile.tools.provenance import provenance, script_command
    command = script_command(__file__, argv)
    commands = {t: command for t in args.tasks}
    steps = {t: args.steps or DEFAULT_STEPS[t] for t in args.tasks}
    old_path = out_dir / "convergence.json"
    if args.merge and old_path.exists():
        old = json.loads(old_path.read_text())
        for task, by_seed in old["runs"].items():
            if task not in runs:
                runs[task] = {int(s): v for s, v in by_seed.items()}
                commands[task] = old.get("commands", {}).get(task, old.get("command"))
                steps[task] = old["steps"][task]
    summary = summarise(runs, args.variants)
    pngs = plot(runs, args.variants, out_dir)

    record = {"provenance": provenance(command=command),
              "commands": commands, "schedule": {"schedule": args.schedule, "warmup": args.warmup,
                                                 "lr_every": args.lr_every}, "seeds": {t: sorted(runs[t]) for t in runs},
              "variants": {k: VARIANTS[k] for k in args.variants}, "steps": steps,
              "summary": summary, "runs": runs, "pngs": pngs, "elapsed_s": time.perf_counter() - started}
    (out_dir / "convergence.json").write_text(json.dumps(record, indent=1))
    print(json.dumps(summary, indent=1))
    for task in args.tasks:
        first = runs[task][min(runs[task])]
        for v in args.variants:
            if "plan" in first[v]:
                print(f"\n{task} / {v} plan (seed {min(runs[task])}):\n{first[v]['plan']['table']}")
    print(f"\nwrote {out_dir / 'convergence.json'} and {pngs} in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
