"""Give a concatenation of one tensor the layout ATen gives it, before Inductor (Inductor only).

Why: the capture traces composite ops (``matmul``'s ``reshape``, inside attention) down to ``view`` or
``clone`` + ``_unsafe_view`` by the strides ATen's meta functions report at capture time. ATen's ``cat``
returns a tensor in its inputs' memory format (contiguous unless they are all channels-last); the capture
records that layout and every ``view`` after it relies on it. Inductor's decomposition of ``aten.cat`` drops
the inputs with no elements (a legacy 1-D ``(0,)`` tensor, or size 0 along ``dim``) and, when one input is
left, returns ``input.clone()``: that keeps the *input's* strides. A ``transformers`` KV cache starts as
``torch.tensor([])`` and its first ``update`` is ``cat([empty, key.transpose(1, 2)], -2)``; under Inductor the
result keeps the transposed layout, and the ``view`` the capture recorded behind it (``key.transpose(-1, -2)``
expanded and viewed to ``(batch * heads, dim, seq)``) fails with "Cannot view a tensor with shape ... and
strides ...".

This pass rewrites each ``aten.cat`` that Inductor's decomposition would reduce to its one non-empty input into
the copy ATen makes: ``aten.clone(x, memory_format=<the cat's layout>)`` (``aten._to_copy`` with the cat's dtype
when the inputs promote to another dtype). The values are the same copy; only Inductor's layout changes, to the
one the capture recorded. A cat whose recorded layout is no memory format (it never is, for ATen's ``cat``) is
left as it is.
"""

from __future__ import annotations

import torch
import torch.fx as fx

aten = torch.ops.aten
_CAT = aten.cat.default


def pin_cat_layouts(gm: fx.GraphModule) -> fx.GraphModule:
    """Replace every ``aten.cat`` with one input that has elements by a copy in the cat's recorded layout."""
    graph = gm.graph
    changed = False
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not _CAT:
            continue
        val = node.meta.get("val")
        tensors = node.args[0] if node.args else node.kwargs.get("tensors")
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        if not isinstance(val, torch.Tensor) or not isinstance(tensors, (list, tuple)):
            continue
        kept = [t for t in tensors if not _dropped_by_inductor(t, dim)]
        if len(kept) != 1 or not isinstance(kept[0], fx.Node):
            continue
        fmt = memory_format_of(val)
        if fmt is None:
            continue
        source = kept[0]
        source_val = source.meta.get("val")
        with graph.inserting_before(node):
            if isinstance(source_val, torch.Tensor) and source_val.dtype == val.dtype:
                copy = graph.call_function(aten.clone.default, (source,), {"memory_format": fmt})
            else:
                copy = graph.call_function(aten._to_copy.default, (source,), {"dtype": val.dtype, "memory_format": fmt})
        copy.meta.update(node.meta)
        node.replace_all_uses_with(copy)
        graph.erase_node(node)
        changed = True
    if changed:
        graph.lint()
        gm.recompile()
    return gm


def _dropped_by_inductor(tensor: object, dim: int) -> bool:
    """Whether Inductor's ``cat`` decomposition leaves ``tensor`` out: a 1-D tensor of size 0, or one of size 0
    along ``dim``. An argument without recorded metadata counts as kept."""
    val = tensor.meta.get("val") if isinstance(tensor, fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return False
    if val.dim() == 1 and val.shape[0] == 0:
        return True
    return -val.dim() <= dim < val.dim() and val.shape[dim] == 0


def memory_format_of(val: torch.Tensor) -> torch.memory_format | None:
    """The memory format whose strides ``val`` has (contiguous first), or None if it has none of them."""
    if val.is_contiguous():
        return torch.contiguous_format
    if val.dim() == 4 and val.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    if val.dim() == 5 and val.is_contiguous(memory_format=torch.channels_last_3d):
        return torch.channels_last_3d
    return None
