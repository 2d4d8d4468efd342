"""Evaluate the optimizer's scalar bias corrections in float64, as eager does.

Eager Adam/AdamW compute ``1 - beta ** step`` with Python floats (float64). The
captured (capturable) form computes it from the float32 step tensor, and
``1 - 0.999 ** 1`` loses about 1.3e-5 of its value to cancellation in float32,
which shows up as a 6e-6 relative error in the first updates. This pass casts
the 0-dim exponent of every ``aten.pow.Scalar`` in the optimizer region to
float64; type promotion then keeps the whole scalar chain in float64 and only
the final per-element arithmetic runs in the parameters' dtype, leaving
differences of a few float32 ulps from eager.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from deft_compile.ir import ops

aten = torch.ops.aten


def promote_bias_corrections(gm: fx.GraphModule) -> fx.GraphModule:
    graph = gm.graph
    nodes = list(graph.nodes)
    marker_positions = [i for i, n in enumerate(nodes) if n.op == "call_function" and n.target == ops.GRADIENT]
    if not marker_positions:
        return gm
    for node in nodes[max(marker_positions) + 1 :]:
        if node.op != "call_function" or node.target is not aten.pow.Scalar:
            continue
        exponent = node.args[1]
        value = exponent.meta.get("val") if isinstance(exponent, fx.Node) else None
        if value is None or value.dim() != 0 or value.dtype != torch.float32:
            continue
        with graph.inserting_before(node):
            widened = graph.call_function(aten._to_copy.default, (exponent,), {"dtype": torch.float64})
        node.replace_input_with(exponent, widened)
    graph.lint()
    gm.recompile()
    return gm
