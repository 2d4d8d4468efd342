"""FX passes on the backward graph that ``aot_autograd`` hands the ``deft`` backend.

The backward graph returns one entry per forward input (``None`` where no
gradient flows). Positions of parameters among those inputs are known to the
backend; these passes only rewrite the graph around the returned gradient
nodes, matching collectives by op overload (``deft_compile.passes.collectives``),
never by node name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.fx as fx

from deft_compile.planner.bucketing import assign_buckets
from deft_compile.passes.collectives import ALL_REDUCE, WAIT, emit_flatten, emit_unflatten

aten = torch.ops.aten


@dataclass(frozen=True)
class BackwardBucket:
    """One DDP bucket of the backward graph.

    Attributes:
        positions: backward-graph output positions (= forward input positions)
            of the bucket's parameter gradients, in gradient-ready order.
        delayed: the bucket's averaged gradient is returned one call later.
    """

    positions: tuple[int, ...]
    delayed: bool


def output_node(graph: fx.Graph) -> fx.Node:
    for node in reversed(graph.nodes):
        if node.op == "output":
            return node
    raise ValueError("graph has no output node")


def gradient_outputs(gm: fx.GraphModule) -> list[fx.Node | None]:
    """The backward graph's returned values, one per forward input."""
    returned = output_node(gm.graph).args[0]
    if not isinstance(returned, (tuple, list)):
        raise ValueError(f"expected the backward graph to return a tuple of gradients, got {type(returned).__name__}")
    return list(returned)


def gradient_ready_order(gm: fx.GraphModule, positions: Sequence[int]) -> list[int]:
    """``positions`` whose gradient the graph returns, sorted by when the gradient is produced.

    This is DDP's bucket order: the gradient computed first in backward goes in
    the first bucket. Positions returning ``None`` (no gradient flows) are dropped.
    """
    outputs = gradient_outputs(gm)
    order = {node: index for index, node in enumerate(gm.graph.nodes)}
    present = [p for p in positions if isinstance(outputs[p], fx.Node)]
    return sorted(present, key=lambda p: (order[outputs[p]], p))


def plan_buckets(
    ready: Sequence[int],
    sizes_bytes: Sequence[int],
    keys: Sequence[tuple],
    delayed: Sequence[bool],
    *,
    first_bucket_bytes: int,
    bucket_cap_bytes: int,
) -> list[BackwardBucket]:
    """DDP buckets over gradients in ready order; delayed and synchronous gradients never share one.

    ``sizes_bytes``, ``keys`` (dtype, device) and ``delayed`` are given per entry of ``ready``.
    """
    grouped = [(*key, flag) for key, flag in zip(keys, delayed)]
    indices = assign_buckets(sizes_bytes, grouped, first_bucket_bytes=first_bucket_bytes, bucket_cap_bytes=bucket_cap_bytes)
    return [BackwardBucket(positions=tuple(ready[i] for i in bucket), delayed=delayed[bucket[0]]) for bucket in indices]


def clone_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """An independent copy of ``gm``'s graph (node metadata copied shallowly), so two variants can be built."""
    graph = fx.Graph()
    returned = graph.graph_copy(gm.graph, {})
    graph.output(returned)
    return fx.GraphModule(gm, graph)


def insert_gradient_allreduce(
    gm: fx.GraphModule,
    *,
    buckets: Sequence[BackwardBucket],
    group_name: str | None,
    world_size: int,
    first_step: bool,
) -> fx.GraphModule:
    """Average the parameter gradients of every bucket across ranks, DDP style.

    Per bucket, right after its last gradient is produced: flatten, scale by
    1/world_size and launch an async ``all_reduce(sum)`` (no collective when
    ``group_name`` is None: one process). Synchronous buckets: ``wait_tensor``
    and the views of the averaged buffer go just before the output, as late as
    possible, and replace the bucket's gradients in the returned tuple.

    Delayed buckets: the un-waited all-reduce result is appended to the outputs
    (the caller keeps it for the next call). With ``first_step`` the bucket's
    gradients are returned as ``None`` (autograd then leaves ``param.grad``
    untouched, so the optimizer skips the parameter); otherwise one new
    placeholder per delayed bucket (appended after the existing ones, in bucket
    order) takes the previous call's in-flight buffer, which is waited just
    before the output and returned as the bucket's gradients.
    """
    graph = gm.graph
    out = output_node(graph)
    outputs = gradient_outputs(gm)
    returned: list[fx.Node | None] = list(outputs)
    order = {node: index for index, node in enumerate(graph.nodes)}
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    launched_delayed: list[fx.Node] = []
    before_output: list[tuple[fx.Node, list[fx.Node], BackwardBucket]] = []
    last_placeholder = placeholders[-1] if placeholders else None
    for index, bucket in enumerate(buckets):
        gradients = [outputs[p] for p in bucket.positions]
        if any(not isinstance(g, fx.Node) for g in gradients):
            raise ValueError(f"bucket {index} holds a position whose backward output is not a tensor node")
        last_ready = max(gradients, key=order.__getitem__)
        anchor = last_placeholder if last_ready.op == "placeholder" else last_ready
        launched = _emit_launch(graph, anchor, gradients, group_name, world_size)
        if not bucket.delayed:
            before_output.append((launched, gradients, bucket))
            continue
        launched_delayed.append(launched)
        if first_step:
            for p in bucket.positions:
                returned[p] = None
            continue
        with graph.inserting_after(last_placeholder):
            pending = graph.placeholder(f"pending_bucket_{index}")
        last_placeholder = pending
        before_output.append((pending, gradients, bucket))
    with graph.inserting_before(out):
        for flat, gradients, bucket in before_output:
            averaged = graph.call_function(WAIT, (flat,)) if group_name is not None else flat
            for p, piece in zip(bucket.positions, emit_unflatten(graph, averaged, gradients)):
                returned[p] = piece
    out.args = (tuple(returned) + tuple(launched_delayed),)
    graph.lint()
    gm.recompile()
    return gm


def _emit_launch(
    graph: fx.Graph, anchor: fx.Node, gradients: list[fx.Node], group_name: str | None, world_size: int
) -> fx.Node:
    """flatten -> scale -> async all_reduce, placed right after ``anchor``; returns the in-flight node."""
    # inserting_before(anchor.next) keeps the new nodes in creation order; inserting_after
    # would place each new node directly after the anchor, reversing the chain.
    with graph.inserting_before(anchor.next):
        flat = emit_flatten(graph, gradients)
        if group_name is None:
            return flat
        scaled = graph.call_function(aten.mul.Tensor, (flat, 1.0 / world_size))
        return graph.call_function(ALL_REDUCE, (scaled, "sum", group_name))
