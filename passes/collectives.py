"""Helpers that emit ``_c10d_functional`` collective nodes into a graph.

The passes use these so every collective in a step graph has the same shape:
flatten the tensors into one buffer, launch the asynchronous collective, and
later wait and split the result back into tensors of the original shapes.
"""

from __future__ import annotations

import math
import operator
from typing import Sequence

import torch
import torch.fx as fx

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

ALL_REDUCE = c10d.all_reduce.default
BROADCAST = c10d.broadcast.default
WAIT = c10d.wait_tensor.default
COLLECTIVES = (ALL_REDUCE, BROADCAST)


def shape_of(node: fx.Node) -> torch.Size:
    return node.meta["val"].shape


def numel_of(node: fx.Node) -> int:
    return math.prod(shape_of(node))


def emit_flatten(graph: fx.Graph, tensors: Sequence[fx.Node]) -> fx.Node:
    """One flat buffer holding ``tensors`` back to back (a copy, like DDP's bucket)."""
    flat = [graph.call_function(aten.reshape.default, (t, [-1])) for t in tensors]
    if len(flat) == 1:
        return graph.call_function(aten.clone.default, (flat[0],))
    return graph.call_function(aten.cat.default, (flat,))


def emit_unflatten(graph: fx.Graph, flat: fx.Node, like: Sequence[fx.Node]) -> list[fx.Node]:
    """Views of ``flat`` with the shapes of ``like``, in order."""
    sizes = [numel_of(t) for t in like]
    if len(like) == 1:
        pieces = [flat]
    else:
        split = graph.call_function(aten.split_with_sizes.default, (flat, sizes))
        pieces = [graph.call_function(operator.getitem, (split, i)) for i in range(len(like))]
    return [graph.call_function(aten.view.default, (piece, list(shape_of(t)))) for piece, t in zip(pieces, like)]

