"""The step's graph cache: captures and step graphs by key, built on a miss, evicted oldest first.

- Captures are cached by what changes the trace (input shapes, dtypes and devices, non-tensor inputs, module
  modes, the optimizer's hyper-parameters, which optimizer state exists, the ambient autocast), with the
  dimensions that changed size left out once they are captured symbolic (``step/symbolic.py``).
- Step graphs are cached by the capture key, each item's phase in the call, the plan, the items' groups and
  whether the graph flushes. A step graph runs the passes on a copy of the cached capture
  (``CapturedStep.copy_for_passes``), so a plan switch or a new phase never traces the step again.
- A graph never outlives its capture (the capture's guards decide which inputs it serves), and the cache keeps
  ``DeftConfig.max_cached_graphs`` graphs per plan for up to ``PLANS_KEPT`` plans, never fewer than a plan cycle
  needs.
- The first graph's communication is compared across ranks before its first collective; every later graph must
  communicate the same items (a cross-rank check then could deadlock against a rank that did not rebuild).

The cache holds no per-call state: what crosses the step boundary belongs to the runner (``step/runner.py``).
"""

from __future__ import annotations

import collections
import logging
import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from deft_compile.config import DeftConfig
from deft_compile.debug.dump import GraphDumper
from deft_compile.errors import DeftError
from deft_compile.passes.schedule import ItemPhase, ScheduledItem
from deft_compile.planner.plan import Plan
from deft_compile.step.capture import (CapturedStep, StateSlot, ambient_autocast, capture_step, recapture_with_state,
                                      split_user_inputs)
from deft_compile.step.compensation import compensation_for
from deft_compile.step.distributed import check_same_across_ranks
from deft_compile.step.groups import StepGroups
from deft_compile.step.loss_scaling import LossScaler, guard_options_for
from deft_compile.step.lowering import lazy_graph_modules
from deft_compile.step.optim_support import hyperparameter_key
from deft_compile.step.pipeline import CompiledGraph, compile_captured
from deft_compile.step.symbolic import ShapeFamilies

log = logging.getLogger("deft_compile")

#: plans whose graphs the cache keeps side by side (``GraphCache._size``): the synchronous plan, a plan with delays,
#: and the closed loop's two priority trials
PLANS_KEPT = 4


