"""Compute every symbolic size from the graph's inputs (captures traced with symbolic input dimensions).

Why: ``make_fx`` binds a symbolic size to whichever tensor first had it, so a ``sym_size`` can read an
intermediate (``sym_size(view_13, 1)``) or another ``sym_size``'s product. A graph that runs in regions copies
values computed from graph inputs alone into every region that reads them; a size read from an intermediate
would instead cross region boundaries as a Python integer. This pass rewrites each integer-valued node whose
value is an expression in the inputs' size symbols as that expression over ``aten.sym_size.int`` of the input
placeholders (``8 * sym_size(tokens, 1)``), and drops the old nodes. Values are unchanged: the expressions are
the ones the shape environment recorded.

Nodes whose value is not such an expression (the learning rate read with ``.item()``, a data-dependent size)
stay as they are.
"""

from __future__ import annotations

import operator
from typing import Any, Callable

import sympy
import torch
import torch.fx as fx

aten = torch.ops.aten


class SymbolicSizeError(ValueError):
    """A symbolic size has a form this pass cannot compute from the graph's inputs."""


def rebase_symbolic_sizes(gm: fx.GraphModule) -> fx.GraphModule:
    """Rewrite each node whose value is a ``SymInt`` over the input placeholders' size symbols (module docstring)."""
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    sources: dict[sympy.Symbol, tuple[fx.Node, int]] = {}
    for node in placeholders:
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor):
            continue
        for dim, size in enumerate(value.shape):
            expr = size_expr(size)
            if isinstance(expr, sympy.Symbol) and expr not in sources:
                sources[expr] = (node, dim)
    if not sources:
        return gm
    anchor = placeholders[-1]
    built: dict[Any, fx.Node] = {}

    def emit(target: Callable[..., Any], args: tuple, key: Any) -> fx.Node:
        if key in built:
            return built[key]
        nonlocal anchor
        with graph.inserting_after(anchor):
            node = graph.call_function(target, args)
        values = [a.meta["val"] if isinstance(a, fx.Node) else a for a in args]
        node.meta["val"] = target(*values)
        anchor = built[key] = node
        return node

    def build(expr: sympy.Expr) -> Any:
        if isinstance(expr, sympy.Integer):
            return int(expr)
        if isinstance(expr, sympy.Symbol):
            if expr not in sources:
                raise SymbolicSizeError(f"size symbol {expr} is no input's dimension")
            placeholder, dim = sources[expr]
            return emit(aten.sym_size.int, (placeholder, dim), expr)
        operation = _OPERATIONS.get(type(expr).__name__)
        if operation is None:
            raise SymbolicSizeError(f"cannot compute the symbolic size {expr} ({type(expr).__name__}) from the inputs")
        args = [build(a) for a in _ordered_args(expr)]
        result = args[0]
        for index, arg in enumerate(args[1:], start=1):
            result = emit(operation, (result, arg), (type(expr).__name__, expr, index))
        return result

    for node in list(graph.nodes):
        if node.op != "call_function" or node in built.values():
            continue
        value = node.meta.get("val")
        if not isinstance(value, torch.SymInt):
            continue
        expr = size_expr(value)
        if not expr.free_symbols or not expr.free_symbols <= set(sources):
            continue
        replacement = build(expr)
        if replacement is node:
            continue
        if isinstance(replacement, int):
            for user in list(node.users):
                user.args = fx.node.map_arg(user.args, lambda a: replacement if a is node else a)
                user.kwargs = fx.node.map_arg(user.kwargs, lambda a: replacement if a is node else a)
        else:
            node.replace_all_uses_with(replacement)
    for node in reversed(list(graph.nodes)):  # the size arithmetic nothing reads any more
        if not node.users and _is_size_op(node):
            graph.erase_node(node)
    gm.recompile()
    return gm


def _is_size_op(node: fx.Node) -> bool:
    return (node.op == "call_function" and isinstance(node.meta.get("val"), torch.SymInt)
            and (node.target is aten.sym_size.int or node.target in _OPERATIONS.values()))


def size_expr(size: Any) -> sympy.Expr:
    """The simplified sympy expression of a size (an int becomes a ``sympy.Integer``)."""
    if isinstance(size, torch.SymInt):
        node = size.node
        return sympy.sympify(node.shape_env.replace(node.expr) if node.shape_env is not None else node.expr)
    return sympy.Integer(int(size))


def _ordered_args(expr: sympy.Expr) -> tuple:
    """A sum's or product's constant first (``8 * s``, as traced); other operations keep their order."""
    if isinstance(expr, (sympy.Add, sympy.Mul)):
        return tuple(sorted(expr.args, key=lambda a: not isinstance(a, sympy.Integer)))
    return expr.args


_OPERATIONS: dict[str, Callable[[Any, Any], Any]] = {
    "Add": operator.add,
    "Mul": operator.mul,
    "FloorDiv": operator.floordiv,
    "PythonMod": operator.mod,
    "Mod": operator.mod,
    "Max": torch.sym_max,
    "Min": torch.sym_min,
}
