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

A next-update item with ``local_first`` (``DeftConfig(delayed_update="local")``)
communicates at the same points but applies, in step t, this step's *local*
gradient plus the correction of the previous one to its average:
a_t = g_t + (ḡ_{t-1} − g_{t-1}); in its first step a_0 = g_0. The sum of what a
rank has applied is Σ_{s<t} ḡ_s + g_t: the synchronous sum with the newest
average replaced by the rank's own gradient. ``g_{t-1}`` is recovered from the
carried tensor (g_{t-1}/W) before its in-place all-reduce; a flush graph applies
nothing for these items (the runtime averages the replicas instead).

Tensors that cross the step boundary ("carries": pending all-reduce outputs or
local gradients) are extra graph outputs and, in the next call, extra graph
inputs, like ``IterGraphModule`` did in ``torch.distributed._spmd``.

A next-forward update is step t's update run in call t+1, so it applies step
t's learning rate (and other hyper-parameter inputs): a call that launches
next-forward items carries its hyper-parameter inputs out (``hp:<index>``),
and the next call or flush rewires the moved updates to read those instead of
its own (an LR scheduler steps between calls, so the call's own inputs hold
step t+1's rate). Next-update
items (DeFT's delayed buckets) are the update of the step that applies them
and read that step's rate. Three
variants of a step graph exist: without carries (the first step: parameters
whose update belongs to the next step are not updated), with carries (steady
state) and ``flush`` (only the pending updates, no forward or backward).

The graph's input/output layout is kept in ``gm.meta["deft_layout"]``
(:class:`GraphLayout`), which this pass updates and the runtime reads.

Memory traffic before a launch is one write of the bucket: the gradient pieces
are copied once into a flat buffer, scaled in place (``mul_``) and all-reduced in
place (``all_reduce_``; the functional ``all_reduce`` would clone its input). For
items applied in this step the flat buffer is persistent, registered on the graph
module (``cat.out``), like DDP's buckets: fresh multi-MB allocations get new pages
from the kernel on every call, which delays the launch by more than the copy
costs. The averaged gradients the update reads (and ``param.grad``) are views of
that buffer until the next call, as with DDP's ``gradient_as_bucket_view``.
Carried items (next-forward, next-update, accumulations) leave the graph, so
they get a fresh buffer per call (still written once, scaled in place).

An item with a 16-bit ``wire_dtype`` crosses the link in that dtype, with the
arithmetic of DDP's ``fp16_compress_hook`` / ``bf16_compress_hook``: the
flat float32 gradient is cast to the wire dtype and divided in place by the
world size there (``buffer.to(dtype).div_(world_size)``, so float16 does not
overflow in the sum), all-reduced in place on the cast buffer, waited for, and
copied back into float32 (into the persistent bucket for items applied in this
step, which the gradients view, as DDP's decompression copies into its
bucket). An accumulated sum of ``count`` gradients is divided by ``count`` in
float32 before the cast. A carried narrowed item carries the 16-bit tensor.

An item with the 8-bit wire (``wire_dtype`` ``torch.int8``) cannot be summed on
the link (8-bit sums overflow), so every rank's bytes are gathered and summed
locally: the flat gradient, divided by ``count * world_size``, is cut per slice
into blocks of ``block`` elements (each slice padded with zeros to whole
blocks, so a block never mixes two parameters); each block is sent as the
integers round(g / s) in [-127, 127] with s = max|g| / 127, followed by the
blocks' float32 scales, in one byte tensor (``all_gather_into_tensor``; each
waits for the group's previous gather first, so one is in flight at a time).
The receiver dequantizes every rank's row, sums them in float32 in rank order (the
same sum on every rank: replicas stay identical) and drops the padding. A
carried 8-bit item carries its byte tensor.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from deft_compile.ir import ops
from deft_compile.ir.layout import GraphLayout
from deft_compile.passes.collectives import (ALL_GATHER, ALL_REDUCE, ALL_REDUCE_, WAIT, flat_view, persistent_buffer,
                                             shaped_view)

aten = torch.ops.aten
_getitem = operator.getitem

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
class DropSpec:
    """DLCP's bounded-loss rule for one item (see ``deft_compile.planner.solvers.dlcp``).

    The item's flat gradient (plus the carried residual) is cut into chunks of
    ``chunk_numel`` elements. Chunks are ordered by ``chunk_rank`` (static:
    input-side layers first), then by their squared norm summed over all ranks
    (larger first). The first ``max(budget, n_bound)`` chunks are all-reduced,
    where ``n_bound`` is the fewest chunks that leave at most ``max_loss`` of
    the total squared norm behind; the rest stays on each rank as the residual.
    """

    chunk_numel: int
    budget: int
    max_loss: float
    chunk_rank: tuple[int, ...]


@dataclass(frozen=True)
class ScheduledItem:
    id: int
    slices: tuple[Slice, ...]
    group_name: str
    world_size: int
    launch: str = LAUNCH_WHEN_READY
    apply: str = APPLY_THIS_STEP
    period: int = 1
    offset: int = 0
    drop: DropSpec | None = None
    local_first: bool = False  # next-update, period 1: apply the local gradient now, correct it next step
    wire_dtype: torch.dtype | None = None  # the narrower dtype it crosses the link in; None: the gradients' own
    block: int = 256  # the 8-bit wire (``torch.int8``): elements per block, one float32 scale each

    @property
    def params(self) -> list[int]:
        return list(dict.fromkeys(s.param for s in self.slices))

    @property
    def carries(self) -> bool:
        return self.apply != APPLY_THIS_STEP


@dataclass(frozen=True)
class ItemPhase:
    """What one item does in one call, decided by the runtime from the step counter.

    Attributes:
        pending_in: the previous call left this item's communication pending
            (next-forward / next-update items): apply it in this call.
        accumulated_in: a local gradient sum from earlier steps of this
            item's period enters (update period K > 1).
        communicate: this step's (accumulated) gradient is communicated; if
            not, it is added to the accumulator and the parameters stay as
            they are, so replicas stay identical.
        count: how many local gradients the communicated sum holds; it is
            divided by ``count * world_size`` to get the mean.
    """

    pending_in: bool = False
    accumulated_in: bool = False
    communicate: bool = True
    count: int = 1


def pending_key(item_id: int) -> str:
    return f"pending:{item_id}"


def accumulator_key(item_id: int) -> str:
    return f"acc:{item_id}"


def stats_key(item_id: int) -> str:
    return f"stats:{item_id}"


def hyperparameter_carry_key(index: int) -> str:
    """The carried value of hyper-parameter input ``index`` (``GraphLayout.hyper_inputs``: a group's learning rate,
    its weight decay, ...) for the updates moved to the next call."""
    return f"hp:{index}"


def item_of_key(key: str) -> int | None:
    """The plan item a carry key belongs to (``pending:3``, ``acc:3``, ``stats:3``); None for other carries."""
    kind, _, rest = key.partition(":")
    return int(rest) if kind in ("pending", "acc", "stats") else None


def apply_schedule(
    gm: fx.GraphModule,
    *,
    items: list[ScheduledItem],
    phases: dict[int, ItemPhase] | None = None,
    flush: bool = False,
) -> fx.GraphModule:
    """Rewrite ``gm`` (a captured step with its markers) to follow ``items`` (see module docstring).

    ``phases`` says per item id what this call does (default: communicate,
    nothing carried in). ``flush`` builds the graph that only applies what is
    carried in (pending communication and partial accumulations), with no
    forward or backward.
    """
    _ScheduleRewriter(gm, items, phases or {}, flush).run()
    gm.graph.lint()
    gm.recompile()
    return gm


class _ScheduleRewriter:
    def __init__(self, gm: fx.GraphModule, items: list[ScheduledItem], phases: dict[int, ItemPhase], flush: bool) -> None:
        self.gm, self.graph = gm, gm.graph
        self.items, self.flush = items, flush
        self._fresh: set[fx.Node] = set()  # tensors the emission made itself (a bucket write, a sum): writable in place
        self.phases = {item.id: phases.get(item.id, ItemPhase()) for item in items}
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
        hyper_start = (self.layout.num_params + self.layout.num_buffers + len(self.layout.state_inputs)
                       + self.layout.num_user_inputs)
        self.hyper_inputs = self.placeholders[hyper_start : hyper_start + self.layout.num_hyper_inputs]
        # each hyper-parameter input's ``.item()`` read, which the optimizer's scalar arithmetic starts from
        self.hyper_reads = {n.args[0]: n for n in nodes
                           if n.op == "call_function" and n.target == aten._local_scalar_dense.default
                           and n.args[0] in self.hyper_inputs}
        self._carried_hyper_params: set[int] = set()  # updates moved here from the previous call: its values
        self._moved: set[fx.Node] = set()
        self.apply_mode: dict[int, str] = {}
        for item in items:
            if item.wire_dtype is not None and item.drop is not None:
                raise ValueError(f"item {item.id}: a chunk-dropping item (DLCP) sends full precision only")
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
    def _local_pieces(self, item: ScheduledItem) -> list[fx.Node]:
        pieces = []
        for s in item.slices:
            flat = flat_view(self.graph, self.markers[s.param].args[0])
            numel = math.prod(self.markers[s.param].meta["val"].shape)
            if s.offset != 0 or s.count != numel:
                flat = self.graph.call_function(aten.slice.Tensor, (flat, 0, s.offset, s.offset + s.count))
            pieces.append(flat)
        return pieces

    def _local_flat(self, item: ScheduledItem, *, bucket: fx.Node | None = None) -> fx.Node:
        """This step's local gradient elements of ``item``, flattened in slice order (unscaled).

        With ``bucket`` (a persistent buffer) they are written into it. Without, a
        single piece is returned as is (a view of the gradient, not owned) and
        several are concatenated into a fresh tensor (owned: see ``_owned``).
        """
        pieces = self._local_pieces(item)
        if bucket is not None:
            return self._made(self.graph.call_function(aten.cat.out, (pieces,), {"out": bucket}))
        return self._made(self.graph.call_function(aten.cat.default, (pieces,))) if len(pieces) > 1 else pieces[0]

    def _made(self, node: fx.Node) -> fx.Node:
        self._fresh.add(node)
        return node

    def _bucket(self, item: ScheduledItem) -> fx.Node:
        """The persistent flat buffer of an item applied in this step (one per item and graph)."""
        marker = self.markers[item.slices[0].param]
        val = marker.meta["val"]
        numel = sum(s.count for s in item.slices)
        return persistent_buffer(self.gm, self.graph, f"_deft_bucket_{item.id}", numel, val.dtype, val.device)

    def _scale_factor(self, item: ScheduledItem) -> float:
        return 1.0 / (self.phases[item.id].count * item.world_size)

    def _scaled(self, flat: fx.Node, item: ScheduledItem, *, owned: bool = False) -> fx.Node:
        """Scale before the sum, as DDP's reducer does: divided by the samples the mean is over.

        ``owned``: ``flat`` is a buffer this graph made for the item (fresh or
        persistent), so it is scaled in place; otherwise the scaling is the copy.
        """
        if owned:
            return self.graph.call_function(aten.mul_.Tensor, (flat, self._scale_factor(item)))
        return self.graph.call_function(aten.mul.Tensor, (flat, self._scale_factor(item)))

    def _to_wire(self, local: fx.Node, item: ScheduledItem, *, owned: bool = False,
                 bucket: bool = False) -> fx.Node:
        """What ``item`` launches: ``local`` (its flat local gradient, or an accumulated sum) scaled for the mean.

        Full precision: scaled by 1/(count * world) (``_scaled``). A 16-bit wire: divided by ``count`` in the
        gradient's dtype when it sums several, cast to the wire dtype and divided there by the world size in
        place, as DDP's compression hooks do (``buffer.to(dtype).div_(world_size)``). ``bucket``: the cast goes
        into a persistent wire buffer (items applied in this step), else into a fresh tensor."""
        if item.wire_dtype is None:
            return self._scaled(local, item, owned=owned)
        if item.wire_dtype is torch.int8:
            return self._quantized(self._scaled(local, item), item)
        count = self.phases[item.id].count
        if count > 1:
            op = aten.mul_.Tensor if owned else aten.mul.Tensor
            local = self._made(self.graph.call_function(op, (local, 1.0 / count)))
        if bucket:
            numel = sum(s.count for s in item.slices)
            device = self.markers[item.slices[0].param].meta["val"].device
            wire = persistent_buffer(self.gm, self.graph, f"_deft_wire_{item.id}", numel, item.wire_dtype, device)
            cast = self.graph.call_function(aten.copy_.default, (wire, local))
        else:
            cast = self.graph.call_function(aten._to_copy.default, (local,), {"dtype": item.wire_dtype})
        return self.graph.call_function(aten.div_.Tensor, (cast, item.world_size))

    def _launch(self, flat: fx.Node, item: ScheduledItem) -> fx.Node:
        """The collective that sends ``flat`` (what ``_to_wire`` made): an in-place sum, or for the 8-bit wire a
        gather of every rank's bytes (``_chain_gathers`` keeps one in flight per group)."""
        if item.wire_dtype is torch.int8:
            return self.graph.call_function(ALL_GATHER, (flat, item.world_size, item.group_name))
        return self.graph.call_function(ALL_REDUCE_, (flat, "sum", item.group_name))

    def _from_wire(self, averaged: fx.Node, item: ScheduledItem, *, bucket: fx.Node | None = None,
                   ranks: int | None = None) -> fx.Node:
        """The waited result of ``item``'s collective in the gradient's dtype: as it is at full precision; a
        16-bit wire's copied back into ``bucket`` (the persistent float32 bucket its gradients view) or cast; the
        8-bit wire's ``ranks`` rows (default: the world; 1 for this rank's own bytes) dequantized and summed."""
        if item.wire_dtype is None:
            return averaged
        if item.wire_dtype is torch.int8:
            averaged = self._dequantized(averaged, item, item.world_size if ranks is None else ranks)
            return averaged if bucket is None else self.graph.call_function(aten.copy_.default, (bucket, averaged))
        if bucket is not None:
            return self.graph.call_function(aten.copy_.default, (bucket, averaged))
        dtype = self.markers[item.slices[0].param].meta["val"].dtype
        return self.graph.call_function(aten._to_copy.default, (averaged,), {"dtype": dtype})

    def _int8_layout(self, item: ScheduledItem) -> tuple[list[int], list[int], int]:
        """(slice counts, the counts padded to whole blocks of ``item.block``, the number of blocks)."""
        counts = [s.count for s in item.slices]
        padded = [-(-count // item.block) * item.block for count in counts]
        return counts, padded, sum(padded) // item.block

    def _quantized(self, flat: fx.Node, item: ScheduledItem) -> fx.Node:
        """``flat`` (float, already divided for the mean) as the 8-bit wire's bytes: each slice padded to whole
        blocks, per block the integers round(g / s) clamped to [-127, 127] with s = max|g| / 127 (1 where the block
        is zero), then the float32 scales, all viewed as ``uint8`` in one tensor."""
        g = self.graph.call_function
        counts, padded, blocks = self._int8_layout(item)
        if counts != padded:
            if len(counts) == 1:
                pieces = [flat]
            else:
                split = g(aten.split_with_sizes.default, (flat, counts))
                pieces = [g(operator.getitem, (split, i)) for i in range(len(counts))]
            flat = g(aten.cat.default, ([g(aten.constant_pad_nd.default, (piece, [0, pad - count], 0.0))
                                         for piece, count, pad in zip(pieces, counts, padded)],))
        rows = g(aten.view.default, (g(aten._to_copy.default, (flat,), {"dtype": torch.float32}), [blocks, item.block]))
        scale = g(aten.div.Tensor, (g(aten.amax.default, (g(aten.abs.default, (rows,)), [1], True)), 127.0))
        safe = g(aten.where.ScalarOther, (g(aten.gt.Scalar, (scale, 0.0)), scale, 1.0))
        ints = g(aten.clamp.default, (g(aten.round.default, (g(aten.div.Tensor, (rows, safe)),)), -127.0, 127.0))
        ints = g(aten._to_copy.default, (ints,), {"dtype": torch.int8})
        as_bytes = [g(aten.view.dtype, (g(aten.view.default, (ints, [-1])), torch.uint8)),
                    g(aten.view.dtype, (g(aten.view.default, (scale, [-1])), torch.uint8))]
        return self._made(g(aten.cat.default, (as_bytes,)))

    def _dequantized(self, gathered: fx.Node, item: ScheduledItem, ranks: int) -> fx.Node:
        """The sum over ``ranks`` rows of the 8-bit wire's bytes (``_quantized``), in the gradients' dtype, without
        the padding."""
        g = self.graph.call_function
        counts, padded, blocks = self._int8_layout(item)
        ints_bytes = blocks * item.block
        table = g(aten.view.default, (gathered, [ranks, ints_bytes + 4 * blocks]))
        ints = g(aten.view.dtype, (g(aten.slice.Tensor, (table, 1, 0, ints_bytes)), torch.int8))
        scales = g(aten.view.dtype, (g(aten.slice.Tensor, (table, 1, ints_bytes, ints_bytes + 4 * blocks)), torch.float32))
        values = g(aten.mul.Tensor, (g(aten.view.default, (g(aten._to_copy.default, (ints,), {"dtype": torch.float32}),
                                                          [ranks, blocks, item.block])),
                                     g(aten.view.default, (scales, [ranks, blocks, 1]))))
        flat = g(aten.view.default, (g(aten.sum.dim_IntList, (values, [0])), [-1]))
        if counts != padded:
            split = g(aten.split_with_sizes.default, (flat, padded))
            pieces = [g(aten.slice.Tensor, (g(operator.getitem, (split, i)), 0, 0, count)) for i, count in enumerate(counts)]
            flat = pieces[0] if len(pieces) == 1 else g(aten.cat.default, (pieces,))
        dtype = self.markers[item.slices[0].param].meta["val"].dtype
        return flat if dtype == torch.float32 else g(aten._to_copy.default, (flat,), {"dtype": dtype})

    def _owned(self, node: fx.Node) -> bool:
        """Whether ``node`` is a fresh tensor only this item's emission made (safe to write in place). A 1-D
        gradient goes into a single-piece item as itself, not a view node: it may come from an ``add`` (a tied
        parameter's two contributions), so ownership is what the emission made, never what an op looks like."""
        return node in self._fresh

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
        return shaped_view(self.graph, flat, shape)

    # -- the rewrite ------------------------------------------------------------
    def run(self) -> None:
        carried = self._add_carry_inputs()
        self._carry_out: dict[str, fx.Node] = {}
        self._pieces: dict[int, list[tuple[int, fx.Node]]] = {}
        self._need_points: dict[int, fx.Node] = {}
        self._move: dict[int, bool] = {}
        self._local_now: dict[int, fx.Node] = {}  # local_first items: this step's local gradient
        if not self.flush:
            self._this_step(carried)
        self._from_previous_calls(carried)
        applied = self._assemble_and_rewire()
        self._read_carried_hyperparameters(carried, applied)
        self._rebuild_output(applied)
        if self.flush:
            self._prune_to_flush()
        self._chain_gathers()

    def _chain_gathers(self) -> None:
        """Before each 8-bit gather, wait for the group's previous one in graph order, so that one gather per group
        is in flight, beside compute and all-reduces: tens of gloo all-gathers in flight at once corrupt the heap
        (``benchmarks/gathers_in_flight.py`` reproduces it without deft)."""
        previous: dict[str, fx.Node] = {}
        for node in list(self.graph.nodes):
            if node.op == "call_function" and node.target is ALL_GATHER:
                group = node.args[2]
                if group in previous:
                    with self.graph.inserting_before(node):
                        self.graph.call_function(WAIT, (previous[group],))
                previous[group] = node

    def _add_carry_inputs(self) -> dict[str, fx.Node]:
        keys = []
        for item in self.items:
            phase = self.phases[item.id]
            if phase.pending_in:
                keys.append(pending_key(item.id))
            if phase.accumulated_in:
                keys.append(accumulator_key(item.id))
        if any(item.apply == APPLY_NEXT_FORWARD and self.phases[item.id].pending_in for item in self.items):
            keys += [hyperparameter_carry_key(i) for i in range(len(self.hyper_inputs))]
        nodes = {}
        with self.graph.inserting_after(self.placeholders[-1]):
            # inserting_after places each new node right after the anchor, so add in reverse.
            for key in reversed(keys):
                nodes[key] = self.graph.placeholder(key.replace(":", "_"))
                if key.startswith("hp:"):
                    nodes[key].meta.update(self.hyper_inputs[int(key.split(":")[1])].meta)
        self.layout.carry_inputs = keys
        return nodes

    def _collect(self, item: ScheduledItem, averaged: fx.Node, point: fx.Node, move: bool) -> None:
        with self.graph.inserting_before(point):
            for param, parts in self._split(item, averaged).items():
                self._pieces.setdefault(param, []).extend(parts)
        for param in item.params:
            # Per parameter, not per item: a parameter cut between items (e.g. across two links) is
            # assembled after all of its items' waits, which all sit before its own first update.
            self._need_points[param] = self._first_forward_use(param) if move else self._first_update([param])
            self._move[param] = move

    def _this_step(self, carried: dict[str, fx.Node]) -> None:
        """This step's gradients: accumulate, launch (in issue order, per group FIFO) or carry out."""
        # Per group: the ready point of the item launched last, and the node after which its emission ends. An
        # item ready earlier than that point is issued right after that emission, so launches keep plan order:
        # inserting it at ``anchor.next`` instead would put it before the previous item's nodes, and a run of
        # items sharing one anchor (ByteScheduler's and US-Byte's priority order: input-side data, ready last,
        # goes first) would be issued in reverse, the input side last.
        last_anchor: dict[str, fx.Node] = {}
        last_emitted: dict[str, fx.Node] = {}
        for item in self.items:
            phase = self.phases[item.id]
            ready = max((self.markers[p].args[0] for p in item.params), key=self.order.__getitem__)
            anchor = ready
            launches = phase.communicate and item.apply != APPLY_NEXT_UPDATE
            if launches and item.group_name in last_anchor and self.order[last_anchor[item.group_name]] >= self.order[ready]:
                anchor = last_anchor[item.group_name]
                insert_at = last_emitted[item.group_name].next
            else:
                insert_at = anchor.next  # fixed now: anchor.next moves as nodes are inserted after the anchor
            persistent = (
                launches and item.apply == APPLY_THIS_STEP and item.drop is None and not phase.accumulated_in
            )
            with self.graph.inserting_before(insert_at):
                bucket = self._bucket(item) if persistent else None
                local = self._local_flat(item, bucket=bucket)
                if phase.accumulated_in:
                    local = self._made(self.graph.call_function(aten.add.Tensor, (carried[accumulator_key(item.id)], local)))
                if item.drop is not None:
                    reduced, restore = self._send_chunks(item, local)
            if item.drop is not None:
                last_anchor[item.group_name], last_emitted[item.group_name] = anchor, insert_at.prev
                point = self._first_update(item.params)
                with self.graph.inserting_before(point):
                    averaged = restore(self.graph.call_function(WAIT, (reduced,)))
                self._collect(item, averaged, point, move=False)
                continue
            with self.graph.inserting_before(insert_at):
                if not phase.communicate:
                    self._carry_out[accumulator_key(item.id)] = local
                    continue
                if item.local_first:  # applied in this step: the carried copy is a scaled copy
                    self._carry_out[pending_key(item.id)] = self._to_wire(local, item)
                    self._local_now[item.id] = local
                    continue
                flat = self._to_wire(local, item, owned=self._owned(local), bucket=persistent)
                if item.apply == APPLY_NEXT_UPDATE:
                    self._carry_out[pending_key(item.id)] = flat
                    continue
                reduced = self._launch(flat, item)
            last_anchor[item.group_name], last_emitted[item.group_name] = anchor, insert_at.prev
            if item.apply == APPLY_NEXT_FORWARD:
                self._carry_out[pending_key(item.id)] = reduced
                self._carry_hyperparameters_out()
                continue
            point = self._first_update(item.params)
            with self.graph.inserting_before(point):
                averaged = self._from_wire(self.graph.call_function(WAIT, (reduced,)), item, bucket=bucket)
            self._collect(item, averaged, point, move=False)

    def _send_chunks(self, item: ScheduledItem, local: fx.Node):
        """DLCP: launch the all-reduce of the chunks that make the cut; keep the rest as the residual.

        Returns the launched collective and a function that, given its waited
        result, emits the full averaged flat gradient (zeros where chunks were
        dropped). The residual and ``[chunks sent, dropped mass fraction]`` go
        out as carries. Sizes depend on the data (how many chunks are sent);
        the graph runs them eagerly, so that is fine at run time.
        """
        g, spec = self.graph, item.drop
        numel = sum(s.count for s in item.slices)
        count = math.ceil(numel / spec.chunk_numel)
        padded = g.call_function(aten.constant_pad_nd.default, (local, [0, count * spec.chunk_numel - numel], 0.0))
        chunks = g.call_function(aten.view.default, (padded, [count, spec.chunk_numel]))
        masses = g.call_function(aten.sum.dim_IntList, (g.call_function(aten.mul.Tensor, (chunks, chunks)), [1]))
        masses = g.call_function(WAIT, (g.call_function(ALL_REDUCE, (masses, "sum", item.group_name)),))
        # Priority: static layer rank first, larger mass first within it (two stable sorts).
        by_mass = g.call_function(_getitem, (g.call_function(aten.sort.stable, (g.call_function(aten.neg.default, (masses,)),), {"stable": True}), 1))
        ranks = g.call_function(torch.tensor, (list(spec.chunk_rank),), {"dtype": torch.int64})
        ranks_by_mass = g.call_function(aten.index.Tensor, (ranks, [by_mass]))
        by_rank = g.call_function(_getitem, (g.call_function(aten.sort.stable, (ranks_by_mass,), {"stable": True}), 1))
        order = g.call_function(aten.index.Tensor, (by_mass, [by_rank]))
        sorted_mass = g.call_function(aten.index.Tensor, (masses, [order]))
        total = g.call_function(aten.sum.default, (masses,))
        tail = g.call_function(aten.flip.default, (g.call_function(aten.cumsum.default, (g.call_function(aten.flip.default, (sorted_mass, [0])), 0)), [0]))
        allowed = g.call_function(aten.mul.Tensor, (total, spec.max_loss))
        n_bound = g.call_function(aten.sum.default, (g.call_function(aten.gt.Tensor, (tail, allowed)),))
        n = g.call_function(aten.clamp_min.default, (n_bound, spec.budget))
        n_sent = g.call_function(aten._local_scalar_dense.default, (n,))
        sent_index = g.call_function(aten.slice.Tensor, (order, 0, 0, n_sent))
        sent = g.call_function(aten.index_select.default, (chunks, 0, sent_index))
        flat_sent = g.call_function(aten.mul.Tensor, (g.call_function(aten.reshape.default, (sent, [-1])), 1.0 / item.world_size))
        reduced = g.call_function(ALL_REDUCE_, (flat_sent, "sum", item.group_name))  # flat_sent is fresh
        residual = g.call_function(aten.index_fill.int_Scalar, (chunks, 0, sent_index, 0.0))
        residual = g.call_function(aten.slice.Tensor, (g.call_function(aten.reshape.default, (residual, [-1])), 0, 0, numel))
        self._carry_out[accumulator_key(item.id)] = residual
        kept = g.call_function(aten.sum.default, (g.call_function(aten.slice.Tensor, (sorted_mass, 0, 0, n_sent)),))
        dropped = g.call_function(aten.div.Tensor, (g.call_function(aten.sub.Tensor, (total, kept)), g.call_function(aten.clamp_min.default, (total, 1e-30))))
        self._carry_out[stats_key(item.id)] = g.call_function(
            aten.stack.default, ([g.call_function(aten._to_copy.default, (n,), {"dtype": torch.float64}), g.call_function(aten._to_copy.default, (dropped,), {"dtype": torch.float64})],)
        )

        def restore(averaged: fx.Node) -> fx.Node:
            rows = g.call_function(aten.view.default, (averaged, [-1, spec.chunk_numel]))
            zeros = g.call_function(aten.zeros_like.default, (chunks,))
            full = g.call_function(aten.index_copy.default, (zeros, 0, sent_index, rows))
            return g.call_function(aten.slice.Tensor, (g.call_function(aten.reshape.default, (full, [-1])), 0, 0, numel))

        return reduced, restore

    def _from_previous_calls(self, carried: dict[str, fx.Node]) -> None:
        """Apply what earlier calls left: pending communication, and in a flush partial accumulations."""
        for item in self.items:
            phase = self.phases[item.id]
            if self.flush and phase.pending_in and phase.accumulated_in:
                raise ValueError(f"item {item.id} has both a pending and an accumulated gradient to flush")
            if item.local_first:
                if not self.flush:
                    self._local_then_corrected(item, carried if phase.pending_in else None)
                continue
            if phase.pending_in:
                pending = carried[pending_key(item.id)]
                if item.apply == APPLY_NEXT_FORWARD:
                    # Launched in the previous call's backward: only the wait is left.
                    point = self.first_compute if self.flush else min(
                        (self._first_forward_use(p) for p in item.params), key=self.order.__getitem__
                    )
                    with self.graph.inserting_before(point):
                        averaged = self._from_wire(self.graph.call_function(WAIT, (pending,)), item)
                    self._collect(item, averaged, point, move=not self.flush)
                    self._carried_hyper_params.update(item.params)
                    continue
                with self.graph.inserting_before(self._carried_launch_point(item)):
                    # The carried local gradient is this item's own tensor (made by the previous call).
                    reduced = self._launch(pending, item)
                point = self._first_update(item.params)
                with self.graph.inserting_before(point):
                    averaged = self._from_wire(self.graph.call_function(WAIT, (reduced,)), item)
                self._collect(item, averaged, point, move=False)
            elif self.flush and phase.accumulated_in:
                with self.graph.inserting_before(self.first_compute):
                    flat = self._to_wire(carried[accumulator_key(item.id)], item)  # the copy that is launched
                    reduced = self._launch(flat, item)
                point = self._first_update(item.params)
                with self.graph.inserting_before(point):
                    averaged = self._from_wire(self.graph.call_function(WAIT, (reduced,)), item)
                self._collect(item, averaged, point, move=False)

    def _carry_hyperparameters_out(self) -> None:
        """This call's hyper-parameter inputs, for the updates its next-forward items leave to the next call."""
        if hyperparameter_carry_key(0) in self._carry_out or not self.hyper_inputs:
            return
        with self.graph.inserting_before(self.first_compute):
            for index, value in enumerate(self.hyper_inputs):
                self._carry_out[hyperparameter_carry_key(index)] = self.graph.call_function(aten.clone.default, (value,))

    def _read_carried_hyperparameters(self, carried: dict[str, fx.Node], applied: dict[int, fx.Node]) -> None:
        """Make the updates moved here from the previous call read that call's hyper-parameters (its step's).
        Their scalar arithmetic is their own (the single-tensor optimizers compute it per parameter); a node that
        reads a value for both a moved update and one of this step's would need both values, and is refused."""
        if not self._carried_hyper_params or not self.hyper_reads:
            return
        moved = {node for p in self._carried_hyper_params for node in self.update_nodes.get(p, [])}
        own = {node for p in applied if p not in self._carried_hyper_params for node in self.update_nodes.get(p, [])}
        reads = set(self.hyper_reads.values())
        shared = [node for node in moved & own if reads & set(node.all_input_nodes)]
        if shared:
            raise ValueError(f"{shared[0]} reads a hyper-parameter for the updates of two different steps")
        replacement = {}
        with self.graph.inserting_before(self.first_compute):
            for index, value in enumerate(self.hyper_inputs):
                read = self.hyper_reads.get(value)
                if read is not None:
                    replacement[read] = self.graph.call_function(read.target, (carried[hyperparameter_carry_key(index)],))
                    replacement[read].meta.update(read.meta)
        for node in moved:
            for read, carried_read in replacement.items():
                if read in node.all_input_nodes:
                    node.replace_input_with(read, carried_read)

    def _carried_launch_point(self, item: ScheduledItem) -> fx.Node:
        """Where a next-update item's carried gradient is launched: the start of the backward (the plan's
        backward window, not in a flush, which has none), else the start of the step."""
        if item.launch == LAUNCH_START_OF_BACKWARD and not self.flush:
            return self.forward_end.next
        return self.first_compute

    def _local_then_corrected(self, item: ScheduledItem, carried: dict[str, fx.Node] | None) -> None:
        """Apply g_t + (ḡ_{t-1} − g_{t-1}) (``local_first``): the previous local gradient is taken from the carry
        before the all-reduce launched at the usual point overwrites it with the average."""
        local = self._local_now[item.id]
        point = self._first_update(item.params)
        if carried is None:  # nothing in flight: the local gradient alone
            self._collect(item, local, point, move=False)
            return
        pending = carried[pending_key(item.id)]
        with self.graph.inserting_before(self._carried_launch_point(item)):
            # the previous local gradient as it was sent (in the gradient's dtype: g_{t-1} rounded to the wire)
            sent = self._from_wire(pending, item, ranks=1)
            previous = self.graph.call_function(aten.mul.Tensor, (sent, float(item.world_size)))
            reduced = self._launch(pending, item)
        with self.graph.inserting_before(point):
            averaged = self._from_wire(self.graph.call_function(WAIT, (reduced,)), item)
            correction = self.graph.call_function(aten.sub.Tensor, (averaged, previous))
            applied = self.graph.call_function(aten.add.Tensor, (local, correction))
        self._collect(item, applied, point, move=False)

    def _assemble_and_rewire(self) -> dict[int, fx.Node]:
        """Build each applied parameter's gradient before its need point and make its update read it."""
        assembled = {}
        for param in sorted(self._pieces, key=lambda p: self.order.get(self._need_points[p], math.inf)):
            point = self._need_points[param]
            with self.graph.inserting_before(point):
                gradient = self._assemble(param, self._pieces[param])
            marker = self.markers[param]
            for node in self.update_nodes.get(param, []):
                node.replace_input_with(marker, gradient)
                # A node shared with an update moved earlier already sits early enough.
                if self._move[param] and node not in self._moved:
                    point.prepend(node)
                    self._moved.add(node)
            assembled[param] = gradient
        return assembled

    def _rebuild_output(self, applied: dict[int, fx.Node]) -> None:
        """Outputs: loss, new state and gradients of the parameters updated in this call, carries.

        Parameters with a gradient that are not updated in this call (their
        communication is pending or accumulating) keep their value and state:
        their update nodes are erased.
        """
        layout = self.layout
        old = list(self.output.args[0])
        state_values = dict(zip(layout.state_outputs, old[1 : 1 + len(layout.state_outputs)]))
        not_applied = {p for p in self.markers if p not in applied and (p in self.apply_mode or self.flush)}
        keep_state = [slot for slot in layout.state_outputs if slot[0] not in not_applied]
        gradient_params = [p for p in layout.gradient_outputs if p in applied]
        carry_keys = list(self._carry_out)
        values = ([] if self.flush else [old[0]]) + [state_values[s] for s in keep_state]
        values += [applied[p] for p in gradient_params] + [self._carry_out[k] for k in carry_keys]
        self.output.args = (tuple(values),)
        layout.state_outputs = keep_state
        layout.gradient_outputs = gradient_params
        layout.carry_outputs = carry_keys
        layout.has_loss = not self.flush
        self._erased: set[fx.Node] = set()
        for param in sorted(not_applied):
            for node in reversed(self.update_nodes.get(param, [])):
                if node.users or node in self._erased:
                    continue  # shared with an update that stays (or already erased)
                self.graph.erase_node(node)
                self._erased.add(node)
        self._not_applied = not_applied

    def _prune_to_flush(self) -> None:
        """Keep only what the carried updates need: their collectives, gradients and in-place updates."""
        keep: set[fx.Node] = set()
        roots = [self.output] + [
            node
            for param, nodes in self.update_nodes.items()
            if param not in self._not_applied
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
        placeholders = [n for n in self.graph.nodes if n.op == "placeholder"]
        for node in placeholders[user_start : user_start + self.layout.num_user_inputs]:
            if node.users:
                raise ValueError("the flush graph still reads a user input")
            self.graph.erase_node(node)
        self.layout.num_user_inputs = 0
