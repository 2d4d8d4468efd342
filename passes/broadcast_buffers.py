"""Broadcast rank 0's buffers at the start of every step, as DDP does by default.

BatchNorm running statistics are updated locally in forward from each rank's own
batch; DDP overwrites every rank's buffers with rank 0's before each forward
(``broadcast_buffers=True``). The pass does the same inside the graph: one
coalesced broadcast per dtype, then one ``_foreach_copy_`` into the live buffers,
before any node reads them.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.fx as fx

from deft_compile.passes.collectives import BROADCAST_, WAIT, emit_flatten, emit_unflatten, persistent_buffer

aten = torch.ops.aten


def insert_buffer_broadcast(
    gm: fx.GraphModule, *, buffer_positions: list[int], group_name: str, src: int = 0
) -> fx.GraphModule:
    """Broadcast the graph inputs at ``buffer_positions`` (placeholder indices) from ``src``."""
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    buffers = [placeholders[i] for i in buffer_positions if placeholders[i].meta["val"].numel() > 0]
    if not buffers:
        return gm
    by_dtype: dict[torch.dtype, list[fx.Node]] = defaultdict(list)
    for buffer in buffers:
        by_dtype[buffer.meta["val"].dtype].append(buffer)
    first_compute = next(n for n in graph.nodes if n.op != "placeholder")
    with graph.inserting_before(first_compute):
        for number, (dtype, group) in enumerate(by_dtype.items()):
            # Written into a flat buffer the graph module keeps, broadcast in place: no per-step allocation.
            numel = sum(buffer.meta["val"].numel() for buffer in group)
            device = group[0].meta["val"].device
            out = persistent_buffer(gm, graph, f"_deft_broadcast_{number}", numel, dtype, device)
            flat = emit_flatten(graph, group, out=out)
            received = graph.call_function(WAIT, (graph.call_function(BROADCAST_, (flat, src, group_name)),))
            # one foreach copy, not one copy_ per buffer: ResNet-50 has 160 floating-point BatchNorm buffers and
            # the aten path dispatches every node from Python
            graph.call_function(aten._foreach_copy_.default, (list(group), emit_unflatten(graph, received, group)))
    graph.lint()
    gm.recompile()
    return gm
