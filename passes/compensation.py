"""Compensated staleness for delayed parameters (``DeftConfig(delayed_update="compensated")``).

A delayed parameter's update applies the averaged gradient of the previous step, ḡ_{t-1}, computed at the weights
of that step. Two published corrections, applied identically on every rank (replicas stay bit-identical), make it
cost less:

* **Nesterov form of the first moment** (the update rewritten, by op overload, in the parameter's own optimizer
  subgraph). Momentum SGD (heavy ball, no dampening): ``w -= lr * (g + β v')`` instead of ``w -= lr * v'``, with
  ``v' = β v + g`` as before: for one step of delay this is spike compensation (Kosson et al., MLSys 2021), whose
  coefficients for delay D are ``β^D`` and ``(1 - β^D) / (1 - β)``. Adam and AdamW: the update divides
  ``β1 m' + (1 - β1) g`` instead of ``m'`` (NAdam's first moment, the bias correction unchanged).
* **Weight prediction** for the delayed parameter's forward and backward: they run at the weights its pending
  update is about to give, ŵ = w − lr·v (SGD: linear weight prediction, Kosson et al.) or
  ŵ = w − lr·m̂ / (√v̂ + ε) (Adam, AdamW: SpecTrain's prediction from the optimizer state), so the gradient that
  arrives a step late was computed near the weights it is applied to. The optimizer itself (the update, weight
  decay) reads the true weights. Where the parameter has no optimizer state yet (its first update), ŵ = w.

The pass runs after ``tag_regions`` and before ``schedule``: the Nesterov node joins its update's region (that
region compiles once more, per shape), the prediction is glue before the forward (the forward regions read ŵ
where they read w, with the same shape, so they compile nothing new). Nodes are found by op overload.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx

from deft_compile.ir import ops
from deft_compile.ir.layout import layout_of

aten = torch.ops.aten
REGION = "deft_region"  # the node.meta key of deft_compile.step.regions

FAMILIES = ("sgd", "adam")


@dataclass(frozen=True)
class Compensation:
    """Which parameters (captured indices) are compensated, and their optimizer's family and hyper-parameters.

    ``momentum``: SGD's, per parameter. ``betas``, ``eps``: Adam's, per parameter. ``lr_input``: the position,
    among the graph's hyper-parameter inputs (``GraphLayout.hyper_inputs``), of each parameter's group rate (absent:
    the rate is a constant, ``lr``). ``predict``: forward and backward at the predicted weights."""

    params: frozenset[int]
    family: str
    momentum: dict[int, float] = field(default_factory=dict)
    betas: dict[int, tuple[float, float]] = field(default_factory=dict)
    eps: dict[int, float] = field(default_factory=dict)
    lr_input: dict[int, int] = field(default_factory=dict)
    lr: dict[int, float] = field(default_factory=dict)
    predict: bool = True

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"compensation family must be one of {FAMILIES}; got {self.family!r}")


def compensate_delayed(gm: fx.GraphModule, compensation: Compensation) -> fx.GraphModule:
    """Rewrite the updates of ``compensation.params`` into Nesterov form and, with ``predict``, run their forward
    and backward at the predicted weights (see the module docstring)."""
    if not compensation.params:
        return gm
    graph = gm.graph
    layout = layout_of(gm)
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    inputs = layout.inputs(graph)
    params = inputs.params
    state: dict[int, dict[str, fx.Node]] = {}
    for (index, key), node in zip(layout.state_inputs, inputs.states):
        state.setdefault(index, {})[key] = node
    hyper_inputs = inputs.hyper
    markers = [n for n in nodes if n.op == "call_function" and n.target == ops.GRADIENT]
    update_start = max((order[m] for m in markers), default=len(nodes))
    for index in sorted(compensation.params):
        param = params[index]
        if compensation.family == "sgd":
            _nesterov_sgd(graph, param, compensation.momentum[index], order, update_start)
        else:
            _nesterov_adam(graph, param, order, update_start)
        if compensation.predict and state.get(index):
            _predict(graph, param, state[index], compensation, index, hyper_inputs, order, update_start)
    graph.lint()
    gm.recompile()
    return gm


def _in_place_chain(param: fx.Node) -> list[fx.Node]:
    """``param`` and the in-place ops that write it in turn (``mul_`` of decoupled weight decay, the update)."""
    chain = [param]
    while True:
        writers = [u for u in chain[-1].users if u.op == "call_function" and u.args and u.args[0] is chain[-1]
                   and getattr(u.target, "_schema", None) is not None and u.target._schema.is_mutable]
        if not writers:
            return chain
        chain.append(writers[0])


def _nesterov_sgd(graph: fx.Graph, param: fx.Node, momentum: float, order: dict, update_start: int) -> None:
    """``add_(w, v', alpha=-lr)`` → ``add_(w, add(g, v', alpha=β), alpha=-lr)``, where ``v'`` is the momentum
    buffer's new value (``add_(mul_(v, β), g)``, or ``clone(g)`` when the update creates it)."""
    for update in _in_place_chain(param)[1:]:
        if update.target is not aten.add_.Tensor or order.get(update, -1) <= update_start:
            continue
        velocity = update.args[1]
        if not isinstance(velocity, fx.Node):
            continue
        if velocity.target is aten.add_.Tensor and isinstance(velocity.args[0], fx.Node) \
                and velocity.args[0].target is aten.mul_.Tensor:
            if velocity.kwargs.get("alpha", 1) != 1:
                raise ValueError("compensated delayed updates need SGD without dampening (Nesterov form)")
            gradient = velocity.args[1]
        elif velocity.target is aten.clone.default:
            gradient = velocity.args[0]
        else:
            continue  # already Nesterov (the user's nesterov=True), or no momentum
        with graph.inserting_before(update):
            nesterov = graph.call_function(aten.add.Tensor, (gradient, velocity), {"alpha": momentum})
        nesterov.meta.update({k: v for k, v in velocity.meta.items() if k in ("val", REGION)})
        update.args = (update.args[0], nesterov, *update.args[2:])
        return


