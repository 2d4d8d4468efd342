"""Turn a captured step into the graph that runs: the ordered pass list.

As in torchtitan's graph trainer, the compiled step is an ordered list of named
passes, each a plain ``GraphModule -> GraphModule`` function (context bound with
``functools.partial``). ``run_passes`` applies them in order and hands every
intermediate graph to the dumper. What differs between policies is the list of
``ScheduledItem``s the ``schedule`` pass executes (see ``deft_compile.step.scheduling``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch.fx as fx

from deft_compile.step.annotate import StepAnnotation, annotate
from deft_compile.step.capture import CapturedStep
from deft_compile.config import DeftConfig
from deft_compile.debug.dump import GraphDumper
from deft_compile.ir.layout import GraphLayout, layout_of
from deft_compile.passes.broadcast_buffers import insert_buffer_broadcast
from deft_compile.passes.cleanup import remove_detach, remove_profiler_ops
from deft_compile.passes.compensation import Compensation, compensate_delayed
from deft_compile.passes.gradient_guards import GuardOptions, guard_gradients
from deft_compile.passes.local_collectives import elide_local_collectives
from deft_compile.passes.markers import strip_markers
from deft_compile.passes.optimizer_numerics import promote_bias_corrections
from deft_compile.passes.schedule import ItemPhase, ScheduledItem, apply_schedule
from deft_compile.step.regions import tag_regions

Pass = Callable[[fx.GraphModule], fx.GraphModule]


@dataclass(frozen=True)
class CommGroup:
    """A process group a step communicates over, by name (what functional collectives take)."""

    name: str
    rank: int
    world_size: int


@dataclass
class CompiledGraph:
    """A rewritten step graph plus what the runtime needs to call it."""

    captured: CapturedStep
    graph_module: fx.GraphModule
    items: list[ScheduledItem]
    phases: dict[int, ItemPhase]
    flush: bool

    @property
    def layout(self) -> GraphLayout:
        return layout_of(self.graph_module)

    def collective_signature(self) -> list[tuple]:
        """Per item, its group size and the element counts it carries: what ranks must agree on.

        Group sizes, not names: under DS-Sync ranks in different groups run the
        same items on different groups of the same size.
        """
        return [(item.world_size, tuple(s.count for s in item.slices), item.apply, item.period) for item in self.items]


def annotate_capture(captured: CapturedStep) -> StepAnnotation:
    states_by_param: dict[int, list[fx.Node]] = {}
    for (index, _key), node in zip(captured.state_inputs, captured.state_placeholders()):
        states_by_param.setdefault(index, []).append(node)
    return annotate(captured.graph_module.graph, captured.param_placeholders(), states_by_param)


def build_passes(
    captured: CapturedStep,
    items: list[ScheduledItem],
    group: CommGroup | None,
    config: DeftConfig,
    *,
    phases: dict[int, ItemPhase] | None = None,
    flush: bool = False,
    guards: GuardOptions | None = None,
    buffer_group: CommGroup | None = None,
    compensation: Compensation | None = None,
) -> list[tuple[str, Pass]]:
    """The ordered passes; no collectives when ``group`` is None or has one rank (one process).

    ``buffer_group``: the group the buffer broadcast runs on (``open_buffer_group``); ``group`` when None.

    ``items`` on a one-process group (``LOCAL_GROUP``, or a one-rank group such as DS-Sync's
    solo groups) with an update period (gradient accumulation) still go through ``schedule``,
    which accumulates gradients across calls, and then lose their collectives.
    ``guards`` (clipping, loss scaling's skip) act on the gradients each update applies.
    ``compensation``: the delayed parameters' compensated updates and predicted weights
    (``DeftConfig(delayed_update="compensated")``).
    """
    passes: list[tuple[str, Pass]] = [
        ("remove_profiler_ops", remove_profiler_ops),
        ("remove_detach", remove_detach),
        ("promote_bias_corrections", promote_bias_corrections),
        # before the plan's passes: regions are the capture's, whatever the plan (deft_compile.step.regions)
        ("tag_regions", functools.partial(tag_regions, param_names=captured.model_state.param_names)),
    ]
    if compensation is not None and compensation.params:
        # after the regions are fixed (the Nesterov node joins its update's region, the prediction is glue) and
        # before the schedule, which rewires the updates' gradients with these nodes in place
        passes.append(("compensate_delayed", functools.partial(compensate_delayed, compensation=compensation)))
    if group is not None and group.world_size > 1:
        passes.append(("schedule", functools.partial(apply_schedule, items=items, phases=phases, flush=flush)))
        # After the schedule, so the broadcast goes before everything the schedule put at the start of the step:
        # a backend runs a group's collectives in order, and on a shared group a delayed bucket's all-reduce
        # launched there first would hold the broadcast (waited at once, before the forward) until the whole
        # bucket is through. All-reduces carried over from the previous step (ByteScheduler, US-Byte) are
        # already queued when the step starts: only a group of its own keeps the broadcast out of their queue.
        if config.broadcast_buffers and captured.num_buffers and not flush:
            positions = list(range(captured.num_params, captured.num_params + captured.num_buffers))
            name = (buffer_group or group).name
            passes.append(
                ("broadcast_buffers", functools.partial(insert_buffer_broadcast, buffer_positions=positions, group_name=name))
            )
    elif any(item.period > 1 for item in items):  # one process, accumulating: sum across calls, no collectives
        local = frozenset(item.group_name for item in items if item.world_size == 1)
        passes.append(("schedule", functools.partial(apply_schedule, items=items, phases=phases, flush=flush)))
        passes.append(("elide_local_collectives", functools.partial(elide_local_collectives, group_names=local)))
    passes.append(("strip_markers", strip_markers))
    if guards is not None and guards.active:
        passes.append(("gradient_guards", functools.partial(guard_gradients, options=guards)))
    return passes


def run_passes(gm: fx.GraphModule, passes: list[tuple[str, Pass]], dumper: GraphDumper) -> fx.GraphModule:
    dumper.record("captured", gm)
    for name, graph_pass in passes:
        gm = graph_pass(gm)
        dumper.record(name, gm)
    return gm


def compile_captured(
    captured: CapturedStep,
    items: list[ScheduledItem],
    group: CommGroup | None,
    config: DeftConfig,
    dumper: GraphDumper,
    *,
    phases: dict[int, ItemPhase] | None = None,
    flush: bool = False,
    guards: GuardOptions | None = None,
    buffer_group: CommGroup | None = None,
    compensation: Compensation | None = None,
) -> CompiledGraph:
    passes = build_passes(captured, items, group, config, phases=phases, flush=flush, guards=guards,
                          buffer_group=buffer_group, compensation=compensation)
    gm = run_passes(captured.graph_module, passes, dumper)
    return CompiledGraph(captured=captured, graph_module=gm, items=items, phases=dict(phases or {}), flush=flush)
