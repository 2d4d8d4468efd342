"""Global-norm gradient clipping and dynamic loss scaling's skip, on the gradients an update applies.

Both look at the whole gradient vector the optimizer update of a call applies: the
gradients in the graph's ``gradient_outputs`` (after the ``schedule`` pass these are
the averaged ones, fresh and arrived-delayed together; without communication the
local ones). Both therefore make every update wait for every applied gradient: this
pass moves those gradients (their waits and assembly) before the first update node,
computes what it needs there and rewires the updates.

* **Clipping** (``max_norm``): exactly ``torch.nn.utils.clip_grad_norm_``'s arithmetic
  (``_foreach_norm`` per device and dtype group, the norm of the stacked norms,
  ``max_norm / (norm + 1e-6)`` clamped at 1), applied to the gradients in parameter
  order; the updates and ``param.grad`` see the clipped gradients. The total norm
  leaves the graph as the ``step:grad_norm`` output.
* **Non-finite skip** (loss scaling): if any applied gradient holds an inf or NaN,
  every parameter and optimizer-state tensor the update mutates in place is restored
  right after its last mutation (a snapshot taken before the first update), so the
  update is skipped as ``GradScaler.step`` skips ``optimizer.step()``; the flag leaves
  as ``step:found_inf`` (the runtime then drops optimizer state the update created)
  and ``aten._amp_update_scale_`` updates the scale and growth tracker inputs in place
  with ``GradScaler``'s rules. The averaged gradient is the same on every rank, so the
  decision is too, without another collective.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from deft_compile.ir.layout import GraphLayout

aten = torch.ops.aten

GRAD_NORM_KEY = "step:grad_norm"
FOUND_INF_KEY = "step:found_inf"


@dataclass(frozen=True)
class GuardOptions:
    """What the pass adds. ``max_norm`` None: no clipping; ``skip_nonfinite``: loss scaling's skip and scale
    update (the graph then has the scaler inputs, see ``GraphLayout.num_scaler_inputs``)."""

    max_norm: float | None = None
    norm_type: float = 2.0
    skip_nonfinite: bool = False
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    @property
    def active(self) -> bool:
        return self.max_norm is not None or self.skip_nonfinite


def guard_gradients(gm: fx.GraphModule, *, options: GuardOptions) -> fx.GraphModule:
    """Add clipping and/or the non-finite skip to ``gm`` (see module docstring); no-op without applied gradients."""
    if options.active:
        _Guard(gm, options).run()
        gm.graph.lint()
        gm.recompile()
    return gm


class _Guard:
    def __init__(self, gm: fx.GraphModule, options: GuardOptions) -> None:
        self.gm, self.graph, self.options = gm, gm.graph, options
        self.layout: GraphLayout = gm.meta["deft_layout"]
        self.output = next(n for n in reversed(self.graph.nodes) if n.op == "output")

    def _gradients(self) -> dict[int, fx.Node]:
        """Parameter index -> the gradient node its update applies (from the output layout)."""
        values = list(self.output.args[0])
        start = (1 if self.layout.has_loss else 0) + len(self.layout.state_outputs)
        return dict(zip(self.layout.gradient_outputs, values[start : start + len(self.layout.gradient_outputs)]))

    def run(self) -> None:
        gradients = self._gradients()
        if not gradients:
            return  # nothing applied in this call (accumulating, or all pending): no update to guard
        order = {node: i for i, node in enumerate(self.graph.nodes)}
        users = [u for g in gradients.values() for u in g.users if u is not self.output]
        if not users:
            return
        # The update starts at its first gradient read or its first in-place write, whichever comes first
        # (SGD's momentum buffer is multiplied before the gradient is added).
        mutations = self._mutations()
        first_gradient = min(gradients.values(), key=order.__getitem__)
        writes = [node for node in mutations if order[node] > order[first_gradient]]
        first_update = min(users + writes, key=order.__getitem__)
        self._hoist_before(first_update, list(gradients.values()), order)
        params = sorted(gradients)
        grads = [gradients[p] for p in params]
        readers = {grad: list(grad.users) for grad in grads}  # the updates and the output, before we add readers
        extra_outputs: dict[str, fx.Node] = {}
        with self.graph.inserting_before(first_update):
            if self.options.skip_nonfinite:
                found = self._found_nonfinite(grads)
                extra_outputs[FOUND_INF_KEY] = found
            if self.options.max_norm is not None:
                norm, clipped = self._clip(grads)
                extra_outputs[GRAD_NORM_KEY] = norm
                for grad, new in zip(grads, clipped):
                    for reader in readers[grad]:
                        reader.replace_input_with(grad, new)
        if self.options.skip_nonfinite:
            self._skip_if(found, first_update, mutations)
        values = list(self.output.args[0]) + list(extra_outputs.values())
        self.output.args = (tuple(values),)
        self.layout.carry_outputs = list(self.layout.carry_outputs) + list(extra_outputs)

    # -- ordering -----------------------------------------------------------------
    def _hoist_before(self, point: fx.Node, needed: list[fx.Node], order: dict[fx.Node, int]) -> None:
        """Move every node that ``needed`` depend on and that sits after ``point`` to just before it, keeping
        their relative order (waits and gradient assembly placed later by the schedule pass)."""
        limit = order[point]
        late: set[fx.Node] = set()
        frontier = [n for n in needed if order[n] > limit]
        while frontier:
            node = frontier.pop()
            if node in late:
                continue
            late.add(node)
            frontier.extend(n for n in node.all_input_nodes if order[n] > limit)
        for node in sorted(late, key=order.__getitem__):
            point.prepend(node)

    # -- clipping -----------------------------------------------------------------
    def _clip(self, grads: list[fx.Node]) -> tuple[fx.Node, list[fx.Node]]:
        g, norm_type, max_norm = self.graph, float(self.options.norm_type), float(self.options.max_norm)
        groups: dict[tuple, list[int]] = {}  # as _group_tensors_by_device_and_dtype: first-appearance order
        for i, grad in enumerate(grads):
            value = grad.meta.get("val")
            key = (value.device, value.dtype) if isinstance(value, torch.Tensor) else ("?", i)
            groups.setdefault(key, []).append(i)
        norms = []
        for members in groups.values():
            foreach = g.call_function(aten._foreach_norm.Scalar, ([grads[i] for i in members], norm_type))
            norms += [g.call_function(operator.getitem, (foreach, k)) for k in range(len(members))]
        stacked = g.call_function(aten.stack.default, (norms,))
        total = g.call_function(aten.linalg_vector_norm.default, (stacked, norm_type))
        denominator = g.call_function(aten.add.Tensor, (total, 1e-6))
        coefficient = g.call_function(aten.mul.Tensor, (g.call_function(aten.reciprocal.default, (denominator,)), max_norm))
        clamped = g.call_function(aten.clamp.default, (coefficient, None, 1.0))
        return total, [g.call_function(aten.mul.Tensor, (grad, clamped)) for grad in grads]

    # -- loss scaling's skip --------------------------------------------------------
    def _found_nonfinite(self, grads: list[fx.Node]) -> fx.Node:
        g = self.graph
        flags = [g.call_function(aten.logical_not.default, (g.call_function(aten.all.default, (g.call_function(aten.isfinite.default, (grad,)),)),)) for grad in grads]
        anywhere = g.call_function(aten.any.default, (g.call_function(aten.stack.default, (flags,)),))
        return g.call_function(aten._to_copy.default, (anywhere,), {"dtype": torch.float32})

    def _mutations(self) -> dict[fx.Node, fx.Node]:
        """Nodes that write in place into a parameter or optimizer-state input -> the input they write.

        Only the optimizer update writes those (forward writes buffers, which a skipped update keeps)."""
        inputs = self.layout.inputs(self.graph)
        guarded = {*inputs.params, *inputs.states}
        found: dict[fx.Node, fx.Node] = {}
        for node in self.graph.nodes:
            if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
                continue
            for argument, value in zip(node.target._schema.arguments, node.args):
                if argument.alias_info is not None and argument.alias_info.is_write and isinstance(value, fx.Node):
                    base = _alias_base(value)
                    if base in guarded:
                        found[node] = base
        return found

    def _skip_if(self, found: fx.Node, first_update: fx.Node, mutations: dict[fx.Node, fx.Node]) -> None:
        """Snapshot every parameter and state input the update writes; restore it after its last write if found."""
        g = self.graph
        mutated: dict[fx.Node, fx.Node] = {}  # input -> its last write (graph order: later writes overwrite)
        for node, base in mutations.items():
            mutated[base] = node
        with g.inserting_before(first_update):
            is_found = g.call_function(aten.gt.Scalar, (found, 0.0))
            snapshots = {tensor: g.call_function(aten.clone.default, (tensor,)) for tensor in mutated}
        for tensor, last in mutated.items():
            with g.inserting_after(last):
                kept = g.call_function(aten.where.self, (is_found, snapshots[tensor], tensor))
            with g.inserting_after(kept):
                g.call_function(aten.copy_.default, (tensor, kept))
        scale, tracker = self.layout.inputs(self.graph).scaler
        with g.inserting_before(first_update):
            g.call_function(
                aten._amp_update_scale_.default,
                (scale, tracker, found, self.options.growth_factor, self.options.backoff_factor, self.options.growth_interval),
            )


def _alias_base(node: fx.Node) -> fx.Node:
    """Follow in-place ops (which return their mutated ``self``) back to the tensor they mutate."""
    while node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        schema = node.target._schema
        if not schema.arguments or schema.arguments[0].alias_info is None or not schema.arguments[0].alias_info.is_write:
            break
        if not isinstance(node.args[0], fx.Node):
            break
        node = node.args[0]
    return node


__all__ = ["FOUND_INF_KEY", "GRAD_NORM_KEY", "GuardOptions", "guard_gradients"]
