"""Gradient bucketing with asynchronous all-reduce: the ``wfbp`` (PyTorch DDP) schedule.

For each bucket, right after the node that produces its last gradient in
backward, the pass flattens the bucket's gradients, scales them by 1/world_size
and launches ``_c10d_functional.all_reduce(sum)``; backward keeps running while
the collective is in flight. The wait goes just before the first optimizer node
that reads one of the bucket's gradients, and the optimizer then reads views of
the averaged buffer instead of the local gradients.

Scaling before the sum is what DDP's reducer does (``mul_out`` into the bucket
view, then an all-reduce sum); it makes the result bit-identical to DDP for any
world size, not only for powers of two.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from deft_compile import ops
from deft_compile.passes.collectives import ALL_REDUCE, WAIT, emit_flatten, emit_unflatten

aten = torch.ops.aten


def gradient_markers(graph: fx.Graph) -> dict[int, fx.Node]:
    """``deft.gradient`` nodes by parameter index."""
    return {n.args[1]: n for n in graph.nodes if n.op == "call_function" and n.target == ops.GRADIENT}


def insert_bucket_allreduce(
    gm: fx.GraphModule, *, buckets: list[list[int]], group_name: str, world_size: int
) -> fx.GraphModule:
    """Average the gradients of every bucket across ranks (see module docstring).

    Args:
        buckets: parameter indices per bucket, in launch order.
        group_name: name of the process group (``ProcessGroup.group_name``).
        world_size: size of that group.
    """
    graph = gm.graph
    order = {node: position for position, node in enumerate(graph.nodes)}
    markers = gradient_markers(graph)
    for bucket in buckets:
        bucket_markers = [markers[index] for index in bucket]
        gradients = [m.args[0] for m in bucket_markers]
        last_ready = max(gradients, key=order.__getitem__)
        with graph.inserting_before(last_ready.next):
            flat = emit_flatten(graph, gradients)
            scaled = graph.call_function(aten.mul.Tensor, (flat, 1.0 / world_size))
            reduced = graph.call_function(ALL_REDUCE, (scaled, "sum", group_name))
        readers = [user for m in bucket_markers for user in m.users]
        if not readers:
            continue
        first_reader = min(readers, key=order.__getitem__)
        with graph.inserting_before(first_reader):
            averaged = graph.call_function(WAIT, (reduced,))
            pieces = emit_unflatten(graph, averaged, gradients)
        for marker, piece in zip(bucket_markers, pieces):
            marker.replace_all_uses_with(piece)
            graph.erase_node(marker)
    graph.lint()
    gm.recompile()
    return gm
