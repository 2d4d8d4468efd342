"""Give Inductor the functional forms of the in-place bucket ops the ``schedule`` pass emits.

On the aten route a bucket is written once into a kept buffer (``cat.out``), scaled in place
(``mul_``) and sent in place (``_c10d_functional.all_reduce_``, ``broadcast_``): no fresh
multi-MB allocation per step (see ``passes/schedule.py``). AOTAutograd's functionalization,
which Inductor runs first, refuses custom in-place ops whose output aliases an input
(``all_reduce_``), and a kept buffer would only add copies there. Inductor plans its own
buffers and lowers the functional collectives in place where it can, so before lowering
this pass rewrites those ops on intermediate tensors into their functional forms, and every
later reader of the mutated tensor reads the new value instead. Only ops whose mutated
tensor is an intermediate, a kept buffer (``get_attr``) or a carried input are rewritten.

A narrowed bucket (a 16-bit wire, ``passes/schedule.py``) is cast into a kept wire buffer
(``copy_``), divided there (``div_``) and copied back into its kept float32 bucket (``copy_``):
those two ops are rewritten only where they write a kept buffer, since a ``copy_`` or ``div_`` the
capture holds may write a view (a slice assignment), whose base a functional form would not update.

Graph inputs stay mutated in place (parameter, buffer and optimizer-state updates), except the
carries (``GraphLayout.carry_inputs``): a delayed bucket's local gradient that the previous call
handed over and this call all-reduces at the start of its forward. Nothing reads a carry input
after the call (the call's carry outputs replace it), so its in-place all-reduce can become a
functional one. Without this, every delayed (d = 1) plan fell back to aten.
"""

from __future__ import annotations

import torch
import torch.fx as fx

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

# in-place / out= op -> (functional op, how to build its arguments from the node's args and kwargs)
_FUNCTIONAL = {
    c10d.all_reduce_.default: c10d.all_reduce.default,
    c10d.broadcast_.default: c10d.broadcast.default,
    aten.mul_.Tensor: aten.mul.Tensor,
    aten.mul_.Scalar: aten.mul.Scalar,
}
# rewritten only where the tensor they write is a kept buffer (``get_attr``): a narrowed bucket's cast and copy back
_KEPT_ONLY = {
    aten.copy_.default: aten.copy.default,
    aten.div_.Tensor: aten.div.Tensor,
}


def _mutated(node: fx.Node) -> fx.Node | None:
    """The tensor an in-place or out= node writes (its ``self`` or ``out``), if it is one we rewrite."""
    if node.op != "call_function":
        return None
    if node.target is aten.cat.out:
        return node.kwargs.get("out")
    if node.target in _FUNCTIONAL or node.target in _KEPT_ONLY:
        return node.args[0]
    return None


def _carry_placeholders(gm: fx.GraphModule) -> set[fx.Node]:
    """The placeholders of the carries a step graph takes from the previous call (the last inputs, by its layout)."""
    layout = gm.meta.get("deft_layout")
    if layout is None or not layout.carry_inputs:
        return set()
    placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
    return set(placeholders[len(placeholders) - len(layout.carry_inputs):])


def functionalize_bucket_ops(gm: fx.GraphModule) -> fx.GraphModule:
    graph = gm.graph
    latest: dict[fx.Node, fx.Node] = {}  # a mutated tensor (its first node) -> the node holding its value now
    identity: dict[fx.Node, fx.Node] = {}  # in-place node -> the tensor it mutated (it returns that tensor)

    def root(node: fx.Node) -> fx.Node:
        while node in identity:
            node = identity[node]
        return node

    def current(node: fx.Node) -> fx.Node:
        return latest.get(root(node), node)

    carried = _carry_placeholders(gm)
    for node in list(graph.nodes):
        if node.op == "placeholder":
            continue
        target = _mutated(node)  # before re-pointing the arguments: the tensor as the graph names it
        node.args = fx.map_arg(node.args, current)
        node.kwargs = fx.map_arg(node.kwargs, current)
        if target is None or (root(target).op == "placeholder" and root(target) not in carried):
            continue
        if node.target in _KEPT_ONLY and root(target).op != "get_attr":
            continue
        with graph.inserting_before(node):
            if node.target is aten.cat.out:
                replacement = graph.call_function(aten.cat.default, node.args, {k: v for k, v in node.kwargs.items() if k != "out"})
            else:
                functional = _FUNCTIONAL.get(node.target) or _KEPT_ONLY[node.target]
                replacement = graph.call_function(functional, node.args, dict(node.kwargs))
        replacement.meta.update(node.meta)
        base = root(target)
        identity[node] = base
        latest[base] = replacement
    for node in reversed(list(graph.nodes)):  # the rewritten in-place nodes have no readers left
        if node in identity and not node.users:
            graph.erase_node(node)
    graph.lint()
    gm.recompile()
    return gm