class GraphCache:
    """Captures and step graphs of one compiled step, by key (see the module docstring)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Any, config: DeftConfig,
                 groups: StepGroups, loss_scaler: LossScaler | None, dump_dir: Path | None) -> None:
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.config = config
        self.groups = groups
        self.loss_scaler = loss_scaler
        self.dump_dir = dump_dir
        self.graphs: collections.OrderedDict[tuple, CompiledGraph] = collections.OrderedDict()
        self.captures: collections.OrderedDict[tuple, CapturedStep] = collections.OrderedDict()
        self.families = ShapeFamilies()  # which input dimensions changed size (captured symbolic)
        self._static_families: set[tuple] = set()  # families whose symbolic trace failed
        self.trace_count = 0  # step graphs built (passes run), one per miss
        self.capture_count = 0  # of those, the ones that traced the step (make_fx) instead of reusing a capture
        self.update_recaptures = 0  # captures made from another by tracing only its update (new optimizer state)
        self.last_trace_seconds = 0.0
        self.graph_seconds = 0.0  # the capture's copy and the passes per step graph; captures apart
        self.capture_seconds = 0.0  # make_fx traces of the step (``_trace``) and of updates alone (``_with_new_state``)
        self._verified_signature: list | None = None

    def graph(self, args: tuple, kwargs: dict, items: list[ScheduledItem], phases: dict[int, ItemPhase],
              plan: Plan | None, *, flush: bool) -> CompiledGraph:
        """The step graph of this call: from the cache (made the most recent) or built now."""
        user_tensors, constants, spec = split_user_inputs(args, kwargs)
        key = self._graph_key(user_tensors, constants, spec, items, phases, plan, flush)
        compiled = self.graphs.get(key)
        if compiled is None:
            return self._build(args, kwargs, items, phases, plan, flush=flush)
        self.graphs.move_to_end(key)
        return compiled

    def new_plan(self) -> None:
        """A new plan runs from the next call: its communication is compared across ranks again."""
        self._verified_signature = None

    # -- captures -------------------------------------------------------------------------------
    def captured(self, args: tuple, kwargs: dict) -> CapturedStep:
        """The traced step for these inputs, from the cache or a new trace (symbolic in the dimensions the key
        leaves out). The passes get a copy (``copy_for_passes``): the cached graph is never rewritten."""
        user_tensors, constants, spec = split_user_inputs(args, kwargs)
        key = self.capture_key(user_tensors, constants, spec)
        captured = self.captures.get(key)
        if captured is None:
            captured = self._with_new_state(key, user_tensors)
            if captured is None:
                family, pattern = key
                dynamic = frozenset((i, d) for i, shape in enumerate(pattern) for d, size in enumerate(shape)
                                    if size is None)
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

    def _with_new_state(self, key: tuple, user_tensors: list[torch.Tensor]) -> CapturedStep | None:
        """A capture for ``key`` from a cached one that differs only in which optimizer state exists (a delayed
        bucket's first update created some since; the state slots are the family key's last entry) and admits
        these inputs, its update traced again (``recapture_with_state``); None where there is none, or it does
        not split (then the whole step is traced, and a failure to split is logged)."""
        family, shapes = key
        for (other_family, other_shapes), captured in reversed(self.captures.items()):
            if (other_shapes != shapes or other_family[:-1] != family[:-1]
                    or (captured.symbolic is not None and not captured.symbolic.admits(user_tensors))):
                continue
            started = time.perf_counter()
            try:
                recaptured = recapture_with_state(captured, self.optimizer, list(family[-1]))
            except Exception as exc:  # noqa: BLE001 - the whole trace that follows captures it, or names its error
                log.info("the update alone could not be traced (%s: %s); tracing the whole step", type(exc).__name__,
                         exc)
                recaptured = None
            finally:
                self.capture_seconds += time.perf_counter() - started
            if recaptured is not None:
                self.update_recaptures += 1
                return recaptured
        return None

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
            tuple(self.existing_state_slots()),  # last: ``_with_new_state`` matches captures on everything before it
        )

    def existing_state_slots(self) -> list[StateSlot]:
        slots = []
        for index, p in enumerate(self.model.parameters()):
            for key, value in self.optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    slots.append((index, key))
        return slots

    def _trace(self, args: tuple, kwargs: dict, dynamic: frozenset) -> CapturedStep:
        """A new capture, its time counted in ``capture_seconds``."""
        started = time.perf_counter()
        try:
            return self._capture(args, kwargs, dynamic)
        finally:
            self.capture_seconds += time.perf_counter() - started

    def _capture(self, args: tuple, kwargs: dict, dynamic: frozenset) -> CapturedStep:
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

    # -- step graphs ----------------------------------------------------------------------------
    def _graph_key(self, user_tensors: list[torch.Tensor], constants: list[Any], spec: Any,
                   items: list[ScheduledItem], phases: dict[int, ItemPhase], plan: Plan | None, flush: bool) -> tuple:
        return (
            self.capture_key(user_tensors, constants, spec),
            tuple(sorted(phases.items())),
            plan.hash() if plan is not None else None,
            tuple((item.group_name, item.world_size) for item in items),
            flush,
        )

    def _build(self, args: tuple, kwargs: dict, items: list[ScheduledItem], phases: dict[int, ItemPhase],
               plan: Plan | None, *, flush: bool) -> CompiledGraph:
        """Run the passes on a copy of the call's capture (traced first where the cache has none) and cache the
        step graph under the key of the capture it came from (static where the symbolic trace failed)."""
        started, captures_before = time.perf_counter(), self.capture_seconds
        captured = self.captured(args, kwargs)
        user_tensors, constants, spec = split_user_inputs(args, kwargs)
        key = self._graph_key(user_tensors, constants, spec, items, phases, plan, flush)
        with lazy_graph_modules():  # the passes' and the copy's code is generated once, when it first runs
            captured = captured.copy_for_passes()
        dump_dir = self.dump_dir / f"graph_{self.trace_count:02d}" if self.dump_dir is not None else None
        dumper = GraphDumper(dump_dir, graph_index=self.trace_count)
        group = self.groups.step_group or self.groups.comm_group
        # A policy's own step group (DS-Sync) broadcasts within that group; otherwise the buffers go on their own
        # group, beside the all-reduces still in flight from the previous step.
        buffer_group = self.groups.buffer_group if self.groups.step_group is None else None
        guards = guard_options_for(self.config.max_grad_norm, self.config.norm_type, self.loss_scaler)
        compensation = (compensation_for(items, self.optimizer, captured.model_state.params)
                        if self.config.delayed_update == "compensated" else None)
        with lazy_graph_modules():
            compiled = compile_captured(captured, items, group, self.config, dumper, phases=phases, flush=flush,
                                        guards=guards, buffer_group=buffer_group, compensation=compensation)
        self.trace_count += 1
        self.last_trace_seconds = time.perf_counter() - started
        self.graph_seconds += self.last_trace_seconds - (self.capture_seconds - captures_before)
        log.info(
            "built step graph %d (%d traces, %d of an update alone; %s%s, %d nodes, %d communication items) in %.2f s",
            self.trace_count,
            self.capture_count,
            self.update_recaptures,
            "flush" if flush else "step",
            ", with pending communication" if any(phase.pending_in or phase.accumulated_in for phase in phases.values())
            else "",
            len(compiled.graph_module.graph.nodes),
            len(items),
            self.last_trace_seconds,
        )
        self._verify_across_ranks(compiled)
        self.graphs[key] = compiled
        while len(self.graphs) > self._size(items):
            self.graphs.popitem(last=False)
        return compiled

    def _size(self, items: list[ScheduledItem]) -> int:
        """``DeftConfig.max_cached_graphs`` per plan that has graphs in the cache, for up to ``PLANS_KEPT`` plans, but
        never fewer than a plan cycle needs: with update periods and accumulation every call of a cycle has its
        own phase (its own graph), and a cache smaller than the cycle would retrace on every call. Per plan
        because a run returns to plans it left (the closed loop's duel alternates two, a flush runs between them,
        the Preserver goes back to the synchronous plan), and a plan seen before must build no graph again."""
        cycle = 1
        for item in items:
            cycle = math.lcm(cycle, item.period)
        plans = len({key[2] for key in self.graphs})
        return max(self.config.max_cached_graphs, 2 * cycle + 2) * max(1, min(plans, PLANS_KEPT))

    def _verify_across_ranks(self, compiled: CompiledGraph) -> None:
        """Check once per plan, before the first collective, that every rank will run the same communication.

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
