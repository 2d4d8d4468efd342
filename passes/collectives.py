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
ALL_REDUCE_ = c10d.all_reduce_.default  # in place: no copy of its input (``all_reduce`` clones it)
BROADCAST = c10d.broadcast.default
BROADCAST_ = c10d.broadcast_.default
WAIT = c10d.wait_tensor.default
ALL_GATHER = c10d.all_gather_into_tensor.default  # the 8-bit wire: every rank's bytes, summed locally
COLLECTIVES = (ALL_REDUCE, ALL_REDUCE_, BROADCAST, BROADCAST_, ALL_GATHER)


def shape_of(node: fx.Node) -> torch.Size:
    return node.meta["val"].shape


def numel_of(node: fx.Node) -> int:
    return math.prod(shape_of(node))


def emit_flatten(graph: fx.Graph, tensors: Sequence[fx.Node], out: fx.Node | None = None) -> fx.Node:
    """One flat buffer holding ``tensors`` back to back (one copy, like DDP's bucket).

    With ``out`` (a node holding a persistent flat buffer, e.g. a ``get_attr``) the
    tensors are written into it (``cat.out``): no fresh allocation per step. Large
    fresh allocations get new pages from the kernel on every call, which costs more
    than the copy itself; in-place collectives (``all_reduce_``, ``broadcast_``) on
    the result then avoid the functional collectives' own clone.
    """
    flat = [flat_view(graph, t) for t in tensors]
    if out is not None:
        return graph.call_function(aten.cat.out, (flat,), {"out": out})
    if len(flat) == 1:
        return graph.call_function(aten.clone.default, (flat[0],))
    return graph.call_function(aten.cat.default, (flat,))


def flat_view(graph: fx.Graph, tensor: fx.Node) -> fx.Node:
    """``tensor`` as a 1-D tensor: a ``reshape`` node, or the tensor itself when it is 1-D already.

    Models with many small tensors (a BatchNorm's weight, bias and running statistics, a LayerNorm,
    every bias) would otherwise pay one op dispatch from Python per tensor per step for a no-op: on
    ResNet-50 the buckets and the buffer broadcast had 426 such nodes (reshape in, view out).
    """
    value = tensor.meta.get("val")
    if isinstance(value, torch.Tensor) and value.dim() == 1:
        return tensor
    return graph.call_function(aten.reshape.default, (tensor, [-1]))


def shaped_view(graph: fx.Graph, flat: fx.Node, shape: Sequence[int]) -> fx.Node:
    """The 1-D ``flat`` viewed with ``shape``; no node when ``shape`` is 1-D (``flat`` has it already)."""
    if len(shape) == 1:
        return flat
    return graph.call_function(aten.view.default, (flat, list(shape)))


def persistent_buffer(
    gm: fx.GraphModule, graph: fx.Graph, name: str, numel: int, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> fx.Node:
    """A ``get_attr`` node reading a flat buffer registered on ``gm`` (not saved in its state dict).

    The buffer lives as long as the graph module: a bucket the step writes into on
    every call, like DDP's reducer buckets. It starts as zeros, so no step can read
    memory that nothing wrote.
    """
    gm.register_buffer(name, torch.zeros(numel, dtype=dtype, device=device), persistent=False)
    return graph.get_attr(name)


def emit_unflatten(graph: fx.Graph, flat: fx.Node, like: Sequence[fx.Node]) -> list[fx.Node]:
    """Views of ``flat`` with the shapes of ``like``, in order."""
    sizes = [numel_of(t) for t in like]
    if len(like) == 1:
        pieces = [flat]
    else:
        split = graph.call_function(aten.split_with_sizes.default, (flat, sizes))
        pieces = [graph.call_function(operator.getitem, (split, i)) for i in range(len(like))]
    return [shaped_view(graph, piece, shape_of(t)) for piece, t in zip(pieces, like)]

