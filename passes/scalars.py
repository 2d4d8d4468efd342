"""Turn values read with ``.item()`` back into 0-dim tensor arithmetic (for Inductor).

Why: the capture reads each param group's learning rate (a 0-dim float64 graph
input) with ``.item()``, so the optimizer's Python-float code paths trace and
LR schedulers reuse one graph. ``aten._local_scalar_dense`` is data-dependent:
Inductor's fake tracing raises ``DataDependentOutputException`` on it. This
pass removes every ``_local_scalar_dense`` and the symbolic-float arithmetic
built on it (``operator.neg``/``mul``/``sub``/...) by computing the same values
with 0-dim tensor ops of the source tensor's dtype (float64 for learning rates:
IEEE double, the same numbers Python floats give), and rewrites the aten ops
that took such a value as a Scalar argument (``alpha=``, ``value=``, a scalar
operand) into tensor forms. The learning rate stays a graph input.

The aten path does not use this pass: ``add_(x, g, alpha=-lr)`` is one fused
multiply-add in ATen's CPU kernel, while ``add_(x, g * -lr)`` rounds twice, and
SGD must stay bit-identical with DDP there. Inductor decomposes ``alpha=`` into
a multiply and an add anyway.
"""

from __future__ import annotations

import operator
from typing import Any, Callable

import torch
import torch.fx as fx

aten = torch.ops.aten
_ITEM = aten._local_scalar_dense.default


class ScalarLoweringError(ValueError):
    """A value read with ``.item()`` reaches an op this pass cannot rewrite into tensor form."""


# Python operators on symbolic scalars -> (aten op on tensors, whether the arguments are swapped
# when only the second one is a tensor)
_BINARY: dict[Callable[..., Any], tuple[Any, Any]] = {
    operator.add: (aten.add.Tensor, aten.add.Tensor),
    operator.mul: (aten.mul.Tensor, aten.mul.Tensor),
    operator.sub: (aten.sub.Tensor, aten.rsub.Scalar),
    operator.truediv: (aten.div.Tensor, None),
}


def tensorize_item_reads(gm: fx.GraphModule) -> fx.GraphModule:
    """Replace every ``aten._local_scalar_dense`` and its scalar arithmetic by 0-dim tensor ops.

    Raises ``ScalarLoweringError`` naming the op when a value read with
    ``.item()`` flows somewhere without a tensor form (a shape, a Python branch).
    """
    graph = gm.graph
    tensor_of: dict[fx.Node, fx.Node] = {}  # symbolic scalar node -> 0-dim tensor node of the same value
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is _ITEM:
            tensor_of[node] = node.args[0]
            continue
        scalar_args = [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, fx.Node) and a in tensor_of]
        if not scalar_args:
            continue
        with graph.inserting_before(node):
            if node.target is operator.neg:
                tensor_of[node] = graph.call_function(aten.neg.default, (tensor_of[node.args[0]],))
            elif node.target in _BINARY:
                tensor_of[node] = _binary(graph, node, tensor_of)
            elif isinstance(node.target, torch._ops.OpOverload):
                replacement = _rewrite_aten(graph, node, tensor_of)
                node.replace_all_uses_with(replacement)
                graph.erase_node(node)
            else:
                raise ScalarLoweringError(
                    f"a value read with .item() reaches {node.format_node()}; it has no tensor form"
                )
    for node in reversed(list(tensor_of)):
        if node.graph is graph and not node.users:
            graph.erase_node(node)
    leftover = [n for n in graph.nodes if n.op == "call_function" and n.target is _ITEM]
    if leftover:
        raise ScalarLoweringError(f"{leftover[0].format_node()} is still read as a Python scalar")
    graph.lint()
    gm.recompile()
    return gm


def _binary(graph: fx.Graph, node: fx.Node, tensor_of: dict[fx.Node, fx.Node]) -> fx.Node:
    a, b = node.args
    tensor_op, reversed_op = _BINARY[node.target]
    if isinstance(a, fx.Node) and a in tensor_of:
        other = tensor_of[b] if isinstance(b, fx.Node) and b in tensor_of else b
        return graph.call_function(tensor_op, (tensor_of[a], other))
    if reversed_op is None:  # scalar / tensor
        return graph.call_function(aten.mul.Tensor, (graph.call_function(aten.reciprocal.default, (tensor_of[b],)), a))
    return graph.call_function(reversed_op, (tensor_of[b], a))


def _as_tensor(value: Any, tensor_of: dict[fx.Node, fx.Node]) -> Any:
    return tensor_of[value] if isinstance(value, fx.Node) and value in tensor_of else value


def _rewrite_aten(graph: fx.Graph, node: fx.Node, tensor_of: dict[fx.Node, fx.Node]) -> fx.Node:
    """One aten op with a symbolic-scalar argument, in tensor form; returns the node replacing it.

    The forms are Inductor's own decompositions (``x + alpha * y``,
    ``x + value * (t1 / t2)``), so the numbers match what it would compute.
    """
    target = node.target
    args, kwargs = list(node.args), dict(node.kwargs)
    if target in (aten.add_.Tensor, aten.add.Tensor, aten.sub_.Tensor, aten.sub.Tensor) and "alpha" in kwargs:
        alpha = kwargs.pop("alpha")
        if isinstance(args[1], fx.Node) and args[1] in tensor_of:
            raise ScalarLoweringError(f"{node.format_node()}: both operands are Python scalars")
        args[1] = graph.call_function(aten.mul.Tensor, (args[1], _as_tensor(alpha, tensor_of)))
        return graph.call_function(target, tuple(_as_tensor(a, tensor_of) for a in args), kwargs)
    if target in (aten.addcdiv_.default, aten.addcdiv.default, aten.addcmul_.default, aten.addcmul.default):
        value = kwargs.pop("value", 1)
        combine = aten.div.Tensor if target in (aten.addcdiv_.default, aten.addcdiv.default) else aten.mul.Tensor
        combined = graph.call_function(combine, (args[1], args[2]))
        scaled = graph.call_function(aten.mul.Tensor, (combined, _as_tensor(value, tensor_of)))
        add = aten.add_.Tensor if target in (aten.addcdiv_.default, aten.addcmul_.default) else aten.add.Tensor
        return graph.call_function(add, (args[0], scaled))
    scalar_overloads = {
        aten.mul.Scalar: aten.mul.Tensor, aten.mul_.Scalar: aten.mul_.Tensor,
        aten.add.Scalar: aten.add.Tensor, aten.add_.Scalar: aten.add_.Tensor,
        aten.div.Scalar: aten.div.Tensor, aten.div_.Scalar: aten.div_.Tensor,
    }
    target = scalar_overloads.get(target, target)
    tensor_form = (aten.mul.Tensor, aten.mul_.Tensor, aten.div.Tensor, aten.div_.Tensor, aten.add.Tensor, aten.add_.Tensor,
                   aten.sub.Tensor, aten.sub_.Tensor)
    if target in tensor_form and len(args) == 2 and not kwargs and not (isinstance(args[0], fx.Node) and args[0] in tensor_of):
        return graph.call_function(target, (args[0], _as_tensor(args[1], tensor_of)))
    raise ScalarLoweringError(
        f"a value read with .item() is a Scalar argument of {node.format_node()}; no tensor form is known for this op"
    )
