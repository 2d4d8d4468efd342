"""Remove what tracing records but the compiled step does not need."""

from __future__ import annotations

import torch
import torch.fx as fx

_DETACH = torch.ops.aten.detach.default


def remove_profiler_ops(gm: fx.GraphModule) -> fx.GraphModule:
    """Drop ``torch.ops.profiler`` record-function nodes the optimizer's ``step`` emits.

    They only label a profiler range and would cost a call per step.
    """
    profiler_nodes = [
        n for n in gm.graph.nodes
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and n.target.namespace == "profiler"
    ]
    # Reverse graph order erases each exit node before the enter node whose handle it reads.
    for node in reversed(profiler_nodes):
        if node.users:
            raise ValueError(f"profiler node {node.format_node()} is read by a non-profiler node")
        gm.graph.erase_node(node)
    gm.recompile()
    return gm


def remove_detach(gm: fx.GraphModule) -> fx.GraphModule:
    """Replace ``aten.detach`` by its input: the compiled step runs without autograd."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is _DETACH:
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
    gm.recompile()
    return gm
