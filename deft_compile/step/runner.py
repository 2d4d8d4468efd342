"""The step runner: builds, caches and runs the step's graphs for the items of the plan that runs.

- Captures are cached by what changes the trace (input shapes, dtypes and devices, non-tensor inputs, module
  modes, the optimizer's hyper-parameters, which optimizer state exists, the ambient autocast); step graphs by
  the capture key, each item's phase in this call, the plan, the items' groups and whether it flushes. A step
  graph runs the passes on a copy of the cached capture (``CapturedStep.copy_for_passes``).
- A call runs its graph under ``no_grad``, stores the new optimizer state and ``param.grad``, and keeps what
  crosses the step boundary (``carry``: pending communication, accumulations, residuals) for the next call.
- A flush runs the flush graph of the last call's inputs: every pending update is applied now.
- Before the first collective, the communication every rank will run is compared across ranks; a later graph
  must communicate the same items.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from deft_compile.config import DeftConfig
from deft_compile.debug.artifacts import MeasuredTimelineRecorder, measured_step_index, plan_cycle
from deft_compile.debug.dump import GraphDumper
from deft_compile.errors import DeftError
from deft_compile.passes.gradient_guards import FOUND_INF_KEY, GRAD_NORM_KEY
from deft_compile.passes.schedule import ItemPhase, ScheduledItem, accumulator_key, item_of_key, pending_key
from deft_compile.planner.plan import Plan
from deft_compile.step.capture import CapturedStep, StateSlot, ambient_autocast, capture_step, split_user_inputs
from deft_compile.step.compensation import compensation_for
from deft_compile.step.distributed import average_parameters_and_state, check_same_across_ranks, diagnose_peer_failure
from deft_compile.step.groups import StepGroups
from deft_compile.step.loss_scaling import LossScaler, guard_options_for
from deft_compile.step.lowering import StepLowering, lazy_graph_modules
from deft_compile.step.optim_support import hyperparameter_key, lr_inputs
from deft_compile.step.pipeline import CommGroup, CompiledGraph, compile_captured
from deft_compile.step.symbolic import ShapeFamilies

log = logging.getLogger("deft_compile")

#: plans whose graphs the cache keeps side by side (``StepRunner._graph_cache_size``): the synchronous plan, a plan
#: with delays, and the closed loop's two priority trials
PLANS_KEPT = 4


class StepRunner:
    """Runs the current items' step graphs and keeps what crosses the step boundary (see the module docstring)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Any, config: DeftConfig,
                 groups: StepGroups, loss_scaler: LossScaler | None, lowering: StepLowering,
                 dump_dir: Path | None, record_stats: Callable[[dict[str, torch.Tensor]], None]) -> None:
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.config = config
        self.groups = groups
        self.loss_scaler = loss_scaler
        self.lowering = lowering
        self.dump_dir = dump_dir
        self.items: list[ScheduledItem] = []  # the communication items of the plan that runs
        self.carry: dict[str, torch.Tensor] = {}  # tensors crossing the step boundary, by key
        self.accumulated: dict[int, int] = {}  # local gradients summed so far, per periodic item
        self.graphs: collections.OrderedDict[tuple, CompiledGraph] = collections.OrderedDict()
        # Traces by what changes the trace (not the plan): a plan switch or a new phase re-runs the passes on a
        # copy of the captured graph instead of tracing the step again (capture_key).
        self.captures: collections.OrderedDict[tuple, CapturedStep] = collections.OrderedDict()
        self.families = ShapeFamilies()  # which input dimensions changed size (captured symbolic)
        self._static_families: set[tuple] = set()  # families whose symbolic trace failed
        self.last_call: tuple[tuple, dict] | None = None
        self.step_count = 0
        self.trace_count = 0  # step graphs built (passes run), one per cache miss
        self.capture_count = 0  # of those, the ones that traced the step (make_fx) instead of reusing a capture
        self.last_trace_seconds = 0.0
        self.graph_seconds = 0.0
        self.last_grad_norm: torch.Tensor | None = None  # total gradient norm of the latest clipped update
        self.last_update_skipped = False  # loss scaling found an inf/NaN in the latest update and skipped it
        self.last_call_updated = False  # the last call applied an optimizer update (False while accumulating)
        # the last call moved weights: False for a call that applies no update although it ends a cycle (the first
        # call of a plan that moves every update into the next call, an update skipped for an inf/NaN)
        self.last_call_moved_weights = False
        self._run_moved_weights = False
        self._verified_signature: list | None = None
        self._recorder: MeasuredTimelineRecorder | None = None
        self._record_stats = record_stats  # each call's per-item statistics (``"stats:<item>"`` outputs)

    def use_items(self, items: list[ScheduledItem], *, reset: bool = False) -> None:
        """Run ``items`` from the next call; ``reset``: a new plan (its accumulations start afresh and its
        communication is compared across ranks again)."""
        self.items = items
        if reset:
            self.accumulated = {}
            self._verified_signature = None

    def use_step_group(self, group: CommGroup | None) -> None:
        """Point this step's items at ``group`` (a policy's choice for this step, e.g. DS-Sync's group)."""
        if group is None:
            return
        self.groups.step_group = group
        self.items = [dataclasses.replace(item, group_name=group.name, world_size=group.world_size)
                      for item in self.items]

    def updates_at(self, call_index: int) -> bool:
        """Whether call number ``call_index`` (0-based) ends a gradient-accumulation cycle with an update."""
        steps = self.config.accumulation_steps
        return call_index % steps == steps - 1

    @property
    def pending(self) -> list[int]:
        return sorted({item_of_key(key) for key in self.carry} - {None})

    # -- a call -------------------------------------------------------------------------------
    def prepare(self, args: tuple, kwargs: dict, plan: Plan | None) -> tuple[CompiledGraph, list, dict]:
        """(the graph this call runs, its user tensors, each item's phase), built on a cache miss."""
        user_tensors, constants, spec = split_user_inputs(args, kwargs)
        phases = self.phases(flush=False)
        key = self.cache_key(user_tensors, constants, spec, phases, plan, flush=False)
        compiled = self.graphs.get(key)
        if compiled is None:
            compiled = self.compile(key, args, kwargs, phases, flush=False)
        else:
            self.graphs.move_to_end(key)
        if not self._admitted(compiled, user_tensors):  # Inductor's guards exclude these sizes: a static capture
            key = self.cache_key(user_tensors, constants, spec, phases, plan, flush=False)
            compiled = self.graphs.get(key) or self.compile(key, args, kwargs, phases, flush=False)
        return compiled, user_tensors, phases

    def _admitted(self, compiled: CompiledGraph, user_tensors: list[torch.Tensor]) -> bool:
        """Whether a graph may run on these inputs: static, or symbolic and its guards admit them once everything
        its first run would compile is compiled (Inductor may add guards to the capture's shape environment)."""
        symbolic = compiled.captured.symbolic
        if symbolic is None:
            return True
        self.lowering.prepare(compiled.graph_module, self.graph_inputs(compiled.layout, compiled.captured, user_tensors))
        return symbolic.admits(user_tensors)

    def run_step(self, compiled: CompiledGraph, user_tensors: list[torch.Tensor], plan: Plan | None):
        """Run the step; with a dump folder, record a measured timeline of a few steps (``DEFT_DUMP_MEASURE_STEP``)."""
        if self.dump_dir is not None and self._recorder is None and self.step_count == measured_step_index():
            rank = self.groups.comm_group.rank if self.groups.comm_group is not None else 0
            cycle = plan_cycle(plan) if plan is not None else 1
            self._recorder = MeasuredTimelineRecorder(self.dump_dir / f"timeline_measured_rank{rank}.json", cycle)
        if self._recorder is not None and not self._recorder.finished:
            return self._recorder.around(lambda: self.run(compiled, user_tensors))
        return self.run(compiled, user_tensors)

    def finish_call(self, phases: dict[int, ItemPhase], args: tuple, kwargs: dict) -> None:
        """After the call's graph ran: its periodic items' accumulations, the inputs a flush reuses, the counter."""
        for item in self.items:
            if item.period > 1:
                self.accumulated[item.id] = 0 if phases[item.id].communicate else phases[item.id].count
        self.last_call = (args, kwargs)
        self.last_call_updated = self.updates_at(self.step_count)
        self.last_call_moved_weights = self._run_moved_weights
        self.step_count += 1

    def flush(self, plan: Plan | None) -> None:
        """Apply every pending update now with the flush graph of the last call's inputs (see
        ``CompiledStep.flush``); nothing without pending communication."""
        if not self.carry:
            return
        if self.last_call is None:
            raise DeftError("pending updates were loaded but no step has run; run a step or flush after one")
        local = sorted({p for item in self.items if item.local_first and pending_key(item.id) in self.carry
                        for p in item.params})
        args, kwargs = self.last_call
        user_tensors, constants, spec = split_user_inputs(args, kwargs)
        phases = self.phases(flush=True)
        key = self.cache_key(user_tensors, constants, spec, phases, plan, flush=True)
        compiled = self.graphs.get(key) or self.compile(key, args, kwargs, phases, flush=True)
        self.run(compiled, [])
        self.accumulated = {}
        if local and self.groups.process_group is not None:
            params = compiled.captured.model_state.params
            average_parameters_and_state([params[i] for i in local], self.optimizer, self.groups.process_group)

    def saved_carry(self) -> dict[str, torch.Tensor]:
        """The carried tensors, waited and cloned (a checkpoint's copy; the runner keeps clones of its own)."""
        carry = {}
        for key, tensor in self.carry.items():
            carry[key] = torch.ops._c10d_functional.wait_tensor.default(tensor).clone()
        self.carry = {key: carry[key].clone() for key in carry}
        return carry

    # -- graphs -------------------------------------------------------------------------------
    def phases(self, *, flush: bool) -> dict[int, ItemPhase]:
        """What each plan item does in this call: from the step counter, the period and what is carried."""
        phases = {}
        for item in self.items:
            accumulated = self.accumulated.get(item.id, 0)
            pending = pending_key(item.id) in self.carry
            if item.drop is not None:  # DLCP: the residual of dropped chunks is added to the next gradient
                residual = accumulator_key(item.id) in self.carry
                phases[item.id] = ItemPhase(False, residual, communicate=not flush, count=1)
                continue
            if flush:
                phases[item.id] = ItemPhase(pending, accumulated > 0, communicate=False, count=max(accumulated, 1))
            else:
                communicate = item.period == 1 or self.step_count % item.period == item.offset
                phases[item.id] = ItemPhase(pending, accumulated > 0, communicate, accumulated + 1)
        return phases

    def capture_key(self, user_tensors: list[torch.Tensor], constants: list[Any], spec: Any) -> tuple:
        """Everything that changes the traced step (not what the passes do with it): the shape family's key and
        either the input shapes, or their pattern with the symbolic dimensions left out (``step/symbolic.py``):
        a size the family's symbolic capture admits shares its key."""
        family = self.family_key(user_tensors, constants, spec)
        shapes = tuple(tuple(t.shape) for t in user_tensors)
        dynamic = (self.families.observe(family[:5], shapes, ShapeFamilies.marked(user_tensors))
                   if self.config.dynamic_shapes else frozenset())
        if dynamic and family not in self._static_families:
            symbolic_key = (family, ShapeFamilies.pattern(shapes, dynamic))
            captured = self.captures.get(symbolic_key)
            if captured is None or captured.symbolic.admits(user_tensors):
                return symbolic_key
        return (family, shapes)

    def family_key(self, user_tensors: list[torch.Tensor], constants: list[Any], spec: Any) -> tuple:
        """What calls of one shape family share: everything in the capture key but the tensors' sizes. Its first
        five entries (the inputs' kinds, the module modes, the autocast) decide which dimensions are symbolic: a
        dimension that changed once stays symbolic when the optimizer state or a hyper-parameter changes."""
        tensor_key = tuple((t.dim(), t.dtype, t.device, t.requires_grad) for t in user_tensors)
        modes = tuple(m.training for m in self.model.modules())
        return (
            tensor_key,
            repr(constants),
            repr(spec),
            modes,
            ambient_autocast(),  # the forward's autocast regions are traced into the graph
            hyperparameter_key(self.optimizer),
            tuple(self.existing_state_slots()),
        )

    def cache_key(self, user_tensors: list[torch.Tensor], constants: list[Any], spec: Any, phases: dict,
                  plan: Plan | None, *, flush: bool) -> tuple:
        return (
            self.capture_key(user_tensors, constants, spec),
            tuple(sorted(phases.items())),
            plan.hash() if plan is not None else None,
            tuple((item.group_name, item.world_size) for item in self.items),
            flush,
        )

    def existing_state_slots(self) -> list[StateSlot]:
        slots = []
        for index, p in enumerate(self.model.parameters()):
            for key, value in self.optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    slots.append((index, key))
        return slots

    def captured(self, args: tuple, kwargs: dict) -> CapturedStep:
        """The traced step for these inputs, from the cache or a new trace (symbolic in the dimensions the key
        leaves out). The passes get a copy (``copy_for_passes``): the cached graph is never rewritten."""
        user_tensors, constants, spec = split_user_inputs(args, kwargs)
        key = self.capture_key(user_tensors, constants, spec)
        captured = self.captures.get(key)
        if captured is None:
            family, pattern = key
            dynamic = frozenset((i, d) for i, shape in enumerate(pattern) for d, size in enumerate(shape) if size is None)
            captured = self._trace(args, kwargs, dynamic)
            if dynamic and captured.symbolic is None:  # the symbolic trace failed: this family stays static
                key = (family, tuple(tuple(t.shape) for t in user_tensors))
                captured = self.captures.get(key) or captured
            self.captures[key] = captured
        self.captures.move_to_end(key)
        while len(self.captures) > max(2, self.config.max_cached_graphs // 2):
            evicted, _ = self.captures.popitem(last=False)
            for graph_key in [k for k in self.graphs if k[0] == evicted]:  # a graph never outlives its capture's
                del self.graphs[graph_key]                                 # guards
        return captured

    def _trace(self, args: tuple, kwargs: dict, dynamic: frozenset) -> CapturedStep:
        """A new capture; with ``dynamic`` dimensions, symbolic in them, else (or when that trace fails) static."""
        self.capture_count += 1
        options = dict(scale_loss=self.loss_scaler is not None, accumulation_steps=self.config.accumulation_steps)
        if dynamic:
            try:
                return capture_step(self.model, self.optimizer, self.loss_fn, args, kwargs,
                                    self.existing_state_slots(), dynamic_dims=dynamic, **options)
            except Exception as exc:  # noqa: BLE001 - any failure of the symbolic trace falls back to static shapes
                user_tensors, constants, spec = split_user_inputs(args, kwargs)
                self._static_families.add(self.family_key(user_tensors, constants, spec))
                log.warning("the step could not be captured with input dimensions %s symbolic; every new size of "
                            "them is captured on its own (%s: %s)", sorted(dynamic), type(exc).__name__,
                            str(exc).strip().splitlines()[0] if str(exc).strip() else "")
        return capture_step(self.model, self.optimizer, self.loss_fn, args, kwargs, self.existing_state_slots(),
                            **options)

    def compile(self, key: tuple, args: tuple, kwargs: dict, phases: dict[int, ItemPhase], *,
                flush: bool) -> CompiledGraph:
        started = time.perf_counter()
        captured = self.captured(args, kwargs)
        user_tensors, constants, spec = split_user_inputs(args, kwargs)
        key = (self.capture_key(user_tensors, constants, spec), *key[1:])  # static if the symbolic trace failed
        with lazy_graph_modules():  # the passes' and the copy's code is generated once, when it first runs
            captured = captured.copy_for_passes()
        dump_dir = self.dump_dir / f"graph_{self.trace_count:02d}" if self.dump_dir is not None else None
        dumper = GraphDumper(dump_dir, graph_index=self.trace_count)
        group = self.groups.step_group or self.groups.comm_group
        # A policy's own step group (DS-Sync) broadcasts within that group; otherwise the buffers go on their own
        # group, beside the all-reduces still in flight from the previous step.
        buffer_group = self.groups.buffer_group if self.groups.step_group is None else None
        guards = guard_options_for(self.config.max_grad_norm, self.config.norm_type, self.loss_scaler)
        compensation = (compensation_for(self.items, self.optimizer, captured.model_state.params)
                        if self.config.delayed_update == "compensated" else None)
        with lazy_graph_modules():
            compiled = compile_captured(captured, self.items, group, self.config, dumper, phases=phases, flush=flush,
                                        guards=guards, buffer_group=buffer_group, compensation=compensation)
        self.trace_count += 1
        self.last_trace_seconds = time.perf_counter() - started
        self.graph_seconds += self.last_trace_seconds
        log.info(
            "built step graph %d (%d traces; %s%s, %d nodes, %d communication items) in %.2f s",
            self.trace_count,
            self.capture_count,
            "flush" if flush else "step",
            ", with pending communication" if self.carry else "",
            len(compiled.graph_module.graph.nodes),
            len(self.items),
            self.last_trace_seconds,
        )
        self._verify_across_ranks(compiled)
        self.graphs[key] = compiled
        while len(self.graphs) > self._graph_cache_size():
            self.graphs.popitem(last=False)
        return compiled

    def _graph_cache_size(self) -> int:
        """``DeftConfig.max_cached_graphs`` per plan that has graphs in the cache, for up to ``PLANS_KEPT`` plans, but
        never fewer than a plan cycle needs: with update periods and accumulation every call of a cycle has its
        own phase (its own graph), and a cache smaller than the cycle would retrace on every call. Per plan
        because a run returns to plans it left (the closed loop's duel alternates two, a flush runs between them,
        the Preserver goes back to the synchronous plan), and a plan seen before must build no graph again."""
        cycle = 1
        for item in self.items:
            cycle = math.lcm(cycle, item.period)
        plans = len({key[2] for key in self.graphs})
        return max(self.config.max_cached_graphs, 2 * cycle + 2) * max(1, min(plans, PLANS_KEPT))

    # -- running ------------------------------------------------------------------------------
    def graph_inputs(self, layout, captured: CapturedStep, user_tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        params = captured.model_state.params
        state = [self.optimizer.state[params[index]][key] for index, key in layout.state_inputs]
        carry = [self.carry[key] for key in layout.carry_inputs]
        rates = lr_inputs(self.optimizer)[: layout.num_lr_inputs]
        scaler = self.loss_scaler.inputs()[: layout.num_scaler_inputs] if self.loss_scaler is not None else []
        return [*params, *captured.model_state.buffers, *state, *user_tensors[: layout.num_user_inputs], *rates,
                *scaler, *carry]

    def run(self, compiled: CompiledGraph, user_tensors: list[torch.Tensor]) -> torch.Tensor | None:
        layout = compiled.layout
        captured = compiled.captured
        params = captured.model_state.params
        inputs = self.graph_inputs(layout, captured, user_tensors)
        for p in params:  # like zero_grad(set_to_none=True): the graph computes fresh gradients
            p.grad = None
        process_group = self.groups.process_group
        try:
            with torch.no_grad():
                outputs = self.lowering.run(compiled.graph_module, inputs, flush=compiled.flush)
        except Exception as exc:
            if process_group is not None and _looks_like_collective_failure(exc):
                raise diagnose_peer_failure(
                    exc, process_group, self.step_count, self.config.peer_check_timeout_s
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
        self._run_moved_weights = bool(layout.gradient_outputs) and not skipped
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
        self.carry = {key: value for key, value in carried.items() if not key.startswith("stats:")}
        self._record_stats({key: value for key, value in carried.items() if key.startswith("stats:")})
        return loss

    def _verify_across_ranks(self, compiled: CompiledGraph) -> None:
        """Check once, before the first collective, that every rank will run the same communication.

        Later graphs (new input shapes) are compared locally with the verified
        schedule, because a cross-rank check at that point could deadlock
        against a rank that did not retrace.
        """
        process_group = self.groups.process_group
        if process_group is None:
            return
        signature = compiled.collective_signature()
        if self._verified_signature is None:
            if self.config.check_consistency:
                check_same_across_ranks({"communication items": signature}, process_group)
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
