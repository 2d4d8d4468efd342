"""What a policy does at run time besides its plan: the one interface ``CompiledStep`` calls.

Most policies are fully described by their plan (which buckets communicate where,
delayed or not, with which period) and need nothing here. A few act between steps:
DS-Sync picks this step's communication group and may average parameters after the
step; DLCP reports per-step statistics and forgets empty residuals before a flush.
Those behaviours live in a ``PolicyRuntime`` subclass, so ``CompiledStep`` knows no
policy by name and a new policy adds a class here instead of fields there.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.nn as nn

from deft_compile.planner.plan import Plan
from deft_compile.planner.solvers import dssync_partition
from deft_compile.step.distributed import average_tensors, new_group
from deft_compile.step.pipeline import CommGroup
from deft_compile.timing import comm_device

log = logging.getLogger("deft_compile")


class RunningStep(Protocol):
    """What a policy's run-time hooks may read from the step (``step.handle.StepHandle`` provides it)."""

    model: nn.Module
    plan: Plan | None
    step_count: int

    @property
    def comm_group(self) -> CommGroup | None: ...

    @property
    def process_group(self) -> dist.ProcessGroup | None: ...

    @property
    def carry(self) -> dict[str, torch.Tensor]: ...

    def updates_at(self, call_index: int) -> bool: ...


class PolicyRuntime:
    """Run-time hooks of a policy; the base class does nothing (the plan says everything).

    Attributes:
        needs_profile: the plan depends on measured times, so the first step is
            profiled (``DeftConfig.always_profile`` profiles anyway).
        uses_buckets: the solver takes DDP's bucket sizes (``first_bucket_bytes``,
            ``bucket_cap_bytes`` from ``DeftConfig``).
        watched_by_preserver: the Preserver watches this policy's delays and periods.
        chooses_wire: the solver chooses each bucket's wire dtype from measured prices (``wire_prices``), which
            the first call measures where a 16-bit dtype is allowed and no fixed ``wire_dtype`` is asked for.
        picks_groups: ``step_group`` answers a group of the policy's own every step (DS-Sync): the step's
            buffers are broadcast within it, so the step opens no buffer group of its own.
        last_stats: per-step statistics the schedule pass emitted (``"stats:<item>"``
            outputs), refreshed every step.
    """

    needs_profile: bool = True
    uses_buckets: bool = False
    watched_by_preserver: bool = False
    chooses_wire: bool = False
    picks_groups: bool = False

    def __init__(self) -> None:
        self.last_stats: dict[str, list[float]] = {}

    def check_config(self, policy: str, config: Any) -> None:
        """Raise ``ValueError`` naming the option and the policy for a ``DeftConfig`` this policy cannot honour."""

    def solver_defaults(self, config: Any) -> dict[str, Any]:
        """Solver options this policy needs for ``config`` unless the user set them in ``plan_options``."""
        return {}

    def first_call_updates(self, config: Any, profile_given: bool) -> bool:
        """Whether this policy's first call applies the update of every parameter it computes a gradient for
        (no update moved into a later call, delayed or periodic): then the optimizer's state can be created
        before the first capture (``optim_support.initialize_state``) without any parameter holding state
        earlier than under eager PyTorch."""
        return False

    def step_group(self, step: RunningStep) -> CommGroup | None:
        """The group this step's items communicate over, when it is not the step's own group."""
        return None

    def after_step(self, step: RunningStep) -> None:
        """Called after every step's graph ran."""

    def before_flush(self, step: RunningStep) -> None:
        """Called first by ``flush()``; may drop carries that must not be applied."""

    def record_stats(self, stats: dict[str, torch.Tensor]) -> None:
        self.last_stats = {key: value.tolist() for key, value in stats.items()}


class WfbpRuntime(PolicyRuntime):
    """DDP's buckets in DDP's order: the plan needs bucket sizes, not times."""

    needs_profile = False
    uses_buckets = True

    def first_call_updates(self, config: Any, profile_given: bool) -> bool:
        return True


class DeftRuntime(PolicyRuntime):
    """DeFT: buckets, measured times for the knapsacks, and the Preserver."""

    uses_buckets = True
    watched_by_preserver = True
    chooses_wire = True

    def solver_defaults(self, config: Any) -> dict[str, Any]:
        # Gradient accumulation already communicates once per N micro-batches; an update period on top
        # would multiply the staleness for communication that is rarely the bottleneck any more.
        return {"allow_period": False} if config.accumulation_steps > 1 else {}

    def first_call_updates(self, config: Any, profile_given: bool) -> bool:
        # synchronous plans only, or the Preserver's synchronous start (a measured profile, staleness traded)
        preserver = config.preserver
        starts_synchronous = (preserver.enabled and preserver.trade and not profile_given
                              and preserver.start_synchronous is not False)
        return config.plan_options.get("max_staleness") == 0 or starts_synchronous


