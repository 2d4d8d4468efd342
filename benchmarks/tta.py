"""Time to accuracy: validation loss against wall-clock time, DDP vs deft, on a shaped link.

The number a user buys is not the step time but the time to reach a loss. This module trains a causal
transformer LM (``transformers`` GPT-2 from a config, random weights, byte-level vocabulary 256) on this
Python's standard-library sources (``examples/corpus.py``: offline, the same on every machine with the
same Python) with 2 gloo workers, once per variant:

* ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` (eager);
* ``ddp-fp16``, ``ddp-powersgd`` (peers a user on a slow link would pick): DDP with its fp16 compression hook
  (DDP refuses the bf16 one by its name on a CPU build of torch, although gloo all-reduces bfloat16) and with PowerSGD (``powersgd_rank``, warm start, error feedback, vanilla
  all-reduce for the learning rate's warm-up steps; one bucket, ``_Variant``);
* ``deft``: ``deft_compile(policy="deft")`` with its defaults; the solver's defaults allow update periods, so
  this *is* "deft with periods" (and the Preserver, closed-loop planning and the default delayed semantics,
  compensated for AdamW and SGD momentum, are on);
* ``deft-no-preserver``: the same with ``PreserverConfig(enabled=False)``;
* ``deft-no-period``: the same with ``plan_options={"allow_period": False}`` (delays only);
* ``deft-sync`` (a control, not in the default set): ``max_staleness=0, allow_period=False``, so a
  synchronous plan that must train exactly like DDP;
* ``wfbp``, ``bytescheduler``, ``usbyte`` (controls, not in the default set): those policies through
  ``deft_compile``; synchronous plans, so DDP's numbers too;
* ``ddp-ulp`` (a round-off control, not in the default set): DDP from initial weights one ulp away, a seeded random
  direction per element: how far round-off alone moves the final loss.

Every variant starts from the same initial weights (``torch.manual_seed(seed)``, one model deep-copied) and
sees the same batches: step t's global batch of ``world x batch`` windows is drawn from a generator seeded by
the seed, rank r takes its share. AdamW with linear warm-up and cosine decay (``LambdaLR``). The variants run
in the same two processes, interleaved in chunks of ``chunk`` steps, round-robin with a rotating order, each
with its own model, optimizer, schedule and step object; each has its own training clock, which counts only
its own steps. At the end of a chunk a timed ``dist.barrier()`` (charged to the variant that ran the chunk)
waits for the communication it left in flight (gloo's barrier waits for every earlier collective), so no
variant's traffic is timed on another's clock.

Every ``eval_every`` steps (and at step 0) the validation loss is measured on fixed windows of held-out text
(the last 10 % of the corpus), split across the ranks. A deft variant is first ``flush()``-ed, so its pending
delayed or accumulated gradients are applied; the flush is training work and counts on its clock, the
evaluation does not. The evaluation's time is the slowest rank's clock.

Overheads, per variant, as a share of its training clock: the first step's excess over a
steady step (profiling, planning, tracing), steps that captured a new graph (retraces after re-plans, new
graph variants), steps in which the Preserver measured the staleness error (two extra eager forward/backward
passes), the evaluation flushes and the chunk-boundary waits. Excess = the call's time minus the median of the
variant's plain steps. See ``overheads``.

``run_benchmark`` drives it (calibrating the shaped rate so that DDP's coverage rate is about 1, through
``deft_compile.tools.bench.run_config``); ``benchmarks/time_to_accuracy.py`` and, from a checkout,
``deft-compile bench --time-to-accuracy`` call it. Imported as ``tta`` with ``benchmarks/`` on ``sys.path``
(the script's own folder; the tests' ``conftest.py`` appends it), so that workers find it by that name.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

import tta_cnn  # benchmarks/tta_cnn.py: the CNN workload
from deft_compile.compilers import default_compiler

# --------------------------------------------------------------------------- model

VOCAB = 256  # bytes
#: GPT-2 layouts: blocks, width, heads, context (n_positions, also the training window).
SIZES: dict[str, dict[str, int]] = {
    "tiny": {"n_layer": 2, "n_embd": 64, "n_head": 4, "n_positions": 32},  # 0.12 M parameters: tests
    # 1.8 M parameters: the multi-bucket workload (``buckets="scaled"``: about 20 buckets), 0.18 s of compute per
    # step of 2 x 8 x 64 tokens on one core, so 2000 steps of a few variants fit a 2-core host in hours
    "mini": {"n_layer": 4, "n_embd": 192, "n_head": 6, "n_positions": 64},
    "small": {"n_layer": 6, "n_embd": 288, "n_head": 6, "n_positions": 128},  # 6.1 M parameters: the benchmark
    "medium": {"n_layer": 8, "n_embd": 320, "n_head": 5, "n_positions": 128},  # 10 M parameters
}
DEFAULT_SIZE = "small"


def build_model(size: str = DEFAULT_SIZE) -> nn.Module:
    """A ``GPT2LMHeadModel`` from a ``GPT2Config`` of ``SIZES[size]`` with random weights (vocabulary 256, no dropout,
    tied head), wrapped so that ``model(input_ids, labels)`` returns the causal LM loss (labels are shifted inside)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from deft_compile.tools.presets import HFLoss

    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")
    config = GPT2Config(vocab_size=VOCAB, bos_token_id=0, eos_token_id=0, attn_pdrop=0.0, resid_pdrop=0.0,
                        embd_pdrop=0.0, loss_type="ForCausalLM", **SIZES[size])
    return HFLoss(GPT2LMHeadModel(config))


def context_of(size: str) -> int:
    return SIZES[size]["n_positions"]


def _bench_model(size: str) -> tuple[nn.Module, Callable, Callable, None]:
    """``deft-compile bench``'s user-model contract (``module:function``), so ``bench.run_config`` can measure this
    model's no-communication step and all-reduce time (the coverage-rate calibration). Token values do not change
    the time of a step: random bytes."""
    context = context_of(size)

    def batch(n: int, generator: torch.Generator) -> tuple[tuple[torch.Tensor, torch.Tensor], dict]:
        ids = torch.randint(0, VOCAB, (n, context), generator=generator)
        return (ids, ids.clone()), {}

    return build_model(size), make_optimizer, batch, None


def bench_model_tiny() -> tuple[nn.Module, Callable, Callable, None]:
    return _bench_model("tiny")


def bench_model_mini() -> tuple[nn.Module, Callable, Callable, None]:
    return _bench_model("mini")


def bench_model_small() -> tuple[nn.Module, Callable, Callable, None]:
    return _bench_model("small")


def bench_model_medium() -> tuple[nn.Module, Callable, Callable, None]:
    return _bench_model("medium")


def bench_model_spec(size: str, workload: str = "gpt2") -> str:
    """The ``module:function`` name of ``size``'s model for ``deft_compile.tools.bench.run_config``."""
    return f"{__name__ if workload == 'gpt2' else 'tta_cnn'}:bench_model_{size}"


#: workload -> its sizes, and the optimizer settings it gets unless the configuration names them.
WORKLOADS: dict[str, dict[str, Any]] = {
    "gpt2": {"sizes": SIZES, "lr": 1e-3, "weight_decay": 0.1, "unit": "nats/byte",
             "describe": "GPT-2 LM (transformers config, random init) on stdlib bytes, AdamW"},
    "cnn": {"sizes": tta_cnn.SIZES, "lr": 0.05, "weight_decay": 5e-4, "unit": "nats/image",
            "describe": "ResNet (BatchNorm) on teacher-labelled images, SGD momentum 0.9"},
}


# --------------------------------------------------------------------------- configuration


