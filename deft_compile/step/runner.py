"""The step runner: runs the step graph of each call for the items of the plan that runs.

- A call takes its graph from the graph cache (``step/graph_cache.py``), which builds it on a miss, runs it
  under ``no_grad``, stores the new optimizer state and ``param.grad``, and keeps what crosses the step boundary
  (``carry``: pending communication, accumulations, residuals) for the next call.
- Each item's phase in a call (apply what is pending, accumulate, communicate) follows from the step counter,
  the item's period and what is carried.
- A flush runs the flush graph of the last call's inputs: every pending update is applied now.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from deft_compile.config import DeftConfig
from deft_compile.debug.artifacts import MeasuredTimelineRecorder, measured_step_index, plan_cycle
from deft_compile.errors import DeftError
from deft_compile.passes.gradient_guards import FOUND_INF_KEY, GRAD_NORM_KEY
from deft_compile.passes.schedule import (ItemPhase, ScheduledItem, accumulator_key, hyperparameter_carry_key, item_of_key,
                                         pending_key)
from deft_compile.planner.plan import Plan
from deft_compile.step.capture import CapturedStep, split_user_inputs
from deft_compile.step.distributed import average_parameters_and_state, diagnose_peer_failure
from deft_compile.step.graph_cache import GraphCache
from deft_compile.step.groups import StepGroups
from deft_compile.step.loss_scaling import LossScaler
from deft_compile.step.lowering import StepLowering
from deft_compile.step.optim_support import hyperparameter_inputs, hyperparameter_slots, hyperparameter_value
from deft_compile.step.pipeline import CommGroup, CompiledGraph


class StepRunner:
    """Runs the current items' step graphs and keeps what crosses the step boundary (see the module docstring)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Any, config: DeftConfig,
                 groups: StepGroups, loss_scaler: LossScaler | None, lowering: StepLowering,
                 dump_dir: Path | None, record_stats: Callable[[dict[str, torch.Tensor]], None]) -> None:
        self.optimizer = optimizer
        self.config = config
        self.groups = groups
        self.loss_scaler = loss_scaler
        self.lowering = lowering
        self.dump_dir = dump_dir
        self.cache = GraphCache(model, optimizer, loss_fn, config, groups, loss_scaler, dump_dir)
        self.items: list[ScheduledItem] = []  # the communication items of the plan that runs
        self.carry: dict[str, torch.Tensor] = {}  # tensors crossing the step boundary, by key
        self.accumulated: dict[int, int] = {}  # local gradients summed so far, per periodic item
        self.last_graph: CompiledGraph | None = None  # the graph of the call being run or last run, or of a flush
        self.last_call: tuple[tuple, dict] | None = None
        self.step_count = 0
        self._hyperparameters: tuple[tuple, list[torch.Tensor]] | None = None  # (slots and values, inputs)
        self.last_grad_norm: torch.Tensor | None = None  # total gradient norm of the latest clipped update
        self.last_update_skipped = False  # loss scaling found an inf/NaN in the latest update and skipped it
        self.last_call_updated = False  # the last call applied an optimizer update (False while accumulating)
        # the last call moved weights: False for a call that applies no update although it ends a cycle (the first
        # call of a plan that moves every update into the next call, an update skipped for an inf/NaN)
        self.last_call_moved_weights = False
        self._run_moved_weights = False
        self._recorder: MeasuredTimelineRecorder | None = None
        self._record_stats = record_stats  # each call's per-item statistics (``"stats:<item>"`` outputs)

    def use_items(self, items: list[ScheduledItem], *, reset: bool = False) -> None:
        """Run ``items`` from the next call; ``reset``: a new plan (its accumulations start afresh and its
        communication is compared across ranks again)."""
        self.items = items
        if reset:
            self.accumulated = {}
            self.cache.new_plan()

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
        user_tensors, _, _ = split_user_inputs(args, kwargs)
        phases = self.phases(flush=False)
        compiled = self.cache.graph(args, kwargs, self.items, phases, plan, flush=False)
        if not self._admitted(compiled, user_tensors):  # Inductor's guards exclude these sizes: a static capture
            compiled = self.cache.graph(args, kwargs, self.items, phases, plan, flush=False)
        self.last_graph = compiled
        return compiled, user_tensors, phases

    def _admitted(self, compiled: CompiledGraph, user_tensors: list[torch.Tensor]) -> bool:
        """Whether a graph may run on these inputs: static, or symbolic and its guards admit them once everything
        its first run would compile is compiled (Inductor may add guards to the capture's shape environment)."""
        symbolic = compiled.captured.symbolic
        if symbolic is None:
            return True
        self.lowering.prepare(compiled.graph_module, self.graph_inputs(compiled.layout, compiled.captured, user_tensors))
        return symbolic.admits(user_tensors)

    def cached_only(self, compiled: CompiledGraph) -> bool:
        """Whether this call compiles only what Inductor's cache holds (``StepLowering.run``): the step's first call
        on a static capture (``DeftConfig.aten_first_call``)."""
        return self.step_count == 0 and compiled.captured.symbolic is None and self.config.aten_first_call

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
        compiled = self.cache.graph(args, kwargs, self.items, self.phases(flush=True), plan, flush=True)
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

    # -- phases ------------------------------------------------------------------------------
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

    # -- running ------------------------------------------------------------------------------
    def graph_inputs(self, layout, captured: CapturedStep, user_tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        params = captured.model_state.params
        state = [self.optimizer.state[params[index]][key] for index, key in layout.state_inputs]
        carry = [self.carry[key] for key in layout.carry_inputs]
        hyperparameters = self._hyperparameter_inputs(layout.hyper_inputs)
        scaler = self.loss_scaler.inputs()[: layout.num_scaler_inputs] if self.loss_scaler is not None else []
        return [*params, *captured.model_state.buffers, *state, *user_tensors[: layout.num_user_inputs], *hyperparameters,
                *scaler, *carry]

    def _hyperparameter_inputs(self, slots: list[tuple[int, str]]) -> list[torch.Tensor]:
        """This call's hyper-parameter inputs: the tensors of the last call while their values are unchanged (the
        graphs only read them), new ones after a scheduler or the user changed a value."""
        key = (tuple(slots), tuple(hyperparameter_value(self.optimizer, slot) for slot in slots))
        if self._hyperparameters is None or self._hyperparameters[0] != key:
            self._hyperparameters = (key, hyperparameter_inputs(self.optimizer, slots))
        return self._hyperparameters[1]

    def run(self, compiled: CompiledGraph, user_tensors: list[torch.Tensor]) -> torch.Tensor | None:
        layout = compiled.layout
        captured = compiled.captured
        params = captured.model_state.params
        inputs = self.graph_inputs(layout, captured, user_tensors)
        self.last_graph = compiled
        for p in params:  # like zero_grad(set_to_none=True): the graph computes fresh gradients
            p.grad = None
        process_group = self.groups.process_group
        try:
            with torch.no_grad():
                outputs = self.lowering.run(compiled.graph_module, inputs, flush=compiled.flush,
                                            cached_only=self.cached_only(compiled))
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


def _looks_like_collective_failure(exc: BaseException) -> bool:
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc).lower()
    return any(word in text for word in ("gloo", "nccl", "connection", "timed out", "timeout", "peer"))


def carried_hyperparameters(carry: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """``carry`` with the learning rates an earlier format carried per param group (``lr:<group>``) as this format's
    hyper-parameter carries (``hp:<index>``, ``optim_support.hyperparameter_slots``): a group's rate where it had
    one, the group's present value for the others (the earlier format had none: they were constants of the graph)."""
    if not any(key.startswith("lr:") for key in carry):
        return carry
    converted = {key: value for key, value in carry.items() if not key.startswith("lr:")}
    slots = hyperparameter_slots(optimizer)
    for index, (value, (group, name)) in enumerate(zip(hyperparameter_inputs(optimizer, slots), slots)):
        converted[hyperparameter_carry_key(index)] = carry.get(f"lr:{group}", value) if name == "lr" else value
    return converted
