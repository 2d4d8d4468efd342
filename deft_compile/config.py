"""User-facing configuration of a compiled training step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from deft_compile.planner.bucketing import DDP_BUCKET_CAP_BYTES, DDP_FIRST_BUCKET_BYTES, BucketSizes, MiB
from deft_compile.preserver import PreserverConfig
from deft_compile.step.closed_loop import ClosedLoopConfig
from deft_compile.step.lowering import check_compiler, default_compiler


#: ``DeftConfig.delayed_update`` values: DESIGN.md §4's semantics, or the opt-in local-then-corrected one.
DELAYED_UPDATES = ("averaged", "local")


@dataclass(frozen=True)
class DeftConfig(BucketSizes):
    """Knobs of ``deft_compile``; the defaults reproduce PyTorch DDP's behaviour.

    Attributes:
        bucket_cap_mb: size cap of a gradient bucket (DDP's ``bucket_cap_mb``).
        first_bucket_mb: size cap of the first bucket, small so communication
            starts early in backward (DDP uses 1 MiB).
        broadcast_buffers: broadcast rank 0's buffers (BatchNorm running stats)
            before every forward, as DDP does by default. The broadcast runs on
            a process group of its own (same ranks and backend), so it does not
            queue behind all-reduces still in flight from the previous step.
        check_consistency: before the first step, compare parameter names,
            shapes, dtypes and the captured graph across ranks and raise
            ``ModelMismatchError`` if they differ.
        peer_check_timeout_s: after a failed collective, how long survivors wait
            for every rank to report in through the store before naming the
            ranks that did not.
        max_cached_graphs: how many captured graphs (one per input shape, module
            mode and optimizer hyper-parameters) are kept before the oldest is
            dropped.
        plan_options: extra keyword options for the policy's solver (see
            ``deft_compile.planner.solvers``), e.g. ``{"max_staleness": 0}`` for DeFT.
        preserver: thresholds of the Preserver, which watches the convergence
            cost of delays and update periods while training and re-plans more
            conservatively when it is too high (``policy="deft"`` only; on by
            default; ``PreserverConfig(enabled=False)`` turns it off).
        always_profile: measure the step on the first call even for policies
            whose plan needs no times (``wfbp``, ``dssync``), so ``step.profile``
            and the plan's predicted iteration time are real numbers. Without
            it those policies skip the measurement and predict 0 ms.
        links: extra communication channels besides the process group, e.g.
            ``("gloo:eth1",)`` or ``("gloo",)`` under NCCL (see
            ``deft_compile.step.links``). The profiler measures each; DeFT assigns
            buckets or bucket shares to them (a multiple knapsack).
        max_grad_norm: clip the gradient vector each update applies to this global
            norm, as ``torch.nn.utils.clip_grad_norm_`` before ``optimizer.step()``
            (None: no clipping). The norm is ``step.last_grad_norm``. With delayed or
            periodic buckets the vector is what that update applies: fresh buckets
            and arrived delayed ones together (docs/POLICIES.md).
        norm_type: the norm's order (``float("inf")`` for the max norm).
        accumulation_steps: N calls of the step make one optimizer update, whose
            gradient is the mean over the N micro-batches and all ranks (DDP with
            ``no_sync()`` on the first N-1 and the loss divided by N); gradients are
            communicated once per update.
        loss_scale: ``"dynamic"`` for fp16 dynamic loss scaling inside the step with
            ``torch.amp.GradScaler``'s defaults and rules, or a
            ``torch.amp.GradScaler`` whose settings and scale tensors are used (its
            ``get_scale()`` follows the step). An update whose gradients hold an
            inf or NaN is skipped on every rank and the scale backs off.
        closed_loop: closed-loop planning (``deft_compile.step.closed_loop``):
            measure the plan, refine the profile when the simulator missed by
            more than a tolerance, try the synchronous and re-solved plans, keep
            the fastest measured. On by default for ``policy="deft"``;
            ``ClosedLoopConfig(enabled=False)`` turns it off.
        compiler: what runs the rewritten step graph: ``"inductor"`` (default;
            collectives and waits stay where the plan put them, see
            ``deft_compile.step.lowering``) or ``"aten"`` (the graph's aten ops
            called from Python; bit-identical to DDP with SGD). The default
            comes from ``$DEFT_COMPILER`` when set (the test suite sets ``aten``).
        delayed_update: what a delayed bucket (d=1) applies. ``"averaged"``
            (default, DESIGN.md §4): the averaged gradient of the previous step,
            w_{t+1} = U(w_t, ḡ_{t-1}); replicas stay identical. ``"local"``
            (opt-in): this step's local gradient plus the correction of the
            previous one to its average, U(w_t, g_t + ḡ_{t-1} − g_{t-1}), with
            the same communication schedule; replicas differ between flushes by
            what one step's local gradients differ (docs/POLICIES.md), and
            ``flush()`` and plan switches average those parameters and their
            optimizer state across ranks, so they are identical again (flush on
            every rank before saving a checkpoint). Not with
            ``accumulation_steps`` or ``loss_scale``.
        contention: the measured profile's ``Profile.contention``, the share of a
            collective's time that slows compute beside it (docs/PLANNER.md). 0
            (default): an accelerator's. A number in [0, 1]: your host's. None:
            measure it on the first step (``planner.profiler.measure_contention``).
            Off by default because on a shared CPU host the probe is noisy: one
            model on one link measured 0.09 to 0.75 across launches, so plans
            followed the noise; with it on, the Preserver declined trades whose
            predicted gain it cut (docs/BENCHMARKS.md, session 11). A profile you
            give keeps its own. The closed loop's refinement replaces it: on a
            CPU host it measures it from the step thread's run-queue delay
            (``ClosedLoopConfig.measure_contention``, on by default), and
            ``ClosedLoopConfig(fit_contention=True)`` fits it to the measured
            plans' times where that cannot be read (opt-in).
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
    delayed_update: str = "averaged"
    contention: float | None = 0.0

    def __post_init__(self) -> None:
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
        from deft_compile.step.links import parse_link

        for spec in self.links:
            parse_link(spec)
