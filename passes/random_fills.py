"""Draw each Bernoulli mask into a tensor of its own, before Inductor (Inductor only).

Why: on CPU, ``F.dropout`` traces to ``mask = empty_like(x).bernoulli_(1 - p); mask.div_(1 - p)``. Inductor
(``fallback_random=True``, as the step lowers) functionalises the ``bernoulli_`` and lowers it to an in-place
``aten.bernoulli_`` call (``InplaceBernoulliFallback``) on a buffer; the kernels that read the mask depend on that
call only through a renamed read of the buffer. Inductor's C++ backend loses the rename when it fuses a reader
with a node of compatible but different loop ranges: ``SchedulerNode.recompute_size_and_body`` recomputes the
node's reads from its loop body and re-applies the mutation renames only if the node also has a weak or star
dependency. The reader then depends on the buffer's allocation, not on the draw, and the scheduler can run it
before ``bernoulli_``: in BERT's embeddings (LayerNorm, then dropout, with the mask kept for the backward) the
fused LayerNorm kernel read the uninitialised mask and the loss was NaN from the first step (torch 2.13).

This pass rewrites ``bernoulli_(empty_like(x, ...), p)``, where the ``empty_like`` has no other reader, into one
out-of-place op, ``deft.bernoulli_like(x, p, dtype=..., memory_format=...)``, which runs exactly those two ATen
calls (so it draws the same numbers from the same generator, in the same order as eager) and returns a fresh
tensor. Inductor runs it as an opaque kernel with an output buffer of its own: no mutation, no rename to lose.
The op is tagged ``nondeterministic_seeded`` (never deduplicated or recomputed as a pure op). ``bernoulli_``
with an explicit generator, on a tensor that is not a fresh ``empty_like``, or with a tensor of probabilities
is left as it is.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.fx as fx

aten = torch.ops.aten
_EMPTY_LIKE = aten.empty_like.default
_BERNOULLI_ = aten.bernoulli_.float


@torch.library.custom_op(
    "deft::bernoulli_like",
    mutates_args=(),
    schema="(Tensor x, float p, *, ScalarType? dtype=None, MemoryFormat? memory_format=None) -> Tensor",
    tags=(torch.Tag.nondeterministic_seeded,),
)
def bernoulli_like(x: torch.Tensor, p: float, *, dtype: Optional[torch.dtype] = None,
                   memory_format: Optional[torch.memory_format] = None) -> torch.Tensor:
    """``torch.empty_like(x, dtype=dtype, memory_format=memory_format).bernoulli_(p)``."""
    return torch.empty_like(x, dtype=dtype, memory_format=memory_format).bernoulli_(p)


@bernoulli_like.register_fake
def _bernoulli_like_fake(x: torch.Tensor, p: float, *, dtype: Optional[torch.dtype] = None,
                         memory_format: Optional[torch.memory_format] = None) -> torch.Tensor:
    return torch.empty_like(x, dtype=dtype, memory_format=memory_format)


BERNOULLI_LIKE = torch.ops.deft.bernoulli_like.default


def draw_bernoulli_out_of_place(gm: fx.GraphModule) -> fx.GraphModule:
    """Replace each ``bernoulli_(empty_like(x, ...), p)`` whose ``empty_like`` only it reads by
    ``deft.bernoulli_like(x, p, ...)``."""
    graph = gm.graph
    changed = False
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not _BERNOULLI_ or node.kwargs.get("generator") is not None:
            continue
        fresh = node.args[0]
        kwargs = _empty_like_kwargs(fresh)
        if kwargs is None or len(fresh.users) != 1:
            continue
        p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
        if not isinstance(p, (int, float)):
            continue
        with graph.inserting_before(node):
            drawn = graph.call_function(BERNOULLI_LIKE, (fresh.args[0], float(p)), kwargs)
        drawn.meta.update(node.meta)
        node.replace_all_uses_with(drawn)
        graph.erase_node(node)
        graph.erase_node(fresh)
        changed = True
    if changed:
        graph.lint()
        gm.recompile()
    return gm


def _empty_like_kwargs(node: object) -> dict | None:
    """The ``dtype``/``memory_format`` of an ``aten.empty_like`` node that allocates an ordinary tensor on its
    input's device, or None when ``node`` is anything else."""
    if not isinstance(node, fx.Node) or node.op != "call_function" or node.target is not _EMPTY_LIKE:
        return None
    source = node.args[0]
    source_val = source.meta.get("val") if isinstance(source, fx.Node) else None
    if not isinstance(source_val, torch.Tensor) or len(node.args) > 1:
        return None
    extra = dict(node.kwargs)
    kwargs = {key: extra.pop(key) for key in ("dtype", "memory_format") if extra.get(key) is not None}
    if extra.pop("layout", None) not in (None, torch.strided) or extra.pop("pin_memory", None):
        return None
    device = extra.pop("device", None)
    if device is not None and torch.device(device) != source_val.device:
        return None
    return kwargs if not extra else None