class DLCPRuntime(PolicyRuntime):
    """DLCP carries a residual of dropped chunks after every step with a deadline (zero when nothing was
    dropped) and reports per item ``[chunks sent, dropped mass fraction]`` in ``last_stats``."""

    def check_config(self, policy: str, config: Any) -> None:
        # The residual of dropped chunks is DLCP's own carry across calls: it is added to the next
        # gradient unscaled, so it can neither be averaged over accumulated micro-batches nor survive a
        # skipped (non-finite) update.
        if config.accumulation_steps > 1:
            raise ValueError(f"DeftConfig.accumulation_steps > 1 is not supported by policy {policy!r}")
        if config.loss_scale is not None:
            raise ValueError(f"DeftConfig.loss_scale is not supported by policy {policy!r}")

    def before_flush(self, step: RunningStep) -> None:
        """Flushing a residual that is zero on every rank would still run an optimizer update (momentum
        moves the weights), so such residuals are forgotten; ranks agree through one all-reduce of flags."""
        carry = step.carry
        keys = sorted(carry)
        device = comm_device(step.process_group) if step.process_group is not None else None
        nonzero = torch.tensor([float(bool(carry[key].count_nonzero())) for key in keys], dtype=torch.float64,
                               device=device)
        if step.process_group is not None and keys:
            dist.all_reduce(nonzero, op=dist.ReduceOp.MAX, group=step.process_group)
        for key, flag in zip(keys, nonzero.tolist()):
            if not flag:
                del carry[key]


class DSSyncRuntime(PolicyRuntime):
    """DS-Sync: every step, ranks split into shuffled groups and communicate only within their group.

    With ``average="gradients"`` this step's items all-reduce over the rank's group. With
    ``average="parameters"`` (the default) the step's gradients stay local (its items go to a
    one-rank group) and the group averages parameters and buffers after the step. ``flush()``
    averages over all ranks, so every replica ends as one model.
    """

    needs_profile = False
    uses_buckets = True
    picks_groups = True

    def __init__(self) -> None:
        super().__init__()
        self.subgroups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        self._averaging_group: dist.ProcessGroup | None = None  # this rank's group for this step

    def first_call_updates(self, config: Any, profile_given: bool) -> bool:
        """Whether this policy's first call applies the update of every parameter it computes a gradient for
        (no update moved into a later call, delayed or periodic): then the optimizer's state can be created
        before the first capture (``optim_support.initialize_state``) without any parameter holding state
        earlier than under eager PyTorch."""
        return False

    def step_group(self, step: RunningStep) -> CommGroup | None:
        if step.process_group is None or step.comm_group is None:
            return None
        options = step.plan.options
        world_size = step.comm_group.world_size
        partition = dssync_partition(
            world_size, options["group_size"], step.step_count, seed=options["seed"], shuffle_every=options["shuffle_every"]
        )
        members = dist.get_process_group_ranks(step.process_group)
        mine = None
        for group in partition:  # every rank creates every group of the partition, in the same order
            process_group = self._subgroup(tuple(members[r] for r in group))
            if step.comm_group.rank in group:
                mine = process_group
        self._averaging_group = mine if self._averages_parameters(step) else None
        comm = mine
        if self._averages_parameters(step):
            solos = [self._subgroup((member,)) for member in members]  # every rank creates every one, in order
            comm = solos[step.comm_group.rank]
        return CommGroup(name=comm.group_name, rank=dist.get_rank(comm), world_size=dist.get_world_size(comm))

    def after_step(self, step: RunningStep) -> None:
        if self._averaging_group is not None and step.updates_at(step.step_count):  # not while accumulating
            average_replicas(step.model, self._averaging_group)  # the group ends the step as one model

    def before_flush(self, step: RunningStep) -> None:
        if step.process_group is not None:
            count = average_replicas(step.model, step.process_group)
            log.info("DS-Sync: averaged %d parameter and buffer tensors over all ranks", count)

    @staticmethod
    def _averages_parameters(step: RunningStep) -> bool:
        return step.plan.options.get("average", "gradients") == "parameters"

    def _subgroup(self, global_ranks: tuple[int, ...]) -> dist.ProcessGroup:
        """The process group of these ranks, created on first use (``new_group`` is collective: every rank
        must ask for the same groups in the same order)."""
        if global_ranks not in self.subgroups:
            self.subgroups[global_ranks] = new_group(ranks=list(global_ranks))
        return self.subgroups[global_ranks]


def average_replicas(model: nn.Module, group: dist.ProcessGroup) -> int:
    """Average every trainable parameter and floating-point buffer of ``model`` over ``group``; returns how
    many tensors.

    Frozen parameters are left alone: they are equal everywhere, and averaging equal values over a group
    whose size is not a power of two is not exact."""
    tensors = [p for p in model.parameters() if p.requires_grad and p.is_floating_point()]
    tensors += [b for b in model.buffers() if b.is_floating_point()]
    average_tensors(tensors, group)
    return len(tensors)


_RUNTIMES: dict[str, type[PolicyRuntime]] = {
    "wfbp": WfbpRuntime,
    "deft": DeftRuntime,
    "dssync": DSSyncRuntime,
    "dlcp": DLCPRuntime,
}


def runtime_for(policy: str) -> PolicyRuntime:
    """A fresh run-time behaviour object for ``policy`` (the base class for plan-only policies)."""
    return _RUNTIMES.get(policy, PolicyRuntime)()


def register_runtime(policy: str, runtime: type[PolicyRuntime]) -> None:
    """Give a policy added to ``deft_compile.planner.solvers.POLICIES`` its run-time hooks."""
    _RUNTIMES[policy] = runtime


__all__ = ["PolicyRuntime", "RunningStep", "register_runtime", "runtime_for", "average_replicas"]
