"""Read the structure of a captured step graph: phases, gradients, first uses, update subgraphs.

Everything here is derived from the marker ops (matched by op overload) and the
graph's data flow, never from node names, so it stays valid after passes rename
or insert nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from deft_compile.ir import ops


@dataclass
class ParamAnnotation:
    """Where one parameter lives in the step graph.

    Attributes:
        index: position in the captured parameter list.
        placeholder: the graph input holding the parameter.
        gradient_marker: the ``deft.gradient`` node, or None if the parameter
            gets no gradient (frozen or unused).
        gradient_ready: the node that produces the gradient in backward (the
            marker's input); the gradient can be communicated right after it.
        first_forward_use: the first node reading the parameter, or None.
        update_nodes: the optimizer nodes that compute this parameter's update,
            in graph order (empty when the optimizer does not update it).
    """

    index: int
    placeholder: fx.Node
    gradient_marker: fx.Node | None
    gradient_ready: fx.Node | None
    first_forward_use: fx.Node | None
    update_nodes: list[fx.Node]


@dataclass
class StepAnnotation:
    forward_end: fx.Node
    params: list[ParamAnnotation]
    order: dict[fx.Node, int]

    def gradient_ready_order(self) -> list[int]:
        """Indices of parameters with a gradient, in the order their gradients become ready."""
        with_grads = [a for a in self.params if a.gradient_ready is not None]
        with_grads.sort(key=lambda a: (self.order[a.gradient_ready], a.index))
        return [a.index for a in with_grads]


def annotate(graph: fx.Graph, param_placeholders: list[fx.Node], state_placeholders_by_param: dict[int, list[fx.Node]]) -> StepAnnotation:
    """Annotate a captured step graph (see :class:`ParamAnnotation`)."""
    nodes = list(graph.nodes)
    order = {node: position for position, node in enumerate(nodes)}
    phase_nodes = [n for n in nodes if n.op == "call_function" and n.target == ops.PHASE and n.args[1] == "forward"]
    if len(phase_nodes) != 1:
        raise ValueError(f"expected one end-of-forward marker, found {len(phase_nodes)}")
    forward_end = phase_nodes[0]
    markers: dict[int, fx.Node] = {
        n.args[1]: n for n in nodes if n.op == "call_function" and n.target == ops.GRADIENT
    }
    update_start = max((order[m] for m in markers.values()), default=len(nodes))
    annotations = []
    for index, placeholder in enumerate(param_placeholders):
        marker = markers.get(index)
        uses = [u for u in placeholder.users if order[u] < order[forward_end]]
        first_use = min(uses, key=order.__getitem__) if uses else None
        roots = [placeholder, *state_placeholders_by_param.get(index, [])]
        if marker is not None:
            roots.append(marker)
        update = _descendants_after(roots, order, update_start) if marker is not None else []
        annotations.append(
            ParamAnnotation(
                index=index,
                placeholder=placeholder,
                gradient_marker=marker,
                gradient_ready=marker.args[0] if marker is not None else None,
                first_forward_use=first_use,
                update_nodes=update,
            )
        )
    return StepAnnotation(forward_end=forward_end, params=annotations, order=order)


def _descendants_after(roots: list[fx.Node], order: dict[fx.Node, int], start: int) -> list[fx.Node]:
    """Nodes after position ``start`` that depend on any root, in graph order."""
    seen: set[fx.Node] = set()
    frontier = list(roots)
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user not in seen and user.op != "output" and order[user] > start:
                seen.add(user)
                frontier.append(user)
    return sorted(seen, key=order.__getitem__)
