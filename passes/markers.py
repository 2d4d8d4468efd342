"""Remove the marker ops once every pass that needs them has run."""

from __future__ import annotations

import torch.fx as fx

from deft_compile.ir import ops


def strip_markers(gm: fx.GraphModule) -> fx.GraphModule:
    """Replace each remaining ``deft.gradient`` by its input and drop ``deft.phase`` nodes.

    A gradient marker left here was not communicated (world size 1, or no
    collective pass ran): the optimizer reads the local gradient directly.
    """
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in ops.MARKERS:
            continue
        node.replace_all_uses_with(node.args[0])
        gm.graph.erase_node(node)
    gm.recompile()
    return gm
