"""Rewrite a captured step graph to follow a communication schedule, across step boundaries.

This is the pass every policy's plan goes through. A schedule is a list of
:class:`ScheduledItem` (one all-reduce each) saying which gradient elements it
carries, on which process group, when it is launched and when the averaged
gradient is applied:

==============  ==================================  =====================================
``apply``       launched                            waited and applied
==============  ==================================  =====================================
this-step       when its gradients are ready        before the first update of its params
                (in issue order)                    in this step (DDP/WFBP, DeFT d=0)
next-forward    when ready, in this step; the       next call, just before the first forward
                pending tensor leaves the graph     use of each of its parameters, which is
                                                    updated there (ByteScheduler, US-Byte)
next-update     next call, at the start of its      next call, before the update of its
                forward or backward (``launch``);   parameters: w_{t+1} = U(w_t, g_{t-1})
                the local gradient leaves the graph (DeFT delayed buckets, d = 1)
==============  ==================================  =====================================

Tensors that cross the step boundary ("carries": pending all-reduce outputs or
local gradients) are extra graph outputs and, in the next call, extra graph
inputs, like ``IterGraphModule`` did in ``torch.distributed._spmd``. Three
variants of a step graph exist: without carries (the first step: parameters
whose update belongs to the next step are not updated), with carries (steady
state) and ``flush`` (only the pending updates, no forward or backward).

The graph's input/output layout is kept in ``gm.meta["deft_layout"]``
(:class:`GraphLayout`), which this pass updates and the runtime reads.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from deft_compile import ops
from deft_compile.layout import GraphLayout
from deft_compile.passes.collectives import ALL_REDUCE, WAIT

aten = torch.ops.aten

APPLY_THIS_STEP = "this-step"
APPLY_NEXT_FORWARD = "next-forward"
APPLY_NEXT_UPDATE = "next-update"
LAUNCH_WHEN_READY = "when-ready"
LAUNCH_START_OF_FORWARD = "start-of-forward"
LAUNCH_START_OF_BACKWARD = "start-of-backward"


@dataclass(frozen=True)
class Slice:
    """Elements ``[offset, offset + count)`` of the flattened gradient of captured parameter ``param``."""

    param: int
    offset: int
    count: int


@dataclass(frozen=True)
class ScheduledItem:
    id: int
    slices: tuple[Slice, ...]
    group_name: str
    world_size: int
    launch: str = LAUNCH_WHEN_READY
    apply: str = APPLY_THIS_STEP

    @property
    def params(self) -> list[int]:
        return list(dict.fromkeys(s.param for s in self.slices))

    @property
    def carries(self) -> bool:
        return self.apply != APPLY_THIS_STEP


def apply_schedule(
    gm: fx.GraphModule, *, items: list[ScheduledItem], carry_in: bool, flush: bool = False
) -> fx.GraphModule:
    """Rewrite ``gm`` (a captured step with its markers) to follow ``items`` (see module docstring).

    ``carry_in``: the previous call left carries, so this graph takes them as
    inputs and applies their updates. ``flush``: build the graph that only
    applies those pending updates (requires ``carry_in``).
    """
    if flush and not carry_in:
        raise ValueError("a flush graph applies carried updates; it needs carry_in=True")
    rewriter = _ScheduleRewriter(gm, items, carry_in, flush)
    rewriter.run()
    gm.graph.lint()
    gm.recompile()
    return gm


class _ScheduleRewriter:
    def __init__(self, gm: fx.GraphModule, items: list[ScheduledItem], carry_in: bool, flush: bool) -> None:
        self.gm, self.graph = gm, gm.graph
        self.items, self.carry_in, self.flush = items, carry_in, flush
        self.layout: GraphLayout = gm.meta["deft_layout"]
        nodes = list(self.graph.nodes)
        self.order = {n: i for i, n in enumerate(nodes)}
        self.placeholders = [n for n in nodes if n.op == "placeholder"]
        self.params = self.placeholders[: self.layout.num_params]
        self.output = next(n for n in reversed(nodes) if n.op == "output")
        self.markers = {n.args[1]: n for n in nodes if n.op == "call_function" and n.target == ops.GRADIENT}
        self.forward_end = next(n for n in nodes if n.op == "call_function" and n.target == ops.PHASE)
        self.update_start = max((self.order[m] for m in self.markers.values()), default=len(nodes))
        self.first_compute = next(n for n in nodes if n.op != "placeholder")
        self.update_nodes = self._update_nodes_by_param()
        self._moved: set[fx.Node] = set()
        self.apply_mode: dict[int, str] = {}
        for item in items:
            for p in item.params:
                if self.apply_mode.setdefault(p, item.apply) != item.apply:
                    raise ValueError(f"parameter {p} is split over items applied at different times")
                if p not in self.markers:
                    raise ValueError(f"item {item.id} carries parameter {p}, which has no gradient in this graph")

    # -- analysis ---------------------------------------------------------------
    def _update_nodes_by_param(self) -> dict[int, list[fx.Node]]:
        state_nodes: dict[int, list[fx.Node]] = {}
        start = self.layout.num_params + self.layout.num_buffers
        for (index, _key), node in zip(self.layout.state_inputs, self.placeholders[start:]):
            state_nodes.setdefault(index, []).append(node)
        result = {}
        for index, marker in self.markers.items():
            roots = [self.params[index], marker, *state_nodes.get(index, [])]
            seen: set[fx.Node] = set()
            frontier = list(roots)
            while frontier:
                node = frontier.pop()
                for user in node.users:
                    if user not in seen and user.op != "output" and self.order[user] > self.update_start:
                        seen.add(user)
                        frontier.append(user)
            # Add what those nodes read inside the update region but that does not descend from the
            # parameter, e.g. Adam's step counter created by ``zeros(())`` in a first-step graph.
            frontier = list(seen)
            while frontier:
                node = frontier.pop()
                for source in node.all_input_nodes:
                    if (
                        source not in seen
                        and source.op == "call_function"
                        and source.target not in ops.MARKERS
                        and self.order[source] > self.update_start
                    ):
                        seen.add(source)
                        frontier.append(source)
            result[index] = sorted(seen, key=self.order.__getitem__)
        return result

    def _first_forward_use(self, param: int) -> fx.Node:
        uses = [u for u in self.params[param].users if self.order.get(u, math.inf) < self.order[self.forward_end]]
        return min(uses, key=self.order.__getitem__) if uses else self.forward_end

    def _first_update(self, params: list[int]) -> fx.Node:
        nodes = [self.update_nodes[p][0] for p in params if self.update_nodes.get(p)]
        return min(nodes, key=self.order.__getitem__) if nodes else self.output

    # -- emission helpers -------------------------------------------------------
    def _local_flat(self, item: ScheduledItem) -> fx.Node:
        pieces = []
        for s in item.slices:
            flat = self.graph.call_function(aten.reshape.default, (self.markers[s.param].args[0], [-1]))
            numel = math.prod(self.markers[s.param].meta["val"].shape)
            if s.offset != 0 or s.count != numel:
                flat = self.graph.call_function(aten.slice.Tensor, (flat, 0, s.offset, s.offset + s.count))
            pieces.append(flat)
        joined = self.graph.call_function(aten.cat.default, (pieces,)) if len(pieces) > 1 else pieces[0]
        return self.graph.call_function(aten.mul.Tensor, (joined, 1.0 / item.world_size))

    def _split(self, item: ScheduledItem, averaged: fx.Node) -> dict[int, list[tuple[int, fx.Node]]]:
        counts = [s.count for s in item.slices]
        if len(counts) == 1:
            parts = [averaged]
        else:
            split = self.graph.call_function(aten.split_with_sizes.default, (averaged, counts))
            parts = [self.graph.call_function(operator.getitem, (split, i)) for i in range(len(counts))]
        by_param: dict[int, list[tuple[int, fx.Node]]] = {}
        for s, part in zip(item.slices, parts):
            by_param.setdefault(s.param, []).append((s.offset, part))
        return by_param

    def _assemble(self, param: int, pieces: list[tuple[int, fx.Node]]) -> fx.Node:
        pieces = sorted(pieces, key=lambda piece: piece[0])
        shape = list(self.markers[param].meta["val"].shape)
        flat = pieces[0][1] if len(pieces) == 1 else self.graph.call_function(aten.cat.default, ([p for _, p in pieces],))
        return self.graph.call_function(aten.view.default, (flat, shape))

    # -- the rewrite ------------------------------------------------------------
    def run(self) -> None:
        carry_inputs = self._add_carry_inputs()
        launched_now = {} if self.flush else self._launch_this_step()
        applied_now = self._apply_this_step(launched_now) if not self.flush else {}
        applied_carried = self._apply_carried(carry_inputs) if self.carry_in else {}
        applied = {**applied_now, **applied_carried}
        self._drop_updates_not_applied(applied)
        self._rebuild_output(applied, launched_now)
        if self.flush:
            self._prune_to_flush()

    def _add_carry_inputs(self) -> dict[int, fx.Node]:
        if not self.carry_in:
            return {}
        carried = [item for item in self.items if item.carries]
        nodes = {}
        with self.graph.inserting_after(self.placeholders[-1]):
            # inserting_after places each new node right after the anchor, so add in reverse.
            for item in reversed(carried):
                nodes[item.id] = self.graph.placeholder(f"carry_{item.id}")
        self.layout.carry_inputs = [item.id for item in carried]
        return nodes

    def _launch_this_step(self) -> dict[int, fx.Node]:
        """Emit this step's flat gradients: launched all-reduces (this-step, next-forward) or local (next-update)."""
        result = {}
        last_anchor: dict[str, fx.Node] = {}
        for item in self.items:
            ready = max((self.markers[p].args[0] for p in item.params), key=self.order.__getitem__)
            anchor = ready
            if item.group_name in last_anchor and self.order[last_anchor[item.group_name]] > self.order[ready]:
                anchor = last_anchor[item.group_name]
            with self.graph.inserting_before(anchor.next):
                flat = self._local_flat(item)
                if item.apply != APPLY_NEXT_UPDATE:
                    flat = self.graph.call_function(ALL_REDUCE, (flat, "sum", item.group_name))
            if item.apply != APPLY_NEXT_UPDATE:
                last_anchor[item.group_name] = anchor
            result[item.id] = flat
        return result

    def _apply_this_step(self, launched: dict[int, fx.Node]) -> dict[int, fx.Node]:
        pieces: dict[int, list[tuple[int, fx.Node]]] = {}
        need_points: dict[int, fx.Node] = {}
        for item in self.items:
            if item.apply != APPLY_THIS_STEP:
                continue
            point = self._first_update(item.params)
            with self.graph.inserting_before(point):
                averaged = self.graph.call_function(WAIT, (launched[item.id],))
                for param, parts in self._split(item, averaged).items():
                    pieces.setdefault(param, []).extend(parts)
            for param in item.params:
                need_points[param] = point
        return self._assemble_and_rewire(pieces, need_points, move=False)

    def _apply_carried(self, carry_inputs: dict[int, fx.Node]) -> dict[int, fx.Node]:
        pieces: dict[int, list[tuple[int, fx.Node]]] = {}
        need_points: dict[int, fx.Node] = {}
        for item in self.items:
            if not item.carries:
                continue
            carried = carry_inputs[item.id]
            if item.apply == APPLY_NEXT_FORWARD:
                point = min((self._first_forward_use(p) for p in item.params), key=self.order.__getitem__)
                if self.flush:
                    point = self.first_compute
                with self.graph.inserting_before(point):
                    averaged = self.graph.call_function(WAIT, (carried,))
            else:
                launch_at = self.forward_end.next if item.launch == LAUNCH_START_OF_BACKWARD else self.first_compute
                if self.flush:
                    launch_at = self.first_compute
                with self.graph.inserting_before(launch_at):
                    pending = self.graph.call_function(ALL_REDUCE, (carried, "sum", item.group_name))
                point = self._first_update(item.params)
                with self.graph.inserting_before(point):
                    averaged = self.graph.call_function(WAIT, (pending,))
            with self.graph.inserting_before(point):
                for param, parts in self._split(item, averaged).items():
                    pieces.setdefault(param, []).extend(parts)
            for param in item.params:
                if item.apply == APPLY_NEXT_FORWARD and not self.flush:
                    need_points[param] = self._first_forward_use(param)
                else:
                    need_points[param] = point
        moved = {p: self.apply_mode[p] == APPLY_NEXT_FORWARD and not self.flush for p in pieces}
        return self._assemble_and_rewire(pieces, need_points, move=moved)

    def _assemble_and_rewire(self, pieces, need_points, move) -> dict[int, fx.Node]:
        """Build each parameter's gradient before its need point and make its update read it."""
        assembled = {}
        for param in sorted(pieces, key=lambda p: self.order.get(need_points[p], math.inf)):
            point = need_points[param]
            with self.graph.inserting_before(point):
                gradient = self._assemble(param, pieces[param])
            marker = self.markers[param]
            for node in self.update_nodes.get(param, []):
                node.replace_input_with(marker, gradient)
                # A node shared with an update moved earlier already sits early enough.
                if (move if isinstance(move, bool) else move[param]) and node not in self._moved:
                    point.prepend(node)
                    self._moved.add(node)
            assembled[param] = gradient
        return assembled

    def _drop_updates_not_applied(self, applied: dict[int, fx.Node]) -> None:
        """The first step leaves the update of next-forward/next-update parameters to the next call."""
        self._not_applied = [p for p in self.markers if p not in applied and p in self.apply_mode]

    def _rebuild_output(self, applied: dict[int, fx.Node], launched: dict[int, fx.Node]) -> None:
        layout = self.layout
        old = list(self.output.args[0])
        loss = old[0]
        state_values = dict(zip(layout.state_outputs, old[1 : 1 + len(layout.state_outputs)]))
        dropped = set(self._not_applied)
        if self.flush:
            dropped |= {p for p in self.markers if p not in applied}
        keep_state = [slot for slot in layout.state_outputs if slot[0] not in dropped]
        gradient_params = [p for p in layout.gradient_outputs if p in applied]
        gradients = [applied[p] for p in gradient_params]
        carry_items = [item for item in self.items if item.carries and not self.flush]
        values = ([] if self.flush else [loss]) + [state_values[s] for s in keep_state] + gradients
        values += [launched[item.id] for item in carry_items]
        self.output.args = (tuple(values),)
        layout.state_outputs = keep_state
        layout.gradient_outputs = gradient_params
        layout.carry_outputs = [item.id for item in carry_items]
        layout.has_loss = not self.flush
        self._erased: set[fx.Node] = set()
        for param in sorted(dropped):
            for node in reversed(self.update_nodes.get(param, [])):
                if node.users or node in self._erased:
                    continue  # shared with an update that stays (or already erased)
                self.graph.erase_node(node)
                self._erased.add(node)

    def _prune_to_flush(self) -> None:
        """Keep only what the pending updates need: their waits, gradients and in-place updates."""
        keep: set[fx.Node] = set()
        roots = [self.output] + [
            node
            for param, nodes in self.update_nodes.items()
            if self.apply_mode.get(param, APPLY_THIS_STEP) != APPLY_THIS_STEP
            for node in nodes
            if node not in self._erased
        ]
        frontier = list(roots)
        while frontier:
            node = frontier.pop()
            if node in keep:
                continue
            keep.add(node)
            frontier.extend(node.all_input_nodes)
        for node in reversed(list(self.graph.nodes)):
            if node.op == "call_function" and node not in keep:
                self.graph.erase_node(node)
        user_start = self.layout.num_params + self.layout.num_buffers + len(self.layout.state_inputs)
        user_placeholders = [n for n in self.graph.nodes if n.op == "placeholder"][user_start : user_start + self.layout.num_user_inputs]
        for node in user_placeholders:
            if node.users:
                raise ValueError("the flush graph still reads a user input")
            self.graph.erase_node(node)
        self.layout.num_user_inputs = 0

