"""The compiled step object users call once per training step."""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import os
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from deft_compile.debug.artifacts import (
    MeasuredTimelineRecorder,
    log_structured,
    measured_step_index,
    plan_cycle,
    record_plan,
    write_plan_artifacts,
)
from deft_compile.passes.gradient_guards import FOUND_INF_KEY, GRAD_NORM_KEY
from deft_compile.passes.local_collectives import LOCAL_GROUP
from deft_compile.step.capture import CapturedStep, StateSlot, ambient_autocast, capture_step, split_user_inputs
from deft_compile.step.loss_scaling import LossScaler, guard_options_for
from deft_compile.config import DeftConfig
from deft_compile.step.distributed import (
    average_parameters_and_state,
    broadcast_from_rank0,
    check_same_across_ranks,
    comm_group_of,
    diagnose_peer_failure,
    group_timeout,
    model_fingerprint,
    open_side_group,
    resolve_group,
)
from deft_compile.debug.dump import GraphDumper
from deft_compile.errors import DeftError
from deft_compile.step.optim_support import check_optimizer, hyperparameter_key, lr_inputs
from deft_compile.passes.schedule import APPLY_NEXT_UPDATE, ItemPhase, ScheduledItem, accumulator_key, pending_key
from deft_compile.step.links import open_link
from deft_compile.step.lowering import StepLowering, lazy_graph_modules
from deft_compile.step.pipeline import CommGroup, CompiledGraph, annotate_capture, compile_captured
from deft_compile.planner.plan import LinkCost, Plan, Profile
from deft_compile.preserver import Preserver
from deft_compile.preserver.monitor import PreserverMonitor
from deft_compile.preserver.pricing import compute_ms, prior_update_prices
from deft_compile.step.scheduling import ProfileIndex, scheduled_items, static_profile, with_accumulation
from deft_compile.planner.simulator import UPDATE_WAITS_FOR_ALL
from deft_compile.planner.solvers import POLICIES, solve, solve_wfbp
from deft_compile.step.policy_runtime import PolicyRuntime, runtime_for
from deft_compile.step.closed_loop import ClosedLoop
from deft_compile.step.thread_clock import ThreadClock
from deft_compile.timing import clock_for

log = logging.getLogger("deft_compile")