@dataclasses.dataclass(frozen=True)
class TTAConfig:
    """One launch: every variant of one seed.

    Attributes:
        workload: ``"gpt2"`` (GPT-2 LM, AdamW) or ``"cnn"`` (BatchNorm ResNet, SGD momentum 0.9); see ``WORKLOADS``.
        size: a key of the workload's sizes (``SIZES``, ``tta_cnn.SIZES``).
        steps: optimizer steps per variant.
        eval_every: steps between validation losses (also measured at step 0 and after the last step).
        chunk: steps a variant trains before the next one runs (round-robin, rotating order).
        batch: windows of ``context`` bytes (gpt2) or images (cnn) per worker and step.
        lr, weight_decay: the optimizer's (None: the workload's, ``WORKLOADS``); betas: AdamW's (gpt2).
        warmup: linear warm-up steps (None: 10 % of ``steps``); then cosine decay to ``min_lr_ratio x lr``.
        val_windows: fixed held-out windows of the validation loss (spread evenly over the last 10 % of the corpus),
            or validation images (cnn).
        corpus_bytes: bytes of stdlib sources read (sorted paths); the last ``val_fraction`` is held out.
        compiler: ``DeftConfig.compiler`` of the deft variants; the library's default (what a user gets), its
            compiles counted in the training clock and reported apart (``overheads``).
        bucket_cap_mb: bucket cap for DDP and every deft variant alike (None: the defaults, 25 MiB; DDP then
            takes it for its first bucket too, and so do the deft variants).
        buckets: ``"ddp"``: ``bucket_cap_mb`` as given; ``"scaled"``: DDP's default cap scaled by this model's
            gradient bytes over GPT-2 124M's (``scaled_bucket_cap_mb``), so a model of a few million parameters
            gets about as many buckets as DDP's defaults give the model it stands in for (about 20), not one or
            two.
        label_noise: cnn: the share of labels replaced by a random class (``tta_cnn``), training and validation.
        powersgd_rank: ``ddp-powersgd``'s ``matrix_approximation_rank``.
        variants: names from ``VARIANTS``.
    """

    size: str = DEFAULT_SIZE
    workload: str = "gpt2"
    steps: int = 300
    eval_every: int = 25
    chunk: int = 25
    batch: int = 8
    lr: float | None = None
    weight_decay: float | None = None
    betas: tuple[float, float] = (0.9, 0.95)
    warmup: int | None = None
    min_lr_ratio: float = 0.1
    val_windows: int = 128
    corpus_bytes: int = 6_000_000
    val_fraction: float = 0.1
    compiler: str = dataclasses.field(default_factory=default_compiler)
    bucket_cap_mb: float | None = None
    buckets: str = "ddp"
    label_noise: float = 0.0
    powersgd_rank: int = 2
    variants: tuple[str, ...] = ("ddp", "deft", "deft-no-preserver", "deft-no-period")
    seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        if self.workload not in WORKLOADS:
            raise ValueError(f"unknown workload {self.workload!r}; choose one of {', '.join(WORKLOADS)}")
        sizes = WORKLOADS[self.workload]["sizes"]
        if self.size not in sizes:
            raise ValueError(f"unknown {self.workload} size {self.size!r}; choose one of {', '.join(sizes)}")
        if min(self.steps, self.eval_every, self.chunk, self.batch, self.val_windows) < 1:
            raise ValueError("steps, eval_every, chunk, batch and val_windows must be at least 1")
        unknown = [v for v in self.variants if v not in VARIANTS]
        if unknown:
            raise ValueError(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
        if "ddp" not in self.variants:
            raise ValueError("the variants must include 'ddp': its final validation loss is the target")
        if self.buckets not in ("ddp", "scaled"):
            raise ValueError(f"buckets must be 'ddp' or 'scaled'; got {self.buckets!r}")
        if self.buckets == "scaled" and self.bucket_cap_mb is not None:
            raise ValueError("buckets='scaled' computes the bucket cap: give bucket_cap_mb or buckets='scaled'")
        if not 0.0 <= self.label_noise < 1.0 or (self.label_noise and self.workload != "cnn"):
            raise ValueError("label_noise is a share in [0, 1) of the cnn workload's labels")
        if self.powersgd_rank < 1:
            raise ValueError("powersgd_rank must be at least 1")

    @property
    def learning_rate(self) -> float:
        return self.lr if self.lr is not None else WORKLOADS[self.workload]["lr"]

    @property
    def decay(self) -> float:
        return self.weight_decay if self.weight_decay is not None else WORKLOADS[self.workload]["weight_decay"]

    @property
    def warmup_steps(self) -> int:
        return self.warmup if self.warmup is not None else max(1, self.steps // 10)


#: name -> None (torch DDP) or the deft variant's settings.
VARIANTS: dict[str, dict[str, Any] | None] = {
    "ddp": None,
    "deft": {},  # DeftConfig() defaults: delayed_update="auto" (compensated for AdamW and SGD momentum)
    "deft-no-preserver": {"preserver": False},
    "deft-no-period": {"plan_options": {"allow_period": False}},
    "deft-sync": {"plan_options": {"max_staleness": 0, "allow_period": False}},
    # plain averaged delays (the semantics before "auto"), with the Preserver (its paired replay admits them)
    "deft-averaged": {"delayed_update": "averaged"},
    "deft-local": {"delayed_update": "local"},  # DeftConfig(delayed_update="local"), otherwise the defaults
    "deft-local-no-preserver": {"delayed_update": "local", "preserver": False},
    # each delayed semantics alone: delays only (no update period, which keeps the averaged semantics), no Preserver
    "deft-delays": {"delayed_update": "averaged", "preserver": False, "plan_options": {"allow_period": False}},
    "deft-local-delays": {"delayed_update": "local", "preserver": False, "plan_options": {"allow_period": False}},
    # the compensated semantics named (the default for this benchmark's optimizers), with and without the Preserver
    "deft-compensated": {"delayed_update": "compensated"},
    "deft-compensated-no-preserver": {"delayed_update": "compensated", "preserver": False},
    "deft-compensated-delays": {"delayed_update": "compensated", "preserver": False,
                                "plan_options": {"allow_period": False}},
    # peers at a high coverage rate: DDP with gradient compression (fp16; PowerSGD). DDP refuses a hook named
    # bf16_compress_hook on a CPU build of torch, although gloo all-reduces bfloat16 (docs/POLICIES.md)
    "ddp-fp16": {"ddp": {"hook": "fp16"}},
    "ddp-powersgd": {"ddp": {"hook": "powersgd"}},
    # post-local SGD, stock torch (``post_localSGD_hook`` on a one-rank subgroup, ``PostLocalSGDOptimizer`` with a
    # ``PeriodicModelAverager``): DDP's averaged steps for the first 30, then local steps with the parameters
    # averaged every 4
    "ddp-postlocal": {"ddp": {"postlocal": 4}},
    # deft's defaults held to a float32 wire (``DeftConfig(wire_dtypes=("float32",))``)
    "deft-float32": {"wire_dtypes": ["float32"]},
    # deft's defaults with bfloat16 the only 16-bit wire (no error feedback): what bfloat16's round-off costs
    "deft-bf16": {"wire_dtypes": ["float32", "bfloat16"]},
    # deft's defaults allowed the 8-bit wire too (``DeftConfig(wire_dtypes=WIRE_DTYPES)``), each bucket's wire by price
    "deft-int8": {"wire_dtypes": ["float32", "bfloat16", "float16", "int8"]},
    # a round-off control: DDP again, from initial weights one ulp away (a random direction per element)
    "ddp-ulp": {"ddp": {"perturb_ulps": 1}},
    # torch.compile(DDP) (DDPOptimizer splits the graph at bucket boundaries); Inductor unless the deft variants run
    # the aten route (then aot_eager)
    "ddp-compiled": {"ddp": {"compile": True}},
    # the synchronous policies through deft_compile (DDP's numbers; ByteScheduler and US-Byte run each update in the
    # next call)
    "wfbp": {"policy": "wfbp"},
    "bytescheduler": {"policy": "bytescheduler"},
    "usbyte": {"policy": "usbyte"},
}
DEFAULT_VARIANTS = ("ddp", "deft", "deft-no-preserver", "deft-no-period")
#: The targets by DDP's coverage rate: deft with defaults reaches DDP's final validation loss this many times
#: sooner (1.0 at CR ~1: never slower) ...
TARGET_SPEEDUPS: dict[int, float] = {1: 1.0, 2: 2.0, 3: 2.5}
TARGET_FINAL_EXCESS = 0.01  # ... and never ends more than 1 % above it


def run_stem(cfg: TTAConfig, coverage: float) -> str:
    """The file stem of one workload's launches at one coverage rate: ``tta_<workload>_<size>``, ``_scaled`` with
    scaled buckets, ``_noise<p>`` with label noise, ``_cr<rate>``."""
    return (f"tta_{cfg.workload}_{cfg.size}" + ("_scaled" if cfg.buckets == "scaled" else "")
            + (f"_noise{cfg.label_noise:g}" if cfg.label_noise else "") + f"_cr{coverage:g}")


def target_speedup(coverage: float | None) -> float:
    """The speed-up target at the coverage rate the link was calibrated to (the nearest of ``TARGET_SPEEDUPS``;
    an uncalibrated link: never slower than DDP)."""
    if coverage is None:
        return TARGET_SPEEDUPS[1]
    return TARGET_SPEEDUPS[min(TARGET_SPEEDUPS, key=lambda cr: abs(cr - coverage))]


@torch.no_grad()
def perturb_by_ulps(model: nn.Module, ulps: int, seed: int) -> None:
    """Move every parameter element ``ulps`` representable floats up or down (a seeded random direction per
    element): the smallest change of the initial weights, to measure how far round-off alone carries training."""
    generator = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        up = torch.rand(p.shape, generator=generator) < 0.5
        target = torch.where(up, torch.full_like(p, math.inf), torch.full_like(p, -math.inf))
        for _ in range(ulps):
            p.copy_(torch.nextafter(p, target))


def make_optimizer(model: nn.Module, lr: float = 1e-3, weight_decay: float = 0.1,
                   betas: tuple[float, float] = (0.9, 0.95)) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, betas=betas)


def lr_lambda(steps: int, warmup: int, min_ratio: float) -> Callable[[int], float]:
    """Factor of the peak learning rate at 0-based step ``t``: linear warm-up to 1 over ``warmup`` steps, then
    cosine decay to ``min_ratio`` at the last step."""

    def factor(t: int) -> float:
        if t < warmup:
            return (t + 1) / warmup
        progress = min(1.0, (t - warmup) / max(1, steps - warmup))
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


# --------------------------------------------------------------------------- data


class TextBatches:
    """Deterministic batches over the stdlib corpus: the same for every variant given ``seed``.

    The corpus's first ``1 - val_fraction`` is the training split, the rest the validation split. Step ``t``'s
    global batch is ``world_size x batch`` windows whose starts come from a generator seeded with ``seed`` (all
    steps drawn at once, so any step can be asked for in any order); rank ``r`` takes windows
    ``r*batch .. (r+1)*batch``. Validation: ``val_windows`` windows evenly spread over the held-out split, rank
    ``r`` evaluates every ``world_size``-th one.
    """

    def __init__(self, corpus: torch.Tensor, *, context: int, batch: int, steps: int, seed: int, rank: int,
                 world_size: int, val_windows: int, val_fraction: float = 0.1) -> None:
        split = int(corpus.numel() * (1.0 - val_fraction))
        self.train, self.val = corpus[:split], corpus[split:]
        if self.train.numel() <= context + 1 or self.val.numel() <= context + 1:
            raise ValueError(f"corpus of {corpus.numel()} bytes is too small for windows of {context}")
        self.context, self.batch, self.rank, self.world_size = context, batch, rank, world_size
        generator = torch.Generator().manual_seed(int(seed))
        self.starts = torch.randint(0, self.train.numel() - context, (steps, world_size * batch), generator=generator)
        val_starts = torch.linspace(0, self.val.numel() - context - 1, val_windows).long()
        self.val_starts = val_starts[rank::world_size]
        self.val_total = val_windows

    def _windows(self, data: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
        return torch.stack([data[s:s + self.context] for s in starts.tolist()]).long()

    def batch_at(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, labels) of this rank at 0-based ``step`` (labels = input ids: the model shifts them)."""
        mine = self.starts[step, self.rank * self.batch:(self.rank + 1) * self.batch]
        ids = self._windows(self.train, mine)
        return ids, ids.clone()

    def validation(self, chunk: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's share of the validation windows, in batches of ``chunk``: (input_ids, labels) pairs."""
        if not self.val_starts.numel():
            return []
        return [(ids, ids) for ids in self._windows(self.val, self.val_starts).split(chunk)]


def load_corpus(max_bytes: int) -> torch.Tensor:
    examples = str(Path(__file__).resolve().parents[1] / "examples")
    if examples not in sys.path:
        sys.path.append(examples)
    from corpus import load_stdlib_corpus

    return load_stdlib_corpus(max_bytes)


# --------------------------------------------------------------------------- worker


def _deft_counters(runner: Any) -> tuple[int, float, int, int]:
    """(graphs traced, seconds of the latest trace, staleness measurements by the Preserver, plans adopted) of a
    deft step; zeros for DDP. The only place this module reads the runtime's state (all public attributes)."""
    traces = int(getattr(runner, "trace_count", 0))
    trace_s = float(getattr(runner, "last_trace_seconds", 0.0))
    preserver = getattr(runner, "preserver", None)
    probes = len(preserver.staleness_log) if preserver is not None else 0
    plans = len(getattr(runner, "plan_history", ()))
    return traces, trace_s, probes, plans


#: GPT-2 124M's gradient bytes (124,439,808 float32 parameters, tied embeddings): the model DDP's default bucket cap
#: is scaled from for ``TTAConfig.buckets="scaled"``
REFERENCE_GRADIENT_BYTES = 124_439_808 * 4
DDP_BUCKET_CAP_MB = 25.0


def scaled_bucket_cap_mb(gradient_bytes: int) -> float:
    """DDP's default bucket cap (25 MiB) scaled by ``gradient_bytes`` over GPT-2 124M's: a model of a few million
    parameters then gets about as many buckets as DDP's defaults give GPT-2 124M (about 20), where the default cap
    would put all of it in one or two buckets (every delay all or nothing). The first bucket gets the same cap, as
    DDP gives it whenever ``bucket_cap_mb`` is set."""
    return DDP_BUCKET_CAP_MB * gradient_bytes / REFERENCE_GRADIENT_BYTES


def bucket_cap_of(cfg: TTAConfig, model: nn.Module) -> float | None:
    """The bucket cap every variant gets (MiB): ``bucket_cap_mb``, the scaled cap, or None for DDP's defaults."""
    if cfg.buckets == "scaled":
        return scaled_bucket_cap_mb(sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad))
    return cfg.bucket_cap_mb


def _register_hook(ddp: nn.parallel.DistributedDataParallel, hook: str, cfg: TTAConfig) -> None:
    """DDP's gradient compression: ``"fp16"`` (``default_hooks.fp16_compress_hook``) or ``"powersgd"`` (rank
    ``cfg.powersgd_rank``, warm start and error feedback on, vanilla all-reduce for the learning rate's warm-up)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if hook == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=cfg.powersgd_rank,
                                            start_powerSGD_iter=max(2, cfg.warmup_steps), warm_start=True,
                                            use_error_feedback=True, random_seed=cfg.seed)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    else:
        raise ValueError(f"unknown DDP communication hook {hook!r}")


#: post-local SGD's averaged warm-up (steps of plain DDP before the local steps start)
POST_LOCAL_WARMUP = 30


def _post_local(ddp: nn.parallel.DistributedDataParallel, optimizer: torch.optim.Optimizer,
                period: int) -> torch.optim.Optimizer:
    """Post-local SGD as torch ships it: ``post_localSGD_hook`` all-reduces gradients over the whole group for
    ``POST_LOCAL_WARMUP`` steps, then only within a one-rank subgroup (no communication); ``PostLocalSGDOptimizer``
    averages the parameters over the group every ``period`` steps after the warm-up."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as post_local
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.optim import PostLocalSGDOptimizer

    subgroup, _ = dist.new_subgroups(group_size=1)
    state = post_local.PostLocalSGDState(process_group=None, subgroup=subgroup,
                                         start_localSGD_iter=POST_LOCAL_WARMUP)
    ddp.register_comm_hook(state, post_local.post_localSGD_hook)
    return PostLocalSGDOptimizer(optim=optimizer,
                                 averager=PeriodicModelAverager(period=period, warmup_steps=POST_LOCAL_WARMUP))


class _Variant:
    """One variant's model, optimizer, schedule, step function, clock and records (one rank)."""

    def __init__(self, name: str, base: nn.Module, cfg: TTAConfig, bucket_cap_mb: float | None = None) -> None:
        from torch.optim.lr_scheduler import LambdaLR

        from deft_compile import DeftConfig, deft_compile
        from deft_compile.preserver import PreserverConfig

        self.name = name
        self.model = copy.deepcopy(base)
        if cfg.workload == "cnn":
            self.optimizer = tta_cnn.make_optimizer(self.model, cfg.learning_rate, cfg.decay)
        else:
            self.optimizer = make_optimizer(self.model, cfg.learning_rate, cfg.decay, tuple(cfg.betas))
        self.scheduler = LambdaLR(self.optimizer, lr_lambda(cfg.steps, cfg.warmup_steps, cfg.min_lr_ratio))
        spec = VARIANTS[name]
        self.deft = None
        self.ddp: nn.parallel.DistributedDataParallel | None = None
        self.torch_compiled = bool(spec and spec.get("ddp", {}).get("compile"))
        if spec is None or "ddp" in spec:
            controls = (spec or {}).get("ddp", {})
            if controls.get("perturb_ulps"):
                perturb_by_ulps(self.model, int(controls["perturb_ulps"]), seed=cfg.seed + 1)
            cap = bucket_cap_mb
            if controls.get("hook") == "powersgd":
                # one bucket: PowerSGD issues a bucket's second all-reduce from its first one's completion callback,
                # so with several buckets the ranks can issue them to gloo in different orders and the collectives
                # mismatch (seen with 13 buckets: a gloo size mismatch); one bucket keeps every rank's order
                cap = 2 * sum(p.numel() * p.element_size() for p in self.model.parameters()) / 2 ** 20
            ddp = self.ddp = nn.parallel.DistributedDataParallel(
                self.model, **({"bucket_cap_mb": cap} if cap is not None else {}))
            if controls.get("hook"):
                _register_hook(ddp, controls["hook"], cfg)
            if controls.get("postlocal"):
                self.optimizer = _post_local(ddp, self.optimizer, int(controls["postlocal"]))
            # torch.compile with the deft variants' compiler: Inductor, or aot_eager beside the aten route
            backend = "inductor" if cfg.compiler.startswith("inductor") else "aot_eager"
            forward = torch.compile(ddp, backend=backend) if controls.get("compile") else ddp
            optimizer = self.optimizer

            def run(*batch: torch.Tensor) -> torch.Tensor:
                optimizer.zero_grad(set_to_none=True)
                loss = forward(*batch)
                loss.backward()
                optimizer.step()
                return loss.detach()

            self.runner: Callable[..., torch.Tensor] = run
        else:
            options: dict[str, Any] = {"compiler": cfg.compiler, "plan_options": dict(spec.get("plan_options", {}))}
            if spec.get("preserver") is False:
                options["preserver"] = PreserverConfig(enabled=False)
            if "delayed_update" in spec:
                options["delayed_update"] = spec["delayed_update"]
            if "wire_dtypes" in spec:
                options["wire_dtypes"] = tuple(spec["wire_dtypes"])
            # DDP's buckets: with a cap given, its first bucket has that cap too
            caps = {"bucket_cap_mb": bucket_cap_mb, "first_bucket_mb": bucket_cap_mb} if bucket_cap_mb else {}
            self.deft = deft_compile(self.model, self.optimizer, None, policy=spec.get("policy", "deft"),
                                     config=DeftConfig(**caps, **options))
            self.runner = self.deft
        self.step = 0
        self.clock = 0.0  # this rank's training seconds
        self.losses: list[float] = []
        self.step_s: list[float] = []
        self.traced: list[float] = []  # graphs captured by the call
        self.trace_s: list[float] = []  # seconds of those traces (the last one's, when a call traced several)
        self.probed: list[float] = []  # staleness measurements by the Preserver in the call
        self.replanned: list[float] = []  # plans adopted in the call
        self.flush_s = 0.0
        self.flush_traces = 0
        self.drift: list[dict[str, float]] = []  # replica drift before each flush (delayed_update="local")
        self.sync_s = 0.0
        self.evals: list[dict[str, float]] = []

    def train_step(self, batches: Any) -> None:
        batch = batches.batch_at(self.step)
        before = _deft_counters(self.runner)
        started = time.perf_counter()
        loss = self.runner(*batch)
        self.scheduler.step()
        elapsed = time.perf_counter() - started
        after = _deft_counters(self.runner)
        self.clock += elapsed
        self.step_s.append(elapsed)
        self.traced.append(float(after[0] - before[0]))
        self.trace_s.append(after[1] if after[0] > before[0] else 0.0)
        self.probed.append(float(after[2] - before[2]))
        self.replanned.append(float(after[3] - before[3]))
        self.losses.append(float(loss))
        self.step += 1

    def settle(self) -> None:
        """Wait for this variant's communication in flight (timed, on its clock): gloo's barrier completes every
        earlier collective of the group first."""
        import torch.distributed as dist

        started = time.perf_counter()
        dist.barrier()
        elapsed = time.perf_counter() - started
        self.clock += elapsed
        self.sync_s += elapsed

    @torch.no_grad()
    def replica_drift(self) -> float:
        """max over ranks of ‖w_r − w̄‖ / ‖w̄‖ over every parameter (untimed; one all-reduce of the model): how far
        the replicas have drifted apart before a flush (``delayed_update="local"``; 0 for identical replicas)."""
        import torch.distributed as dist

        flat = torch.cat([p.detach().reshape(-1) for p in self.model.parameters()]).double()
        mean = flat.clone()
        dist.all_reduce(mean)
        mean /= dist.get_world_size()
        ratio = torch.tensor([float((flat - mean).norm() / mean.norm().clamp_min(1e-30))], dtype=torch.float64)
        dist.all_reduce(ratio, op=dist.ReduceOp.MAX)
        return float(ratio)

    def flush(self) -> None:
        """Apply pending delayed / accumulated gradients (deft), timed on the clock."""
        if self.deft is None:
            return
        if self.deft.config.delayed_update == "local":
            self.drift.append({"step": self.step, "relative_drift": self.replica_drift()})
        traces = self.deft.trace_count
        started = time.perf_counter()
        self.deft.flush()
        elapsed = time.perf_counter() - started
        self.clock += elapsed
        self.flush_s += elapsed
        self.flush_traces += self.deft.trace_count - traces

    @torch.no_grad()
    def evaluate(self, batches: Any) -> None:
        """Validation loss over every rank's share (untimed), recorded with the slowest rank's clock."""
        import torch.distributed as dist

        was_training = self.model.training
        self.model.train(False)
        total = torch.zeros(2, dtype=torch.float64)
        for batch in batches.validation():
            total[0] += float(self.model(*batch)) * batch[0].shape[0]
            total[1] += batch[0].shape[0]
        self.model.train(was_training)
        dist.all_reduce(total)
        clock = torch.tensor([self.clock], dtype=torch.float64)
        dist.all_reduce(clock, op=dist.ReduceOp.MAX)
        self.evals.append({"step": self.step, "time_s": float(clock), "val_loss": float(total[0] / total[1])})

    def result(self, world_size: int) -> dict[str, Any]:
        """Plain data; per-step times are the slowest rank's, losses the all-rank mean (collective: every rank)."""
        import torch.distributed as dist

        def reduced(values: list[float], op: Any) -> list[float]:
            tensor = torch.tensor(values, dtype=torch.float64)
            dist.all_reduce(tensor, op=op)
            return tensor.tolist()

        losses = [v / world_size for v in reduced(self.losses, dist.ReduceOp.SUM)]
        out: dict[str, Any] = {
            "evals": self.evals, "train_loss": losses,
            "step_s": reduced(self.step_s, dist.ReduceOp.MAX),
            "traced": reduced(self.traced, dist.ReduceOp.MAX),
            "trace_s": reduced(self.trace_s, dist.ReduceOp.MAX),
            "probed": reduced(self.probed, dist.ReduceOp.MAX),
            "replanned": reduced(self.replanned, dist.ReduceOp.MAX),
            "flush_s": reduced([self.flush_s], dist.ReduceOp.MAX)[0],
            "flush_traces": self.flush_traces,
            "replica_drift": self.drift,
            "sync_s": reduced([self.sync_s], dist.ReduceOp.MAX)[0],
            "train_s": reduced([self.clock], dist.ReduceOp.MAX)[0],
            "torch_compile": self.torch_compiled,
        }
        if self.ddp is not None:  # DDP's buckets after its first iteration's rebuild
            logged = self.ddp._get_ddp_logging_data()
            sizes = str(logged.get("rebuilt_bucket_sizes") or logged.get("bucket_sizes", ""))
            out["ddp_buckets"] = len([size for size in sizes.split(",") if size.strip()])
        if self.deft is not None:
            out.update(_plan_record(self.deft))
            out["delayed_update"] = self.deft.delayed_update
            out["runtime_overheads"] = {key: reduced([float(v)], dist.ReduceOp.MAX)[0]
                                        for key, v in sorted(self.deft.overheads.items())}
        return out


def _plan_record(step: Any) -> dict[str, Any]:
    """What the deft step planned: its final plan's delayed / periodic items, every plan change, the Preserver's
    decisions, graph count."""
    plan = step.plan
    items = list(plan.items) if plan is not None else []
    preserver = step.preserver
    return {
        "plan": {"items": len(items), "delayed_items": sum(1 for i in items if i.delay),
                 "periodic_items": sum(1 for i in items if i.period > 1),
                 "max_period": max((i.period for i in items), default=1),
                 "table": plan.table(step.profile) if plan is not None and step.profile is not None else None},
        "plan_history": [{k: v for k, v in h.items() if isinstance(v, (str, int, float, bool, type(None)))}
                         for h in step.plan_history],
        "preserver_events": [str(e) for e in preserver.history] if preserver is not None else [],
        "staleness_measurements": len(preserver.staleness_log) if preserver is not None else 0,
        "trace_count": step.trace_count,
        # what the last plan was solved from (profile in, plan out): the solver can be re-run on it offline
        "solver_inputs": _solver_inputs(step, preserver),
    }


def _solver_inputs(step: Any, preserver: Any) -> dict[str, Any] | None:
    """The step's profile, the Preserver's standing options and the options its last full window of measurements
    prices (``priced_options``): what the deft solver solves from, so a plan can be solved again offline."""
    if preserver is None or step.profile is None:
        return None
    from deft_compile.preserver.pricing import compute_ms

    pricer = preserver.pricer
    latest = preserver.priced_options(pricer.prices(compute_ms(step.profile))) if pricer.ready else None
    return {"profile": step.profile.to_dict(), "options": _plain(preserver.options), "latest_priced": _plain(latest)}


def _plain(value: Any) -> Any:
    """``value`` with tuples as lists and anything that is not JSON's as its ``str``."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value if isinstance(value, (str, int, float, bool, type(None))) else str(value)


def tta_worker(rank: int, world_size: int, cfg_dict: dict[str, Any]) -> dict[str, Any]:
    """One rank of one seed: every variant, interleaved in chunks. Returns plain data (rank 0's is complete)."""
    cfg = TTAConfig(**cfg_dict)
    batches: TextBatches | tta_cnn.ImageBatches
    if cfg.workload == "cnn":
        batches = tta_cnn.ImageBatches(size=cfg.size, batch=cfg.batch, seed=cfg.seed, rank=rank,
                                       world_size=world_size, val_images=cfg.val_windows, label_noise=cfg.label_noise)
    else:
        batches = TextBatches(load_corpus(cfg.corpus_bytes), context=context_of(cfg.size), batch=cfg.batch,
                              steps=cfg.steps, seed=cfg.seed, rank=rank, world_size=world_size,
                              val_windows=cfg.val_windows, val_fraction=cfg.val_fraction)
    torch.manual_seed(cfg.seed)
    base = tta_cnn.build_model(cfg.size) if cfg.workload == "cnn" else build_model(cfg.size)
    cap = bucket_cap_of(cfg, base)
    if cap is not None:
        # torch.compile(DDP)'s DDPOptimizer takes torch's default first bucket (1 MiB) and refuses a cap below it;
        # with this process's default set to the cap its first bucket is the cap, as DDP's own is whenever a cap is
        # given (every DDP here is given one explicitly, so nothing else reads the default)
        import torch.distributed as dist

        dist._DEFAULT_FIRST_BUCKET_BYTES = int(cap * 2 ** 20)
    variants = {name: _Variant(name, base, cfg, cap) for name in cfg.variants}
    for variant in variants.values():
        variant.evaluate(batches)  # step 0: every variant from the same weights

    def log(message: str) -> None:
        if rank == 0 and cfg.progress:
            print(f"[tta seed {cfg.seed}] {message}", file=sys.stderr, flush=True)

    names = list(variants)
    round_index = 0
    while any(v.step < cfg.steps for v in variants.values()):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            variant = variants[name]
            end = min(cfg.steps, variant.step + cfg.chunk)
            while variant.step < end:
                variant.train_step(batches)
                if variant.step % cfg.eval_every == 0 or variant.step == cfg.steps:
                    variant.flush()
                    variant.settle()
                    variant.evaluate(batches)
                    last = variant.evals[-1]
                    log(f"{name:<18} step {last['step']:>5}/{cfg.steps}  val {last['val_loss']:.4f}  "
                        f"train clock {last['time_s']:.1f} s")
            variant.settle()
        round_index += 1
    out: dict[str, Any] = {"variants": {name: v.result(world_size) for name, v in variants.items()}}
    if rank == 0:
        params = [p for p in base.parameters() if p.requires_grad]
        per_sample = context_of(cfg.size) if cfg.workload == "gpt2" else 1
        out.update(params=sum(p.numel() for p in params),
                   gradient_bytes=sum(p.numel() * p.element_size() for p in params),
                   train_bytes=batches.train.numel() if cfg.workload == "gpt2" else None,
                   val_bytes=batches.val.numel() if cfg.workload == "gpt2" else None,
                   tokens_per_step=world_size * cfg.batch * per_sample, world_size=world_size, bucket_cap_mb=cap,
                   ddp_buckets=out["variants"]["ddp"].get("ddp_buckets"))
    return out


# --------------------------------------------------------------------------- analysis (pure)


#: A loss within this relative distance of the target reaches it: a synchronous deft plan computes DDP's numbers up
#: to float round-off (aten vs eager kernels order sums differently) and must not be "never" for a 1e-7 miss.
REACH_RTOL = 1e-4


def time_to_target(points: Sequence[tuple[float, float]], target: float, rtol: float = REACH_RTOL) -> float | None:
    """First x at which the curve ``[(x, loss), ...]`` (sorted by x) reaches ``loss <= target x (1 + rtol)``,
    linearly interpolated between the last evaluation above the target and the first at or below it (the crossing
    of ``target`` itself, or that evaluation's x when the round-off band alone reached it); None if never."""
    reach = target * (1.0 + rtol)
    previous: tuple[float, float] | None = None
    for x, loss in points:
        if loss <= reach:
            if previous is None or previous[1] <= loss or loss > target:
                return float(x)
            x0, l0 = previous
            return float(x0 + (l0 - target) / (l0 - loss) * (x - x0))
        previous = (x, loss)
    return None


def overheads(value: dict[str, Any]) -> dict[str, float | None]:
    """A variant's overheads in seconds and as shares of its training clock (``train_s``).

    ``base_step_s`` is the median of its plain steps (after the first; no graph captured, no staleness
    measurement). ``first_step``: the first call's excess over it (profiling, planning, first trace);
    ``retrace``: excess of later calls that captured a graph; ``probe``: excess of calls in which the Preserver
    measured the staleness error, or the runtime's own measurement of them when the record has it
    (``runtime_overheads``: ``CompiledStep.overheads``; a call that did both: the trace's own seconds,
    ``trace_s``, go to ``retrace``); ``flush``: evaluation flushes, including the flush
    graphs they traced (applying pending gradients early: an artifact of evaluating); ``chunk_sync``:
    chunk-boundary and pre-evaluation barriers (they absorb the communication left in flight, which a run
    without interleaving would overlap with the next step). Shares are clamped to [0, 1]."""
    steps = value["step_s"]
    traced, probed = value["traced"], value["probed"]
    trace_s = value.get("trace_s") or [0.0] * len(steps)
    plain = [t for i, t in enumerate(steps) if i > 0 and not traced[i] and not probed[i]]
    base = statistics.median(plain) if plain else (statistics.median(steps) if steps else 0.0)
    first = max(0.0, steps[0] - base) if steps else 0.0
    retrace = probe = 0.0
    for i in range(1, len(steps)):
        excess = max(0.0, steps[i] - base)
        if traced[i] and probed[i]:
            retrace += min(excess, trace_s[i])
            probe += excess - min(excess, trace_s[i])
        elif traced[i]:
            retrace += excess
        elif probed[i]:
            probe += excess
    measured = value.get("runtime_overheads")
    compiled = {}
    if measured is not None:  # the runtime's own account of its staleness measurements (CompiledStep.overheads)
        probe = measured["probe_seconds"]
        # inside the first step and the retraces: Inductor's compiles, the planning (profile, solve) and the
        # step's make_fx captures
        compiled = {"compile_s": float(measured.get("compile_seconds", 0.0)),
                    "planning_s": float(measured.get("planning_seconds", 0.0)),
                    "capture_s": float(measured.get("capture_seconds", 0.0))}
    elif value.get("torch_compile"):  # torch.compile(DDP) compiles forward and backward inside its first call
        compiled = {"compile_s": first, "planning_s": 0.0, "capture_s": 0.0}
    seconds = {"first_step": first, "retrace": retrace, "probe": probe, "flush": value.get("flush_s", 0.0),
               "chunk_sync": value.get("sync_s", 0.0)}
    total = value["train_s"]
    out: dict[str, float | None] = {"base_step_s": base, "train_s": total,
                                    "retraced_steps": float(sum(1 for i in range(1, len(steps)) if traced[i])),
                                    "probe_steps": float(sum(1 for p in probed if p)),
                                    "trace_s": float(sum(trace_s)),
                                    "flush_traces": float(value.get("flush_traces", 0)), **compiled}
    for key, s in seconds.items():
        out[f"{key}_s"] = s
        out[f"{key}_share"] = min(1.0, max(0.0, s / total)) if total > 0 else None
    runtime = seconds["first_step"] + seconds["retrace"] + seconds["probe"]
    out["runtime_s"] = runtime
    out["runtime_share"] = min(1.0, max(0.0, runtime / total)) if total > 0 else None
    return out


def summarise_seed(value: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per variant of one seed's run: final validation loss and its excess over DDP's, the time (training clock,
    seconds) and steps to first reach DDP's final validation loss (interpolated, None = never), the speed-up
    (DDP's time to its own final loss / the variant's), step-time and sample-efficiency factors, overheads."""
    variants = value["variants"]
    ddp = variants["ddp"]
    target = ddp["evals"][-1]["val_loss"]
    ddp_time = time_to_target([(e["time_s"], e["val_loss"]) for e in ddp["evals"]], target)
    ddp_steps = time_to_target([(e["step"], e["val_loss"]) for e in ddp["evals"]], target)
    # the looser target: within the final-loss tolerance of DDP's final loss (a variant that ends just above DDP's
    # loss never reaches it exactly, however fast it gets close)
    near = target * (1.0 + TARGET_FINAL_EXCESS)
    ddp_near = time_to_target([(e["time_s"], e["val_loss"]) for e in ddp["evals"]], near)
    ddp_over = overheads(ddp)
    rows: dict[str, dict[str, Any]] = {}
    for name, v in variants.items():
        final = v["evals"][-1]["val_loss"]
        seconds = time_to_target([(e["time_s"], e["val_loss"]) for e in v["evals"]], target)
        steps = time_to_target([(e["step"], e["val_loss"]) for e in v["evals"]], target)
        over = overheads(v)
        compile_s = over.get("compile_s") or 0.0
        # the same curve with the compile seconds taken out (they all fall in the first call, before any evaluation
        # but the one at step 0): what the run costs once the compiled graphs are in the cache
        warm = time_to_target([(max(0.0, e["time_s"] - compile_s) if e["step"] else 0.0, e["val_loss"])
                               for e in v["evals"]], target)
        seconds_near = time_to_target([(e["time_s"], e["val_loss"]) for e in v["evals"]], near)
        rows[name] = {
            "target": target, "final_loss": final,
            "speedup_near": ddp_near / seconds_near if seconds_near and ddp_near is not None else None, "final_vs_ddp": final / target - 1.0,
            "total_s": v["evals"][-1]["time_s"], "time_to_target_s": seconds, "steps_to_target": steps,
            "speedup": ddp_time / seconds if seconds and ddp_time is not None else None,
            "compile_s": compile_s,
            "speedup_without_compile": ddp_time / warm if warm and ddp_time is not None else None,
            "base_step_s": over["base_step_s"],
            "step_speedup": ddp_over["base_step_s"] / over["base_step_s"] if over["base_step_s"] else None,
            "step_efficiency": ddp_steps / steps if steps and ddp_steps is not None else None,
            "overheads": over,
        }
        for key in ("plan", "plan_history", "preserver_events", "trace_count", "staleness_measurements",
                    "delayed_update"):
            if key in v:
                rows[name][key] = v[key]
    return rows


def _mean(values: Sequence[float | None]) -> float | None:
    return statistics.fmean(values) if values and all(v is not None for v in values) else None


def summarise(runs: dict[int, dict[str, Any]], coverage: float | None = None) -> dict[str, Any]:
    """Per seed (``summarise_seed``) and across seeds: means of final excess, speed-up (None when any seed never
    reached the target), step-time and sample-efficiency factors and overhead shares; whether the issue's
    targets at ``coverage`` (``target_speedup``) were met by ``deft``."""
    per_seed = {seed: summarise_seed(value) for seed, value in sorted(runs.items())}
    names = list(next(iter(per_seed.values()))) if per_seed else []
    aggregate: dict[str, dict[str, Any]] = {}
    for name in names:
        rows = [per_seed[s][name] for s in per_seed]
        shares = {key: _mean([r["overheads"][f"{key}_share"] for r in rows])
                  for key in ("first_step", "retrace", "probe", "flush", "chunk_sync", "runtime")}
        aggregate[name] = {
            "seeds": len(rows), "reached": sum(1 for r in rows if r["time_to_target_s"] is not None),
            "final_loss": _mean([r["final_loss"] for r in rows]),
            "final_vs_ddp": _mean([r["final_vs_ddp"] for r in rows]),
            "worst_final_vs_ddp": max(r["final_vs_ddp"] for r in rows),
            "speedup": _mean([r["speedup"] for r in rows]),
            "speedup_without_compile": _mean([r["speedup_without_compile"] for r in rows]),
            "speedup_near": _mean([r["speedup_near"] for r in rows]),
            "compile_s": _mean([r["compile_s"] for r in rows]),
            "min_speedup": min(r["speedup"] for r in rows) if all(r["speedup"] is not None for r in rows) else None,
            "step_speedup": _mean([r["step_speedup"] for r in rows]),
            "step_efficiency": _mean([r["step_efficiency"] for r in rows]),
            "overhead_shares": shares,
        }
    deft = aggregate.get("deft")
    targets = None
    if deft is not None:
        targets = {
            "speedup": deft["min_speedup"], "speedup_target": target_speedup(coverage),
            "speedup_met": deft["min_speedup"] is not None and deft["min_speedup"] >= target_speedup(coverage),
            "worst_final_vs_ddp": deft["worst_final_vs_ddp"], "final_target": TARGET_FINAL_EXCESS,
            "final_met": deft["worst_final_vs_ddp"] <= TARGET_FINAL_EXCESS,
        }
    return {"per_seed": per_seed, "aggregate": aggregate, "targets": targets}


def _fmt(value: float | None, pattern: str, missing: str = "never") -> str:
    return pattern.format(value) if value is not None else missing


def markdown_table(summary: dict[str, Any]) -> str:
    """The results table: one row per variant (seed means; per-seed values in brackets where they matter)."""
    lines = [("| variant | final val loss | vs DDP's final | time to DDP's final loss (s) | speed-up vs DDP | "
              "without compile | to within 1 % | compile (s) | steady step (s) | step speed-up | step efficiency | "
              "runtime overheads (first / retrace / probe) | eval flush / chunk sync |"),
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    per_seed = summary["per_seed"]
    for name, agg in summary["aggregate"].items():
        rows = [per_seed[s][name] for s in per_seed]
        times = ", ".join(_fmt(r["time_to_target_s"], "{:.3g}") for r in rows)
        speedups = ", ".join(_fmt(r["speedup"], "{:.2f}x") for r in rows)
        shares = agg["overhead_shares"]
        lines.append(
            f"| {name} | {_fmt(agg['final_loss'], '{:.4f}', '-')} | {_fmt(agg['final_vs_ddp'], '{:+.2%}', '-')} "
            f"(worst {agg['worst_final_vs_ddp']:+.2%}) | {times} | {_fmt(agg['speedup'], '{:.2f}x')} ({speedups}) | "
            f"{_fmt(agg['speedup_without_compile'], '{:.2f}x')} | {_fmt(agg['speedup_near'], '{:.2f}x')} | "
            f"{_fmt(agg['compile_s'], '{:.1f}', '-')} | "
            f"{_fmt(_mean([r['base_step_s'] for r in rows]), '{:.3f}', '-')} | "
            f"{_fmt(agg['step_speedup'], '{:.2f}x', '-')} | {_fmt(agg['step_efficiency'], '{:.2f}', 'never')} | "
            f"{_fmt(shares['first_step'], '{:.1%}', '-')} / {_fmt(shares['retrace'], '{:.1%}', '-')} / "
            f"{_fmt(shares['probe'], '{:.1%}', '-')} | {_fmt(shares['flush'], '{:.1%}', '-')} / "
            f"{_fmt(shares['chunk_sync'], '{:.1%}', '-')} |")
    return "\n".join(lines)


TABLE_NOTE = (
    "Times are each variant's own training clock (evaluation excluded), the slowest rank's. *time to DDP's final "
    "loss*: first time the validation loss is at or below DDP's final validation loss of the same seed (within a "
    "relative 1e-4: round-off), linearly interpolated between evaluations (per seed). *speed-up*: DDP's time to that loss / the variant's (seed mean; "
    "per seed in brackets). *without compile*: the same with the variant's compile seconds (*compile*: Inductor's, "
    "inside its first call; deft variants of one process share Inductor's caches, so the first to run pays for graphs "
    "they share) taken off its clock. *to within 1 %*: the speed-up to a loss 1 % above DDP's final one (DDP's time to "
    "it / the variant's). *steady step*: median of plain steps. *step speed-up*: DDP's steady step / the "
    "variant's (what the schedule buys per step). *step efficiency*: DDP's steps to the target / the variant's "
    "(what staleness and periods cost per step; < 1 = more steps needed). *runtime overheads*: share of the "
    "training clock spent in the first step's profiling/planning/trace, in retraces and in the Preserver's "
    "staleness measurements, each as excess over a steady step. *eval flush / chunk sync*: benchmark artifacts "
    "(applying pending gradients before each evaluation; waiting for communication in flight at chunk ends).")


def plot_curves(runs: dict[int, dict[str, Any]], out_dir: str | os.PathLike, stem: str = "time_to_accuracy",
                title: str = "", unit: str = "nats/byte") -> list[str]:
    """Two PNGs, ``<stem>_time.png`` (validation loss vs training wall-clock seconds) and ``<stem>_steps.png``
    (vs steps), each with the whole run (log scale) and a zoom on the end, where DDP's final loss (dotted, per
    seed) is crossed. One colour per variant, one line style per seed. Returns the paths ([] without
    matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FormatStrFormatter
    except ImportError:
        print("matplotlib is not installed: no plots (pip install 'deft-compile[plot]')", file=sys.stderr)
        return []
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    styles = ["-", "--", ":", "-."]
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    targets = [value["variants"]["ddp"]["evals"][-1]["val_loss"] for value in runs.values()]
    finals = [v["evals"][-1]["val_loss"] for value in runs.values() for v in value["variants"].values()]
    low, high = min(finals + targets), max(targets)
    written = []
    for key, label, suffix in (("time_s", "training wall-clock time (s, evaluation excluded)", "time"),
                               ("step", "step", "steps")):
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
        try:
            names: list[str] = []
            end_x = 0.0
            for k, (seed, value) in enumerate(sorted(runs.items())):
                for name, v in value["variants"].items():
                    if name not in names:
                        names.append(name)
                    xs = [e[key] for e in v["evals"]]
                    ys = [e["val_loss"] for e in v["evals"]]
                    end_x = max(end_x, xs[-1])
                    for ax in axes:
                        ax.plot(xs, ys, styles[k % len(styles)], color=colours[names.index(name) % len(colours)],
                                marker=".", markersize=4, label=f"{name} (seed {seed})")
                for ax in axes:
                    ax.axhline(value["variants"]["ddp"]["evals"][-1]["val_loss"], color="grey", linewidth=0.8,
                               linestyle=":")
            full, zoom = axes
            full.set_yscale("log")
            full.yaxis.set_major_formatter(FormatStrFormatter("%.1f"))
            full.yaxis.set_minor_formatter(FormatStrFormatter("%.1f"))
            full.set_ylabel(f"validation loss ({unit}, log scale)")
            full.set_title(title or "validation loss (dotted: DDP's final loss, per seed)", fontsize=9)
            zoom.set_ylim(low - 0.02 * high, high * 1.10)
            zoom.set_xlim(0.4 * end_x, end_x * 1.02)
            zoom.set_title("zoom: the end of the runs", fontsize=9)
            for ax in axes:
                ax.set_xlabel(label)
                ax.grid(alpha=0.3, which="both")
            full.legend(fontsize=7, ncol=2)
            path = out / f"{stem}_{suffix}.png"
            fig.tight_layout()
            fig.savefig(path, dpi=110)
            written.append(str(path))
        finally:
            plt.close(fig)
    return written


BEGIN, END = "<!-- tta:begin -->", "<!-- tta:end -->"


def write_docs_section(path: str | os.PathLike, body: str) -> None:
    """Replace the text between ``BEGIN`` and ``END`` in ``path`` with ``body`` (markers kept); appends a marked
    section when the markers are missing."""
    docs = Path(path)
    text = docs.read_text() if docs.exists() else ""
    block = f"{BEGIN}\n{body.strip()}\n{END}"
    if BEGIN in text and END in text and text.index(BEGIN) < text.index(END):
        text = text[:text.index(BEGIN)] + block + text[text.index(END) + len(END):]
    else:
        text += ("\n" if text and not text.endswith("\n") else "") + "\n## Results\n\n" + block + "\n"
    docs.write_text(text)


def results_section(record: dict[str, Any], docs_dir: Path | None = None) -> str:
    """Markdown for the docs: provenance, the coverage rate, the table, the targets, the plots."""
    meta, summary = record["meta"], record["summary"]
    cfg = record["config"]
    workload = cfg.get("workload", "gpt2")
    if workload == "cnn":
        layout = tta_cnn.SIZES[cfg["size"]]
        model = (f"Model: ResNet `{cfg['size']}` (widths {layout['widths']}, {layout['blocks']} block per stage, "
                 f"BatchNorm; {record['params'] / 1e3:.0f} k parameters) on {layout['image']}x{layout['image']} "
                 f"teacher-labelled images"
                 + (f" ({cfg['label_noise']:.0%} of labels random)" if cfg.get("label_noise") else "")
                 + f", SGD momentum 0.9, lr {cfg['lr'] or WORKLOADS['cnn']['lr']:g} "
                 f"(warm-up, cosine), {cfg['steps']} steps, {record['world_size']} workers x {cfg['batch']} images "
                 f"per step, evaluation every {cfg['eval_every']} steps on {cfg['val_windows']} fixed images, "
                 f"chunks of {cfg['chunk']} steps; seeds {', '.join(map(str, record['seeds']))}.")
    else:
        model = (f"Model: GPT-2 `{cfg['size']}` ({record['params'] / 1e6:.2f} M parameters, "
                 f"{record['gradient_bytes'] / (1 << 20):.1f} MiB of gradients), AdamW, {cfg['steps']} steps, "
                 f"{record['tokens_per_step']} tokens per step ({record['world_size']} workers x {cfg['batch']} x "
                 f"{SIZES[cfg['size']]['n_positions']}), evaluation every {cfg['eval_every']} steps on "
                 f"{cfg['val_windows']} held-out windows, chunks of {cfg['chunk']} steps; "
                 f"seeds {', '.join(map(str, record['seeds']))}.")
    lines = [f"Generated by `{meta['command']}` on {meta['date']} ({meta['host']}; wall {meta['wall_s'] / 60:.0f} min).",
             "", model + " " + buckets_sentence(record),
             f"Emulated accelerator (compute and gloo threads on separate cores): "
             f"{'on' if meta.get('emulate_accelerator') else 'off'}. Network: {record['network']}; coverage rate of DDP (all-reduce of all gradients / no-communication "
             f"step) {_fmt(record.get('coverage_rate'), '{:.2f}', 'not measured')}"
             + (f" (target {record['coverage_target']:g})" if record.get("coverage_target") else "") + ".",
             "", *measured_lines([record]), markdown_table(summary), "", TABLE_NOTE, ""]
    targets = summary.get("targets")
    if targets:
        lines.append(f"Targets for `deft`: speed-up >= {targets['speedup_target']}x in every seed: "
                     f"{_fmt(targets['speedup'], '{:.2f}x')} (worst seed) -> **{'met' if targets['speedup_met'] else 'not met'}**; "
                     f"final loss at most {targets['final_target']:.0%} above DDP's: worst {targets['worst_final_vs_ddp']:+.2%} -> "
                     f"**{'met' if targets['final_met'] else 'not met'}**.")
        lines.append("")
    for seed, rows in summary["per_seed"].items():
        for name, row in rows.items():
            if row.get("plan") is not None:
                changes = "; ".join(f"step {h['step']}: {h['reason']}" for h in row.get("plan_history", [])[1:])
                most = max((h.get("delayed_items", 0) for h in row.get("plan_history", [])), default=0)
                semantics = f" ({row['delayed_update']} delays)" if row.get("delayed_update") else ""
                lines.append(f"- seed {seed}, `{name}`{semantics}: final plan {row['plan']['delayed_items']}/"
                             f"{row['plan']['items']} items delayed (at most {most} in any plan that ran), "
                             f"{row['plan']['periodic_items']} periodic (K <= {row['plan']['max_period']}); "
                             f"{row['trace_count']} graphs; plan changes: {changes or 'none'}")
    lines.append("")
    for png in record.get("pngs", []):
        rel = os.path.relpath(png, docs_dir) if docs_dir is not None else png
        lines.append(f"![{Path(png).stem}]({rel})")
    return "\n".join(lines)


def buckets_sentence(record: dict[str, Any]) -> str:
    """How the gradients were bucketed: DDP's default caps, a given cap, or the scaled one (with DDP's bucket
    count where the run recorded it)."""
    cfg, cap, count = record["config"], record.get("bucket_cap_mb"), record.get("ddp_buckets")
    counted = f"{count} DDP buckets" if count else "DDP's buckets"
    if cfg.get("buckets") == "scaled" and cap:
        return (f"{counted}: bucket cap {cap * 1024:.0f} KiB, DDP's 25 MiB scaled by this model's gradient bytes "
                f"over GPT-2 124M's, for DDP (first bucket included) and every deft variant.")
    if cap:
        return f"{counted}: bucket cap {cap:g} MiB for DDP (first bucket included) and every deft variant."
    return f"{counted} with DDP's default caps (1 MiB first, 25 MiB)" + (f": {count}." if count else ".")


def measured_lines(records: Sequence[dict[str, Any]]) -> list[str]:
    """The lines a table of these records' numbers carries right above it (``deft_compile.tools.provenance``): one
    per results file, then a blank line; none for records without provenance or a results file."""
    from deft_compile.tools.provenance import measured_line

    lines = [measured_line(r["provenance"], r["results_file"]) for r in records
             if r.get("provenance") and r.get("results_file")]
    return lines + [""] if lines else []


def overview_table(records: Sequence[dict[str, Any]]) -> str:
    """One row per launch set (workload x coverage rate): each variant's speed-up to DDP's final loss and its final
    loss against DDP's (seed means; the worst seed's excess), and whether ``deft`` met the targets."""
    names: list[str] = []
    for record in records:
        names += [n for n in record["summary"]["aggregate"] if n not in names and n != "ddp"]
    lines = ["| workload | DDP's CR | " + " | ".join(f"`{n}`" for n in names) + " | deft targets |",
             "| --- | --- | " + " | ".join("---" for _ in names) + " | --- |"]
    for record in records:
        aggregate, targets = record["summary"]["aggregate"], record["summary"].get("targets")
        label = workload_label(record)
        cells = []
        for name in names:
            agg = aggregate.get(name)
            cells.append("-" if agg is None else
                         f"{_fmt(agg['speedup'], '{:.2f}x')} ({_fmt(agg.get('speedup_near'), '{:.2f}x')}), "
                         f"{agg['final_vs_ddp']:+.2%}")
        verdict = "-" if not targets else (
            f"{targets['speedup_target']:g}x: {'met' if targets['speedup_met'] else 'not met'}; "
            f"+{targets['final_target']:.0%}: {'met' if targets['final_met'] else 'not met'}")
        lines.append(f"| {label} | {coverage_cell(record)} | " + " | ".join(cells) + f" | {verdict} |")
    return "\n".join(lines)


#: how far the measured coverage rate may be from the one the link was calibrated to and still count as it
COVERAGE_TOLERANCE = 0.15


def coverage_cell(record: dict[str, Any]) -> str:
    """DDP's measured coverage rate, and where it missed the calibration target by more than ``COVERAGE_TOLERANCE``
    (relative), the target it missed: a row is at the rate it measured, not the one it asked for."""
    measured, target = record.get("coverage_rate"), record.get("coverage_target")
    cell = _fmt(measured, "{:.2f}", "-")
    if measured is not None and target and abs(measured - target) > COVERAGE_TOLERANCE * target:
        cell += f" (target {target:g}, outside ±{COVERAGE_TOLERANCE:.0%})"
    return cell


def workload_label(record: dict[str, Any]) -> str:
    """``<workload> <size>``, with DDP's bucket count when its caps were scaled or given, and the label noise."""
    cfg = record["config"]
    label = f"{cfg.get('workload', 'gpt2')} {cfg['size']}"
    extras = []
    if cfg.get("buckets") == "scaled" or cfg.get("bucket_cap_mb"):
        count = record.get("ddp_buckets")
        extras.append(f"{count} buckets" if count else "buckets capped")
    if cfg.get("label_noise"):
        extras.append(f"label noise {cfg['label_noise']:g}")
    return label + (f" ({', '.join(extras)})" if extras else "")


OVERVIEW_NOTE = ("Each cell: speed-up to DDP's final validation loss (DDP's time / the variant's, training clock "
                 "with compiles, seed mean; *never*: some seed did not reach it), in brackets the speed-up to 1 % above "
                 "it, then the final validation loss against DDP's (seed mean).")


# --------------------------------------------------------------------------- driver


def calibrate_rate(size: str, batch: int, target: float, *, workers: int = 2, tries: int = 3,
                   timeout_s: float = 1800.0, log: Callable[[str], None] = print,
                   workload: str = "gpt2") -> tuple[str, float | None]:
    """A ``tc`` rate at which DDP's coverage rate is within 15 % of ``target`` for this benchmark's model
    (``deft_compile.tools.bench.calibrate_rate``). Returns (rate, measured coverage rate at it)."""
    from deft_compile.tools import bench

    common: dict[str, Any] = {"workers": workers, "steps": 4, "warmup": 2, "rounds": 2, "batch": batch,
                              "progress": False, "timeout_s": timeout_s, "prefix": "defttta", "label": "tta calibration"}
    rate, measured, _ = bench.calibrate_rate(bench_model_spec(size, workload), target, common, tries=tries, log=log)
    return rate, measured


def measure_coverage(size: str, batch: int, rate: str | None, *, workers: int = 2,
                     timeout_s: float = 1800.0, workload: str = "gpt2") -> float | None:
    """DDP's coverage rate at ``rate`` (one ``bench.run_config`` launch: floor and all-reduce of all gradients)."""
    from deft_compile.tools import bench

    probe = bench.run_config(bench_model_spec(size, workload), rate, policies=[], include_ddp=False, workers=workers, steps=4,
                             warmup=2, rounds=2, batch=batch, progress=False, timeout_s=timeout_s, prefix="defttta",
                             label="tta coverage")
    return probe.get("coverage_rate")


def run_benchmark(cfg: TTAConfig, seeds: Sequence[int], *, bandwidth: str | None = "calibrate", coverage: float = 1.0,
                  workers: int = 2, timeout_s: float = 6 * 3600.0, measure_cr: bool = True,
                  json_path: str | os.PathLike | None = None, plot_dir: str | os.PathLike | None = None,
                  plot_stem: str = "time_to_accuracy", docs_path: str | os.PathLike | None = None,
                  command: str | None = None, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Calibrate (``bandwidth="calibrate"``) or take the rate (a ``tc`` rate, or None: unshaped loopback), run every
    seed (one launch each, ``tta_worker``), summarise, and write the JSON, the PNGs and the docs section."""
    from deft_compile.tools import bench
    from deft_compile.tools.launcher import run_local_workers
    from deft_compile.tools.provenance import provenance, relative_path

    started = time.perf_counter()
    # taken at the start: the commit and the tree's state the launches ran from (a long run outlives later commits)
    origin = provenance(command=command or "python benchmarks/time_to_accuracy.py")
    measured: float | None = None
    target: float | None = None
    if bandwidth == "calibrate":
        reason = bench.shaping_available()
        if reason is not None:
            raise RuntimeError(f"{reason}: cannot shape the link to a coverage rate of {coverage:g} "
                               "(run as root with iproute2, or give --bandwidth RATE / none)")
        target = coverage
        rate, measured = calibrate_rate(cfg.size, cfg.batch, coverage, workers=workers, log=log,
                                        workload=cfg.workload)
    else:
        rate = bandwidth
        if rate is not None and bench.shaping_available() is not None:
            raise RuntimeError(f"{bench.shaping_available()} (give --bandwidth none for the unshaped loopback)")
        if measure_cr:
            measured = measure_coverage(cfg.size, cfg.batch, rate, workers=workers, workload=cfg.workload)
    log(f"network: {rate or 'unshaped loopback'}; DDP's coverage rate {_fmt(measured, '{:.2f}', 'not measured')}")
    runs: dict[int, dict[str, Any]] = {}
    with contextlib.ExitStack() as stack:
        stack.enter_context(bench.sigterm_as_interrupt())
        net = stack.enter_context(bench.network(rate, 1, workers, prefix="defttta"))
        for seed in seeds:
            t0 = time.perf_counter()
            seed_cfg = dataclasses.replace(cfg, seed=int(seed))
            results = run_local_workers(tta_worker, workers, (dataclasses.asdict(seed_cfg),), timeout_s=timeout_s,
                                        collective_timeout_s=900.0, **net["launch"])
            runs[int(seed)] = results[0].value
            finals = ", ".join(f"{n} {v['evals'][-1]['val_loss']:.4f}" for n, v in runs[int(seed)]["variants"].items())
            log(f"seed {seed}: final val loss {finals} ({time.perf_counter() - t0:.0f} s)")
            if json_path is not None:  # kept if a later seed fails or is interrupted; rewritten whole at the end
                Path(json_path).parent.mkdir(parents=True, exist_ok=True)
                Path(json_path).write_text(json.dumps({"partial": True, "provenance": origin,
                                                       "config": dataclasses.asdict(cfg),
                                                       "rate": rate, "coverage_rate": measured,
                                                       "runs": {str(k): v for k, v in runs.items()}}))
        description = net["description"]
    summary = summarise(runs, coverage=target)
    first = runs[min(runs)]
    record: dict[str, Any] = {
        "provenance": origin,
        "meta": {"command": command or "python benchmarks/time_to_accuracy.py", "date": time.strftime("%Y-%m-%d %H:%M"),
                 "host": f"{os.cpu_count()} cores, possibly shared, torch {torch.__version__}, load "
                         f"{', '.join(f'{x:.1f}' for x in os.getloadavg())}",
                 "wall_s": time.perf_counter() - started,
                 "emulate_accelerator": bool(os.environ.get("DEFT_EMULATE_ACCELERATOR"))},
        "config": dataclasses.asdict(cfg), "seeds": sorted(runs), "rate": rate, "network": description,
        "coverage_rate": measured, "coverage_target": target, "workers": workers,
        **{k: first[k] for k in ("params", "gradient_bytes", "tokens_per_step", "world_size", "train_bytes",
                                 "val_bytes")},
        "bucket_cap_mb": first.get("bucket_cap_mb"), "ddp_buckets": first.get("ddp_buckets"),
        "summary": summary, "runs": {str(k): v for k, v in runs.items()},
    }
    title = (f"{cfg.workload} {cfg.size}, DDP's coverage rate {_fmt(measured, '{:.2f}', 'not measured')} "
             f"(dotted: DDP's final loss, per seed)")
    record["pngs"] = (plot_curves(runs, plot_dir, plot_stem, title=title, unit=WORKLOADS[cfg.workload]["unit"])
                      if plot_dir is not None else [])
    if json_path is not None:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(record, indent=1))
        record["results_file"] = relative_path(json_path)  # where the docs' provenance line points (not saved)
        log(f"results: {json_path}")
    log(markdown_table(summary))
    if docs_path:
        write_docs_section(docs_path, results_section(record, Path(docs_path).parent))
        log(f"docs: {docs_path}")
    return record


def run_cli(args: Any) -> int:
    """``deft-compile bench --time-to-accuracy``: the bench parser's arguments (see ``bench.add_parser``)."""
    from deft_compile.tools.bench import parse_rate

    try:
        bandwidth = "calibrate" if args.bandwidth is None else parse_rate(args.bandwidth)
        cfg = TTAConfig(size=args.size, steps=args.steps or TTAConfig.steps,
                        eval_every=args.eval_every or TTAConfig.eval_every, chunk=args.chunk or TTAConfig.chunk,
                        batch=args.batch or TTAConfig.batch, compiler=args.compiler or default_compiler(),
                        progress=not args.no_progress)
    except ValueError as error:
        print(f"deft-compile bench --time-to-accuracy: {error}", file=sys.stderr)
        return 2
    plot = Path(args.plot) if args.plot else None
    try:
        from deft_compile.tools.provenance import command_line
        run_benchmark(cfg, args.seeds, bandwidth=bandwidth, coverage=args.coverage, workers=args.workers,
                      timeout_s=args.timeout or 6 * 3600.0, json_path=args.json,
                      plot_dir=plot.parent if plot else None, plot_stem=plot.stem if plot else "time_to_accuracy",
                      command=command_line() if sys.argv[1:2] == ["bench"] else None)
    except RuntimeError as error:
        print(f"deft-compile bench --time-to-accuracy: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0