def _nesterov_adam(graph: fx.Graph, param: fx.Node, order: dict, update_start: int) -> None:
    """``addcdiv_(w, m', denom)`` → ``addcdiv_(w, lerp(m', g, 1 - β1), denom)``, where ``m' = lerp_(m, g, 1 - β1)``."""
    for update in _in_place_chain(param)[1:]:
        if update.target is not aten.addcdiv_.default or order.get(update, -1) <= update_start:
            continue
        moment = update.args[1]
        if not (isinstance(moment, fx.Node) and moment.target is aten.lerp_.Scalar):
            continue
        with graph.inserting_before(update):
            nesterov = graph.call_function(aten.lerp.Scalar, (moment, moment.args[1], moment.args[2]))
        nesterov.meta.update({k: v for k, v in moment.meta.items() if k in ("val", REGION)})
        update.args = (update.args[0], nesterov, *update.args[2:])
        return


def _predict(graph: fx.Graph, param: fx.Node, state: dict[str, fx.Node], compensation: Compensation, index: int,
             hyper_inputs: list[fx.Node], order: dict, update_start: int) -> None:
    """ŵ before the parameter's first forward use; its forward and backward reads take ŵ."""
    readers = [u for u in param.users if order.get(u, len(order)) < update_start and u.op != "output"]
    if not readers:
        return
    first = min(readers, key=order.__getitem__)
    with graph.inserting_before(first):
        if index in compensation.lr_input:
            lr = graph.call_function(aten._local_scalar_dense.default, (hyper_inputs[compensation.lr_input[index]],))
        else:
            lr = compensation.lr[index]
        if compensation.family == "sgd":
            direction = state["momentum_buffer"]
        else:
            direction = _adam_direction(graph, state, compensation, index)
        step = graph.call_function(aten.mul.Tensor, (direction, lr))
        predicted = graph.call_function(aten.sub.Tensor, (param, step))
    predicted.meta["val"] = param.meta.get("val")
    for reader in readers:
        reader.replace_input_with(param, predicted)


def _adam_direction(graph: fx.Graph, state: dict[str, fx.Node], compensation: Compensation, index: int) -> fx.Node:
    """m̂ / (√v̂ + ε) from the state the update will read (bias corrections at the current step count)."""
    beta1, beta2 = compensation.betas[index]
    step = state["step"]
    call = graph.call_function
    correction1 = call(aten.rsub.Scalar, (call(aten.pow.Scalar, (beta1, step)), 1))
    correction2 = call(aten.rsub.Scalar, (call(aten.pow.Scalar, (beta2, step)), 1))
    moment = call(aten.div.Tensor, (state["exp_avg"], correction1))
    scale = call(aten.sqrt.default, (call(aten.div.Tensor, (state["exp_avg_sq"], correction2)),))
    return call(aten.div.Tensor, (moment, call(aten.add.Tensor, (scale, compensation.eps[index]))))