class CompiledStep:
    """One call = forward, loss, backward, gradient communication and the optimizer update.

    Graphs are cached by everything that changes what is traced: the shapes,
    dtypes and devices of the tensor inputs, non-tensor inputs, the train/eval
    mode of every module, the optimizer's hyper-parameters, which optimizer
    state already exists (the first step creates it), and whether the previous
    step left pending communication ("carries"). A new key retraces, so a
    changed input shape or a learning-rate change never reuses a stale graph.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable[..., torch.Tensor] | None,
        *,
        policy: str,
        config: DeftConfig,
        process_group: dist.ProcessGroup | None,
        dump_dir: str | os.PathLike | None,
        profile: Profile | None = None,
    ) -> None:
        check_optimizer(optimizer)
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; available: {', '.join(POLICIES)}")
        policy_runtime = runtime_for(policy)
        policy_runtime.check_config(policy, config)
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.policy = policy
        self.policy_runtime: PolicyRuntime = policy_runtime  # what the policy does between steps
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self.loss_scaler: LossScaler | None = LossScaler.from_config(config.loss_scale, device)
        # the step thread's CPU time is its compute, and its run-queue delay what other threads took from that
        # compute, only where it runs the kernels itself (closed_loop.compute_floor, closed_loop.measured_contention)
        self._cpu_timed = device.type == "cpu"
        self._thread_clock = ThreadClock()
        self.clock = clock_for(device)  # the step's device clock (deft_compile.timing): events on a GPU, the host's on a CPU
        self.last_grad_norm: torch.Tensor | None = None  # total gradient norm of the latest clipped update
        self.last_update_skipped = False  # loss scaling found an inf/NaN in the latest update and skipped it
        self.last_call_updated = False  # the last call applied an optimizer update (False while accumulating)
        self.config = config
        self.dump_dir = Path(dump_dir) if dump_dir is not None else None
        self.comm_group, self._process_group = resolve_group(process_group)
        self.profile: Profile | None = profile
        self.plan: Plan | None = None
        self._items: list[ScheduledItem] = []
        self._graphs: collections.OrderedDict[tuple, CompiledGraph] = collections.OrderedDict()
        # Traces by what changes the trace (not the plan): a plan switch or a new phase re-runs the passes on a
        # copy of the captured graph instead of tracing the step again (capture_key).
        self._captures: collections.OrderedDict[tuple, CapturedStep] = collections.OrderedDict()
        self._carry: dict[str, torch.Tensor] = {}  # tensors crossing the step boundary, by key
        self._accumulated: dict[int, int] = {}  # local gradients summed so far, per periodic item
        self._last_call: tuple[tuple, dict] | None = None
        self._preserver_state: dict[str, Any] | None = None  # loaded by load_state_dict, for the Preserver
        self._verified_signature: list | None = None
        self._index: ProfileIndex | None = None
        self._groups: list[CommGroup] = []
        self._monitor: PreserverMonitor | None = None
        self._recorder: MeasuredTimelineRecorder | None = None
        self._step_group: CommGroup | None = None  # the group this step's items use, when the policy picks one
        self.plan_history: list[dict[str, Any]] = []
        # calls of ``switch_plan``: a switch to the plan that already runs changes no hash, and the closed loop must
        # still see that someone decided (the Preserver stepping back to the synchronous plan a duel is timing)
        self.plan_switches = 0
        self.step_count = 0
        self.trace_count = 0  # step graphs built (passes run), one per cache miss
        self.capture_count = 0  # of those, the ones that traced the step (make_fx) instead of reusing a capture
        self.last_trace_seconds = 0.0
        self._seconds = {"planning": 0.0, "graphs": 0.0}
        self._links: list[tuple[str, dist.ProcessGroup]] = []
        self._side_group: dist.ProcessGroup | None = None  # buffer broadcast and control all-reduces (open_side_group)
        self._buffer_group: CommGroup | None = None  # the side group, when the step broadcasts buffers
        # Closed-loop planning times calls; under gradient accumulation calls of one cycle differ (only the last
        # communicates), so it stays off there (docs/API.md).
        self._profile_given = profile is not None  # the user's plan: no closed loop, no synchronous start
        closed_loop = config.closed_loop.active_for(policy, self._profile_given) and config.accumulation_steps == 1
        self.closed_loop = ClosedLoop(config.closed_loop) if closed_loop else None
        self.lowering = StepLowering(config.compiler)  # Inductor or aten (deft_compile/step/lowering.py)
        if self._process_group is not None:
            if config.check_consistency:
                self._check_model_across_ranks()
            broadcast_from_rank0(list(model.parameters()) + list(model.buffers()), self._process_group)
            self._links = [("default", self._process_group)] + [
                (spec, open_link(spec, ranks=dist.get_process_group_ranks(self._process_group),
                                 timeout=group_timeout(self._process_group)))
                for spec in config.links
            ]
            # DS-Sync's step groups broadcast within themselves and it has no Preserver or closed loop
            buffers = config.broadcast_buffers and any(buffer.numel() for buffer in model.buffers())
            if not policy_runtime.picks_groups and (buffers or self.closed_loop is not None
                                                     or self._watched_by_preserver()):
                self._side_group = open_side_group(self._process_group)
                self._buffer_group = comm_group_of(self._side_group) if buffers else None
        elif config.links:
            log.warning("DeftConfig.links is ignored: training is local (no process group or world size 1)")

    # -- public ---------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.comm_group.world_size if self.comm_group is not None else 1

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The data-parallel process group (None when training is local)."""
        return self._process_group

    @property
    def control_group(self) -> dist.ProcessGroup | None:
        """The group for the Preserver's and the closed loop's small all-reduces (losses, measured times): the
        side group (``open_side_group``), so they do not wait behind gradient all-reduces still in flight;
        the data-parallel group where the step has none."""
        return self._side_group if self._side_group is not None else self._process_group

    def updates_at(self, call_index: int) -> bool:
        """Whether call number ``call_index`` (0-based) ends a gradient-accumulation cycle with an update."""
        steps = self.config.accumulation_steps
        return call_index % steps == steps - 1

    @property
    def items(self) -> list[ScheduledItem]:
        """The communication items the current plan runs (what the ``schedule`` pass places)."""
        return self._items

    @property
    def carry(self) -> dict[str, torch.Tensor]:
        """Tensors crossing the step boundary (pending communication, accumulations, residuals), by key."""
        return self._carry

    @property
    def last_stats(self) -> dict[str, list[float]]:
        """Per-step statistics of the policy (DLCP: per item ``[chunks sent, dropped mass fraction]``)."""
        return self.policy_runtime.last_stats

    @property
    def compiler(self) -> str | None:
        """What ran the most recent step graph: ``"inductor"`` or ``"aten"`` (None before the first step)."""
        return self.lowering.last.compiler if self.lowering.last is not None else None

    @property
    def graph(self) -> CompiledGraph | None:
        """The graph used by the most recent step."""
        return next(reversed(self._graphs.values()), None)

    @property
    def pending(self) -> list[int]:
        """Ids of plan items with gradients not yet applied (pending communication or a partial
        accumulation of an update period); the next steps or ``flush`` apply them."""
        return sorted({int(key.split(":")[1]) for key in self._carry})

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        user_tensors, constants, spec = split_user_inputs(args, kwargs)
        if not self._items and (self.comm_group is not None or self.config.accumulation_steps > 1):
            self._plan_from(args, kwargs)  # its capture stays cached for this call's compile
        if self.comm_group is not None:
            self._use_step_group(self.policy_runtime.step_group(self))
        phases = self._phases(flush=False)
        key = self._cache_key(user_tensors, constants, spec, phases, flush=False)
        compiled = self._graphs.get(key)
        if compiled is None:
            compiled = self._compile(key, args, kwargs, phases, flush=False)
        else:
            self._graphs.move_to_end(key)
        if self._monitor is not None:
            self._monitor.before_step()
        cold_runs = self.lowering.cold_runs
        started = time.perf_counter()
        mark = self.clock.mark() if self.closed_loop is not None else None
        clocked = self.closed_loop is not None and self._cpu_timed  # two reads of /proc, about 16 µs: only if used
        if clocked:
            self._thread_clock.start()
        outputs = self._timed_run(compiled, user_tensors)
        self.policy_runtime.after_step(self)
        for item in self._items:
            if item.period > 1:
                self._accumulated[item.id] = 0 if phases[item.id].communicate else phases[item.id].count
        self._last_call = (args, kwargs)
        self.last_call_updated = self.updates_at(self.step_count)
        self.step_count += 1
        # the plan's own time: without the Preserver's measurements (they cost the same whichever plan runs and
        # are priced by the Preserver itself), and not a step that ran a graph cold (compiling, or its first run)
        elapsed = self.clock.since(mark) if mark is not None else None
        seconds = time.perf_counter() - started
        cpu_seconds, queue_seconds = self._thread_clock.stop() if clocked else (None, None)
        measurable = self.lowering.cold_runs == cold_runs
        if self._monitor is not None:
            self._monitor.after_step(outputs, args, kwargs, seconds if measurable else None)
        if self.closed_loop is not None:  # measured plans, refined profile (deft_compile.step.closed_loop)
            self.closed_loop.after_step(self, elapsed, measurable=measurable, cpu_seconds=cpu_seconds,
                                        run_queue_seconds=queue_seconds)
        return outputs

    def _use_step_group(self, group: CommGroup | None) -> None:
        """Point this step's items at ``group`` (a policy's choice for this step, e.g. DS-Sync's group)."""
        if group is None:
            return
        self._step_group = group
        self._items = [dataclasses.replace(item, group_name=group.name, world_size=group.world_size) for item in self._items]

    def _timed_run(self, compiled: CompiledGraph, user_tensors: list[torch.Tensor]) -> torch.Tensor | None:
        """Run the step; with a dump folder, record a measured timeline of a few steps (``DEFT_DUMP_MEASURE_STEP``)."""
        if self.dump_dir is not None and self._recorder is None and self.step_count == measured_step_index():
            rank = self.comm_group.rank if self.comm_group is not None else 0
            cycle = plan_cycle(self.plan) if self.plan is not None else 1
            self._recorder = MeasuredTimelineRecorder(self.dump_dir / f"timeline_measured_rank{rank}.json", cycle)
        if self._recorder is not None and not self._recorder.finished:
            return self._recorder.around(lambda: self._run(compiled, user_tensors))
        return self._run(compiled, user_tensors)

    @property
    def overheads(self) -> dict[str, float | int]:
        """Wall-clock seconds this step spent outside training steps proper: profiling and solving the first
        plan (``planning_seconds``), building step graphs (``graph_seconds``: tracing and passes, not the
        Inductor compile, which ``lowering.history`` reports), the Preserver's staleness measurements
        (``probe_seconds``) and its copies and paired replays for loss signals (``attribution_seconds``); with the
        counts of graphs built and of step traces."""
        return {
            "planning_seconds": self._seconds["planning"],
            "graph_seconds": self._seconds["graphs"],
            "probe_seconds": self._monitor.probe_seconds if self._monitor is not None else 0.0,
            "attribution_seconds": self._monitor.attribution_seconds if self._monitor is not None else 0.0,
            "compile_seconds": sum(entry.get("seconds", 0.0) for entry in self.lowering.history),
            "graphs": self.trace_count,
            "captures": self.capture_count,
        }

    @property
    def preserver(self) -> Preserver | None:
        """The Preserver watching this step's plan (policies it watches, with a process group), or None."""
        return self._monitor.preserver if self._monitor is not None else None

    def switch_plan(self, options: dict[str, Any], reason: str, plan: Plan | None = None, record: bool = True) -> None:
        """Re-solve with ``options`` (or take ``plan``) and use it from the next step; pending gradients are flushed first.

        Every rank must call it at the same step with the same options (the
        Preserver's signals are identical on all ranks, so its calls are).
        ``record=False`` (the closed loop's duel, which switches back and forth
        between two plans and records its verdict once) leaves ``plan_history``,
        the plan table in the log and the dumped plan artifacts alone.
        """
        self.flush()
        self.plan = plan if plan is not None else self.solve(options)
        self.plan_switches += 1
        if self.config.check_consistency:
            check_same_across_ranks({"plan": self.plan.hash()}, self._process_group)
        self._items = self._scheduled(self.plan, self._index)
        self._accumulated = {}
        self._verified_signature = None
        if not record:
            log.debug("step %d: plan %s (%s)", self.step_count, self.plan.hash()[:12], reason)
            return
        self._record_plan(reason)
        log.info("step %d: new plan (%s):\n%s", self.step_count, reason, self.plan.table(self.profile))
        log_structured("plan_change", {"step": self.step_count, "reason": reason, "plan": self.plan.to_dict()})
        if self.dump_dir is not None and (self.comm_group is None or self.comm_group.rank == 0):
            write_plan_artifacts(self.dump_dir / f"plan_step{self.step_count}", self.profile, self.plan)

    def solve(self, options: dict[str, Any]) -> Plan:
        """The plan this step's policy gives for its profile with solver ``options`` (nothing changes)."""
        if self.closed_loop is not None:
            options = self.closed_loop.adjust_options(options)
        return solve(self.profile, self.policy, **options)

    def _record_plan(self, reason: str) -> None:
        self.plan_history.append(
            {
                "step": self.step_count,
                "plan_hash": self.plan.hash(),
                "reason": reason,
                "delayed_items": sum(1 for item in self.plan.items if item.delay),
                "max_period": max((item.period for item in self.plan.items), default=1),
            }
        )

    def flush(self) -> None:
        """Apply every pending update now (delayed gradients, updates deferred to the next forward).

        After ``flush`` the model holds every gradient computed so far; the next
        step starts like a first step of the pending items. Without pending
        communication this does nothing. With ``delayed_update="local"`` the
        replicas of the delayed buckets' parameters (and their optimizer state)
        are averaged across ranks instead: identical again, and for SGD exactly
        the parameters the pending correction would give.
        """
        self.policy_runtime.before_flush(self)
        if not self._carry:
            return
        if self._last_call is None:
            raise DeftError("pending updates were loaded but no step has run; run a step or flush after one")
        local = sorted({p for item in self._items if item.local_first and pending_key(item.id) in self._carry
                        for p in item.params})
        args, kwargs = self._last_call
        user_tensors, constants, spec = split_user_inputs(args, kwargs)
        phases = self._phases(flush=True)
        key = self._cache_key(user_tensors, constants, spec, phases, flush=True)
        compiled = self._graphs.get(key) or self._compile(key, args, kwargs, phases, flush=True)
        self._run(compiled, [])
        self._accumulated = {}
        if local and self._process_group is not None:
            params = compiled.captured.model_state.params
            average_parameters_and_state([params[i] for i in local], self.optimizer, self._process_group)

    def state_dict(self) -> dict[str, Any]:
        """Step counter, plan, profile and pending gradients (waited, so they can be saved). No communication:
        callable on one rank. With ``delayed_update="local"`` each rank holds its own replica and pending local
        gradient; call ``flush()`` on every rank first for a checkpoint that every rank shares exactly."""
        carry = {}
        for key, tensor in self._carry.items():
            carry[key] = torch.ops._c10d_functional.wait_tensor.default(tensor).clone()
        self._carry = {key: carry[key].clone() for key in carry}
        return {
            "step_count": self.step_count,
            "policy": self.policy,
            "plan": self.plan.to_json() if self.plan is not None else None,
            "profile": self.profile.to_json() if self.profile is not None else None,
            "pending": carry,
            "accumulated": dict(self._accumulated),
            "preserver": self._monitor.state_dict() if self._monitor is not None else None,
            "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the loaded plan is used as is (no re-profiling), pending gradients continue."""
        if state["policy"] != self.policy:
            raise DeftError(f"state was saved with policy {state['policy']!r}, this step uses {self.policy!r}")
        self.step_count = int(state["step_count"])
        if state["profile"] is not None:
            self.profile = Profile.from_json(state["profile"])
        if state["plan"] is not None:
            plan = Plan.from_json(state["plan"])
            if self.plan is not None and plan.hash() != self.plan.hash():
                raise DeftError("the saved plan differs from the one this step already uses")
            self.plan = plan
            self._items = []
        self._carry = {str(k): v.clone() for k, v in state["pending"].items()}
        self._accumulated = {int(k): int(v) for k, v in state.get("accumulated", {}).items()}
        self._preserver_state = state.get("preserver")  # applied when the Preserver exists (next step's planning)
        if state.get("loss_scaler") is not None and self.loss_scaler is not None:
            self.loss_scaler.load_state_dict(state["loss_scaler"])
        if self._preserver_state is not None and self._monitor is not None:
            self._monitor.load_state_dict(self._preserver_state)
            self._preserver_state = None

    # -- graphs -----------------------------------------------------------------
    def _phases(self, *, flush: bool) -> dict[int, ItemPhase]:
        """What each plan item does in this call: from the step counter, the period and what is carried."""
        phases = {}
        for item in self._items:
            accumulated = self._accumulated.get(item.id, 0)
            pending = pending_key(item.id) in self._carry
            if item.drop is not None:  # DLCP: the residual of dropped chunks is added to the next gradient
                residual = accumulator_key(item.id) in self._carry
                phases[item.id] = ItemPhase(False, residual, communicate=not flush, count=1)
                continue
            if flush:
                phases[item.id] = ItemPhase(pending, accumulated > 0, communicate=False, count=max(accumulated, 1))
            else:
                communicate = item.period == 1 or self.step_count % item.period == item.offset
                phases[item.id] = ItemPhase(pending, accumulated > 0, communicate, accumulated + 1)
        return phases

    def _capture_key(self, user_tensors: list[torch.Tensor], constants: list[Any], spec: Any) -> tuple:
        """Everything that changes the traced step (not what the passes do with it)."""
        tensor_key = tuple((tuple(t.shape), t.dtype, t.device, t.requires_grad) for t in user_tensors)
        modes = tuple(m.training for m in self.model.modules())
        return (
            tensor_key,
            repr(constants),
            repr(spec),
            modes,
            hyperparameter_key(self.optimizer),
            tuple(self._existing_state_slots()),
            ambient_autocast(),  # the forward's autocast regions are traced into the graph
        )

    def _cache_key(
        self, user_tensors: list[torch.Tensor], constants: list[Any], spec: Any, phases: dict, *, flush: bool
    ) -> tuple:
        return (
            self._capture_key(user_tensors, constants, spec),
            tuple(sorted(phases.items())),
            self.plan.hash() if self.plan is not None else None,
            tuple((item.group_name, item.world_size) for item in self._items),
            flush,
        )

    def _existing_state_slots(self) -> list[StateSlot]:
        slots = []
        for index, p in enumerate(self.model.parameters()):
            for key, value in self.optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    slots.append((index, key))
        return slots

    def _compile(self, key: tuple, args: tuple, kwargs: dict, phases: dict[int, ItemPhase], *, flush: bool) -> CompiledGraph:
        started = time.perf_counter()
        captured = self._captured(args, kwargs)
        with lazy_graph_modules():  # the passes' and the copy's code is generated once, when it first runs
            captured = captured.copy_for_passes()
        dump_dir = self.dump_dir / f"graph_{self.trace_count:02d}" if self.dump_dir is not None else None
        dumper = GraphDumper(dump_dir, graph_index=self.trace_count)
        group = self._step_group or self.comm_group
        # A policy's own step group (DS-Sync) broadcasts within that group; otherwise the buffers go on their own
        # group, beside the all-reduces still in flight from the previous step.
        buffer_group = self._buffer_group if self._step_group is None else None
        guards = guard_options_for(self.config.max_grad_norm, self.config.norm_type, self.loss_scaler)
        with lazy_graph_modules():
            compiled = compile_captured(captured, self._items, group, self.config, dumper, phases=phases, flush=flush,
                                        guards=guards, buffer_group=buffer_group)
        self.trace_count += 1
        self.last_trace_seconds = time.perf_counter() - started
        self._seconds["graphs"] += self.last_trace_seconds
        log.info(
            "built step graph %d (%d traces; %s%s, %d nodes, %d communication items) in %.2f s",
            self.trace_count,
            self.capture_count,
            "flush" if flush else "step",
            ", with pending communication" if self._carry else "",
            len(compiled.graph_module.graph.nodes),
            len(self._items),
            self.last_trace_seconds,
        )
        self._verify_across_ranks(compiled)
        self._graphs[key] = compiled
        while len(self._graphs) > self._graph_cache_size():
            self._graphs.popitem(last=False)
        return compiled

    def _scheduled(self, plan: Plan, index: ProfileIndex, groups: list[CommGroup] | None = None,
                   profile: Profile | None = None) -> list[ScheduledItem]:
        """The plan's items on captured parameters and process groups, with gradient accumulation's period."""
        profile = profile or self.profile
        items = scheduled_items(plan, index, groups or self._groups, profile.params[0].element_bytes if profile else 4)
        items = with_accumulation(items, self.config.accumulation_steps)
        if self.config.delayed_update == "local":
            items = [dataclasses.replace(item, local_first=True) if item.apply == APPLY_NEXT_UPDATE and item.period == 1
                     else item for item in items]
        return items

    def _graph_cache_size(self) -> int:
        """``DeftConfig.max_cached_graphs``, but never fewer than a plan cycle needs: with update periods and
        accumulation every call of a cycle has its own phase (its own graph), and a cache smaller than the
        cycle would retrace on every call."""
        cycle = 1
        for item in self._items:
            cycle = math.lcm(cycle, item.period)
        return max(self.config.max_cached_graphs, 2 * cycle + 2)

    def _plan_local(self, captured: CapturedStep, index: ProfileIndex) -> None:
        """Without a process group only gradient accumulation needs items: DDP's buckets on ``LOCAL_GROUP``,
        whose collectives the pipeline removes."""
        local = static_profile(captured, index, [LinkCost("local", 0.0, 0.0)], 1)
        options = {"first_bucket_bytes": self.config.first_bucket_bytes, "bucket_cap_bytes": self.config.bucket_cap_bytes}
        plan = solve_wfbp(local, **options)  # DDP's buckets: no communication to schedule
        self._items = self._scheduled(plan, index, [CommGroup(name=LOCAL_GROUP, rank=0, world_size=1)], local)

    def _captured(self, args: tuple, kwargs: dict) -> CapturedStep:
        """The traced step for these inputs, from the cache or a new trace. The passes get a copy
        (``copy_for_passes``): the cached graph is never rewritten."""
        user_tensors, constants, spec = split_user_inputs(args, kwargs)
        key = self._capture_key(user_tensors, constants, spec)
        captured = self._captures.get(key)
        if captured is None:
            captured = self._captures[key] = self._capture(args, kwargs)
        self._captures.move_to_end(key)
        while len(self._captures) > max(2, self.config.max_cached_graphs // 2):
            self._captures.popitem(last=False)
        return captured

    def _capture(self, args: tuple, kwargs: dict) -> CapturedStep:
        self.capture_count += 1
        return capture_step(
            self.model, self.optimizer, self.loss_fn, args, kwargs, self._existing_state_slots(),
            scale_loss=self.loss_scaler is not None, accumulation_steps=self.config.accumulation_steps,
        )

    def _plan_from(self, args: tuple, kwargs: dict) -> None:
        """Profile (unless given or not needed), solve, check the plan hash across ranks, translate to items.
        The capture stays cached: the call that plans compiles from it right after."""
        planning_started = time.perf_counter()
        captured = self._captured(args, kwargs)
        annotation = annotate_capture(captured)
        index = ProfileIndex.of(annotation)
        if self.comm_group is None:
            self._plan_local(captured, index)
            return
        if self.plan is None:
            if self.profile is None:
                if not self.policy_runtime.needs_profile and not self.config.always_profile:
                    links = [LinkCost(name, 0.0, 0.0) for name, _ in self._links]
                    self.profile = static_profile(captured, index, links, self.world_size)
                else:
                    from deft_compile.step.profiler import profile_step

                    user_tensors, _, _ = split_user_inputs(args, kwargs)
                    inputs = self._graph_inputs(captured.graph_module.meta["deft_layout"], captured, user_tensors)
                    self.profile = profile_step(captured, annotation, inputs, self._links, self.world_size,
                                                contention=self.config.contention)
                    log.info("profiled the step:\n%s", self.profile.to_json())
            if len(self.profile.links) != len(self._links):
                raise DeftError(
                    f"the profile describes {len(self.profile.links)} link(s) but this step has {len(self._links)} "
                    f"(the process group plus DeftConfig.links={list(self.config.links)})"
                )
            if self._watched_by_preserver() and self._monitor is None:
                # the Preserver's prior prices (the updates a period skips) shape the first plan already
                self._monitor = PreserverMonitor(self, self._new_preserver())
            options = self._monitor.preserver.options if self._monitor is not None else self.solver_options()
            self.plan = solve(self.profile, self.policy, **options)
            log.info("plan (%s):\n%s", self.policy, self.plan.table(self.profile))
        record_plan(self.profile, self.plan, self.dump_dir if self.comm_group.rank == 0 else None)
        if self.config.check_consistency:
            check_same_across_ranks({"plan": self.plan.hash()}, self._process_group)
        self._index = index
        self._groups = [
            CommGroup(name=pg.group_name, rank=dist.get_rank(pg), world_size=dist.get_world_size(pg)) for _, pg in self._links
        ]
        self._items = self._scheduled(self.plan, index)
        if not self.plan_history:
            self._record_plan("initial plan")
        if self._watched_by_preserver() and self._monitor is None:
            self._monitor = PreserverMonitor(self, self._new_preserver())
        if self._preserver_state is not None and self._monitor is not None:
            self._monitor.load_state_dict(self._preserver_state)  # resumed: continue its decisions
            self._preserver_state = None
        self._seconds["planning"] += time.perf_counter() - planning_started

    def _watched_by_preserver(self) -> bool:
        return self.policy_runtime.watched_by_preserver and self.config.preserver.enabled

    def _new_preserver(self) -> Preserver:
        options = self.solver_options()
        buckets = self.profile.buckets(options["first_bucket_bytes"], options["bucket_cap_bytes"])
        link = self.profile.links[0]
        costs = [link.cost(sum(self.profile.params[i].nbytes for i in bucket)) for bucket in buckets]
        prior: dict[str, float] = {}
        if self.config.preserver.trade:
            numels = {param.name: param.numel for param in self.profile.params}
            prior = prior_update_prices(numels, compute_ms(self.profile), self.config.preserver.staleness_price)
        return Preserver(
            self.config.preserver,
            base_options=options,
            max_period=int(options.get("max_period", 4)),
            mean_comm_ms=sum(costs) / len(costs) if costs else 0.0,
            prior_update_prices=prior,
            start_synchronous=(self.config.preserver.start_synchronous if self.config.preserver.start_synchronous
                               is not None else not self._profile_given),
        )

    def solver_options(self) -> dict[str, Any]:
        """The solver options of this step's own plan: the user's ``plan_options`` with what the configuration
        implies (DDP bucket sizes, updates that wait for every gradient under clipping or loss scaling)."""
        options: dict[str, Any] = dict(self.config.plan_options)
        if self.config.max_grad_norm is not None or self.loss_scaler is not None:
            options.setdefault(UPDATE_WAITS_FOR_ALL, True)  # the gradient_guards pass makes updates wait for all
        if self.policy_runtime.uses_buckets:
            options.setdefault("first_bucket_bytes", self.config.first_bucket_bytes)
            options.setdefault("bucket_cap_bytes", self.config.bucket_cap_bytes)
        for key, value in self.policy_runtime.solver_defaults(self.config).items():
            options.setdefault(key, value)
        return options

    # -- running ----------------------------------------------------------------
    def _graph_inputs(self, layout, captured: CapturedStep, user_tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        params = captured.model_state.params
        state = [self.optimizer.state[params[index]][key] for index, key in layout.state_inputs]
        carry = [self._carry[key] for key in layout.carry_inputs]
        rates = lr_inputs(self.optimizer)[: layout.num_lr_inputs]
        scaler = self.loss_scaler.inputs()[: layout.num_scaler_inputs] if self.loss_scaler is not None else []
        return [*params, *captured.model_state.buffers, *state, *user_tensors[: layout.num_user_inputs], *rates, *scaler, *carry]

    def _run(self, compiled: CompiledGraph, user_tensors: list[torch.Tensor]) -> torch.Tensor | None:
        layout = compiled.layout
        captured = compiled.captured
        params = captured.model_state.params
        inputs = self._graph_inputs(layout, captured, user_tensors)
        for p in params:  # like zero_grad(set_to_none=True): the graph computes fresh gradients
            p.grad = None
        try:
            with torch.no_grad():
                outputs = self.lowering.run(compiled.graph_module, inputs, flush=compiled.flush)
        except Exception as exc:
            if self._process_group is not None and _looks_like_collective_failure(exc):
                raise diagnose_peer_failure(
                    exc, self._process_group, self.step_count, self.config.peer_check_timeout_s
                ) from exc
            raise
        outputs = list(outputs)
        loss = outputs.pop(0) if layout.has_loss else None
        new_state = outputs[: len(layout.state_outputs)]
        gradients = outputs[len(layout.state_outputs) : len(layout.state_outputs) + len(layout.gradient_outputs)]
        carries = outputs[len(layout.state_outputs) + len(layout.gradient_outputs) :]
        carried = dict(zip(layout.carry_outputs, carries))
        # Both describe the most recent call that applied gradients (with delayed buckets under accumulation
        # that is the call after a cycle's last micro-batch), so they are kept through calls that apply none.
        found_inf = carried.pop(FOUND_INF_KEY, None)
        skipped = bool(found_inf) if found_inf is not None else False
        if found_inf is not None:
            self.last_update_skipped = skipped
        norm = carried.pop(GRAD_NORM_KEY, None)
        if norm is not None:
            self.last_grad_norm = norm
        if not skipped:  # a skipped update created no optimizer state (GradScaler skips step())
            for (index, key_name), tensor in zip(layout.state_outputs, new_state):
                self.optimizer.state[params[index]][key_name] = tensor
            for index, entries in captured.extra_state.items():
                self.optimizer.state[params[index]].update(entries)
        for index, gradient in zip(layout.gradient_outputs, gradients):
            params[index].grad = gradient
        self._carry = {key: value for key, value in carried.items() if not key.startswith("stats:")}
        self.policy_runtime.record_stats({key: value for key, value in carried.items() if key.startswith("stats:")})
        return loss

    # -- checks -----------------------------------------------------------------
    def _check_model_across_ranks(self) -> None:
        """Before anything is broadcast: same parameters, buffers, optimizer layout and policy everywhere."""
        names = {p: n for n, p in self.model.named_parameters()}
        check_same_across_ranks(
            {
                "parameters": model_fingerprint(self.model.named_parameters()),
                "buffers": model_fingerprint(self.model.named_buffers()),
                "optimizer": type(self.optimizer).__name__,
                "param groups": [[names.get(p, "?") for p in g["params"]] for g in self.optimizer.param_groups],
                "optimizer hyper-parameters": repr(hyperparameter_key(self.optimizer)),
                "learning rates": [float(g["lr"]) for g in self.optimizer.param_groups],
                "policy": self.policy,
            },
            self._process_group,
        )

    def _verify_across_ranks(self, compiled: CompiledGraph) -> None:
        """Check once, before the first collective, that every rank will run the same communication.

        Later graphs (new input shapes) are compared locally with the verified
        schedule, because a cross-rank check at that point could deadlock
        against a rank that did not retrace.
        """
        if self._process_group is None:
            return
        signature = compiled.collective_signature()
        if self._verified_signature is None:
            if self.config.check_consistency:
                check_same_across_ranks({"communication items": signature}, self._process_group)
            self._verified_signature = signature
        elif signature != self._verified_signature:
            raise DeftError(
                "a retraced step communicates different items than the first one; ranks could run mismatched "
                "collectives"
            )


def _looks_like_collective_failure(exc: BaseException) -> bool:
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc).lower()
    return any(word in text for word in ("gloo", "nccl", "connection", "timed out", "timeout", "peer"))
