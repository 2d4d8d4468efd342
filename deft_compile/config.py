"""User-facing configuration of a compiled training step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from deft_compile.planner.bucketing import DDP_BUCKET_CAP_BYTES, DDP_FIRST_BUCKET_BYTES, BucketSizes, MiB
from deft_compile.planner.plan import DEFAULT_WIRE_DTYPES, WIRE_FULL, check_wire_dtype
from deft_compile.preserver import PreserverConfig
from deft_compile.planner.closed_loop import ClosedLoopConfig
from deft_compile.compilers import check_compiler, default_compiler


#: what a ``DeftConfig.links`` spec may name: ``"gloo"``, ``"gloo:IFNAME"`` or ``"nccl"`` (``deft_compile.step.links``)
LINK_KINDS = ("gloo", "nccl")


def parse_link(spec: str) -> tuple[str, str | None]:
    """(kind, interface or None) of a link spec; ``ValueError`` for anything else."""
    kind, _, interface = spec.partition(":")
    if kind not in LINK_KINDS or (kind == "nccl" and interface):
        raise ValueError(f"unknown link {spec!r}: use 'gloo', 'gloo:IFNAME' or 'nccl'")
    return kind, interface or None


#: ``DeftConfig.delayed_update`` values: ``"auto"`` (compensated where the optimizer is covered, else averaged),
#: the plain averaged delay, the local-then-corrected one, and the compensated one (the late averaged gradient
#: through a published correction, replicas identical); docs/POLICIES.md.
DELAYED_UPDATES = ("auto", "averaged", "local", "compensated")


@dataclass(frozen=True)
class DeftConfig(BucketSizes):
    """Knobs of ``deft_compile``; the defaults reproduce PyTorch DDP's behaviour.

    Attributes:
        bucket_cap_mb: size cap of a gradient bucket (DDP's ``bucket_cap_mb``). 25 MiB, DDP's default, so the
            synchronous plan is DDP's.
        first_bucket_mb: size cap of the first bucket. 1 MiB, DDP's, so communication starts early in backward.
        broadcast_buffers: broadcast rank 0's buffers (BatchNorm running stats) before every forward, on a
            process group of its own so it does not queue behind all-reduces still in flight. On because DDP
            does it by default.
        check_consistency: before the first step, compare parameter names, shapes, dtypes and the captured graph
            across ranks and raise ``ModelMismatchError`` if they differ. On because ranks that disagree would
            otherwise hang or train different models silently.
        peer_check_timeout_s: after a failed collective, how long survivors wait for every rank to report in
            through the store before naming the ranks that did not. 5 s is long enough for a live rank to
            answer and short enough not to delay the error much.
        max_cached_graphs: how many step graphs (one per input shape, module mode, optimizer hyper-parameters
            and phase) are kept per plan, for up to four plans side by side, before the least recently used is
            dropped. 8 covers train/eval and a few shapes without holding many compiled graphs in memory; per plan
            so that a plan a run returns to (a duel's, the synchronous plan after delays) builds no graph again.
        plan_options: extra keyword options for the policy's solver (``deft_compile.planner.solvers``), e.g.
            ``{"max_staleness": 0}`` for DeFT. Empty: each solver's own defaults.
        links: extra communication channels besides the process group, e.g. ``("gloo:eth1",)`` or
            ``("gloo",)`` under NCCL (``deft_compile.step.links``), measured by the profiler and shared out by
            DeFT. Empty because a second channel needs a second network path to pay.
        always_profile: measure the step on the first call even for policies whose plan needs no times
            (``wfbp``, ``dssync``), so ``step.profile`` and the predicted iteration time are real numbers. Off
            because those policies' plans do not use it; they predict 0 ms.
        preserver: thresholds of the Preserver, which watches the convergence cost of delays and update
            periods while training and re-plans more conservatively when it is too high (``policy="deft"``
            only; ``PreserverConfig(enabled=False)`` turns it off). On because delays can cost convergence that
            their speed does not repay (docs/POLICIES.md).
        max_grad_norm: clip the gradient vector each update applies to this global norm, as
            ``torch.nn.utils.clip_grad_norm_`` before ``optimizer.step()``; the norm is ``step.last_grad_norm``
            (with delays: fresh and arrived delayed buckets together, docs/POLICIES.md). None: no clipping, as
            DDP.
        norm_type: the norm's order (``float("inf")`` for the max norm). 2, ``clip_grad_norm_``'s default.
        accumulation_steps: N calls of the step make one optimizer update, whose gradient is the mean over the N
            micro-batches and all ranks (DDP with ``no_sync()`` on the first N-1 and the loss divided by N),
            communicated once per update. 1: one update per call, as DDP.
        loss_scale: ``"dynamic"`` for fp16 dynamic loss scaling inside the step with ``torch.amp.GradScaler``'s
            defaults and rules, or a ``torch.amp.GradScaler`` whose settings and scale tensors are used; an update
            whose gradients hold an inf or NaN is skipped on every rank. None: no scaling, as DDP.
        closed_loop: closed-loop planning (``deft_compile.planner.closed_loop``; ``deft_compile.step.closed_loop``
            measures): measure the plan, refine the profile, try the synchronous and re-solved plans, keep the
            fastest measured. On for ``deft``,
            ``bytescheduler`` and ``usbyte`` because a profile taken once on a few runs can be wrong for the
            running step.
        compiler: what runs the rewritten step graph: ``"inductor"`` (collectives and waits stay where the plan
            put them, ``deft_compile.step.lowering``) or ``"aten"`` (the graph's aten ops called from Python;
            bit-identical to DDP with SGD); ``$DEFT_COMPILER`` when set. Inductor by default because its
            fused kernels run the step faster than ATen's ops called one by one.
        aten_first_call: the step's first call (``step_count`` 0) on a static capture compiles only what
            Inductor's cache holds: once a region has to be compiled from scratch, that call runs its other regions
            as aten, and they compile from the second call on. On because a static capture's shapes may not repeat
            (a second input length makes the next capture symbolic, and what the first call compiled never runs
            again), while on a warm cache the first call still runs compiled. A symbolic capture compiles at once.
        delayed_update: what a delayed bucket (d=1) applies: ``"compensated"``, the averaged gradient of the
            previous step through the Nesterov form of the first moment, with the forward and backward at the
            weights the pending update is about to give (SGD with momentum, Adam, AdamW;
            ``deft_compile.passes.compensation``); ``"averaged"``, the averaged gradient of the previous step
            as it is, w_{t+1} = U(w_t, ḡ_{t-1}); ``"local"``, this step's local gradient plus the correction of
            the previous one to its average, replicas equal again after ``flush()`` (call it on every rank before
            a checkpoint; not with ``accumulation_steps`` or ``loss_scale``); or ``"auto"``: ``"compensated"``
            where the optimizer is covered, ``"averaged"`` otherwise (``step.delayed_update`` says which; the
            Preserver admits plain averaged delays only where a paired replay measures them harmless).
            ``"auto"`` because compensated delays measured a small loss cost where plain ones cost 3-5 % of
            final loss (docs/POLICIES.md).
        dynamic_shapes: once an input dimension has changed size, capture the step with that dimension symbolic,
            so every later size reuses one capture and its compiled regions (``deft_compile.step.symbolic``);
            False: every new input shape is traced and compiled on its own. On because dynamic padding, a short
            last batch and evaluation at another batch size would otherwise compile once per shape.
        contention: the measured profile's ``Profile.contention``, the share of a collective's time that slows
            compute beside it (docs/PLANNER.md): a number in [0, 1], or None to measure it on the first step; a
            profile you give keeps its own, and the closed loop's refinement replaces it. 0, an accelerator's,
            because the first-step probe is noisy on a shared CPU host (it varies several-fold across launches
            of one model and link) and the closed loop measures it there from the step thread's run-queue delay.
        wire_dtypes: the dtypes a plan may send gradients over the link in (``"float32"``, the gradients as
            they are, the 16-bit ``"bfloat16"`` and ``"float16"``, and the 8-bit ``"int8"``);
            ``plan_options={"wire_dtype": ...}`` asks for one of them for every bucket of float32 gradients.
            float32 and both 16-bit dtypes by default: ``deft`` narrows a bucket where the link time it saves beats
            the measured price of its rounding (docs/POLICIES.md), while ``wfbp``, ``bytescheduler`` and ``usbyte``
            send float32, DDP's numbers, unless ``wire_dtype`` asks; ``("float32",)`` keeps every plan on float32,
            and naming ``"int8"`` lets ``deft`` price the 8-bit wire too.
    """

    bucket_cap_mb: float = DDP_BUCKET_CAP_BYTES / MiB
    first_bucket_mb: float = DDP_FIRST_BUCKET_BYTES / MiB
    broadcast_buffers: bool = True
    check_consistency: bool = True
    peer_check_timeout_s: float = 5.0
    max_cached_graphs: int = 8
    plan_options: dict[str, Any] = field(default_factory=dict)
    links: tuple[str, ...] = ()
    always_profile: bool = False
    preserver: PreserverConfig = field(default_factory=PreserverConfig)
    max_grad_norm: float | None = None
    norm_type: float = 2.0
    accumulation_steps: int = 1
    loss_scale: Any = None
    closed_loop: ClosedLoopConfig = field(default_factory=ClosedLoopConfig)
    compiler: str = field(default_factory=default_compiler)
    aten_first_call: bool = True
    delayed_update: str = "auto"
    contention: float | None = 0.0
    dynamic_shapes: bool = True
    wire_dtypes: tuple[str, ...] = DEFAULT_WIRE_DTYPES

    def __post_init__(self) -> None:
        if isinstance(self.preserver, dict):  # as a config file spells it
            object.__setattr__(self, "preserver", PreserverConfig(**self.preserver))
        elif not isinstance(self.preserver, PreserverConfig):
            raise TypeError(f"preserver must be a PreserverConfig or a dict of its fields; got "
                            f"{type(self.preserver).__name__}")
        if self.delayed_update not in DELAYED_UPDATES:
            raise ValueError(f"delayed_update must be one of {', '.join(map(repr, DELAYED_UPDATES))}; "
                             f"got {self.delayed_update!r}")
        if self.delayed_update == "local" and (self.accumulation_steps > 1 or self.loss_scale is not None):
            raise ValueError("delayed_update='local' is not supported with accumulation_steps > 1 or loss_scale "
                             "(the correction is defined for one local gradient per update, applied unskipped)")
        if self.bucket_cap_mb <= 0 or self.first_bucket_mb <= 0:
            raise ValueError("bucket_cap_mb and first_bucket_mb must be positive")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be positive (or None for no clipping); got {self.max_grad_norm}")
        if not (isinstance(self.accumulation_steps, int) and self.accumulation_steps >= 1):
            raise ValueError(f"accumulation_steps must be an integer >= 1; got {self.accumulation_steps!r}")
        if self.loss_scale is not None and self.loss_scale != "dynamic":
            import torch

            if not isinstance(self.loss_scale, torch.amp.GradScaler):
                raise ValueError(
                    f"loss_scale must be None, 'dynamic' or a torch.amp.GradScaler; got {self.loss_scale!r}"
                )
        if self.max_cached_graphs < 1:
            raise ValueError("max_cached_graphs must be at least 1")
        if self.contention is not None and not 0.0 <= self.contention <= 1.0:
            raise ValueError(f"contention must be in [0, 1], or None to measure it; got {self.contention}")
        check_compiler(self.compiler, source="DeftConfig.compiler")
        object.__setattr__(self, "wire_dtypes", tuple(self.wire_dtypes))
        for dtype in self.wire_dtypes:
            check_wire_dtype(dtype)
        if WIRE_FULL not in self.wire_dtypes:
            raise ValueError(f"wire_dtypes must include {WIRE_FULL!r} (full precision: 16-bit gradients and "
                             f"buckets that do not narrow cross the link as they are); got {self.wire_dtypes}")
        wire_dtype = self.plan_options.get("wire_dtype", WIRE_FULL)
        if wire_dtype not in self.wire_dtypes:
            raise ValueError(f"plan_options wire_dtype={wire_dtype!r} is not in wire_dtypes {self.wire_dtypes}")
        for spec in self.links:
            parse_link(spec)
