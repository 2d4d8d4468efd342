"""The meaning of each input and output of a step graph (kept in ``gm.meta["deft_layout"]``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx as fx


@dataclass
class GraphLayout:
    """What each graph input and output is, in order.

    Inputs: parameters, buffers, optimizer-state tensors (``state_inputs``),
    ``num_user_inputs`` user tensors, the hyper-parameters (``hyper_inputs``: (param group, name) of
    each 0-dim float64 input, ``optim_support.hyperparameter_slots``; none where the optimizer's are constants),
    ``num_scaler_inputs`` loss-scaler tensors (none, or the scale and its growth tracker), then carries
    (``carry_inputs``: keys such as ``pending:3`` or ``acc:3``, and ``hp:0`` per hyper-parameter input: its value
    in the previous call, for the updates that call moved into this one).
    Outputs: the loss (unless ``has_loss`` is false), new optimizer-state
    tensors (``state_outputs``), the applied gradients (``gradient_outputs``,
    parameter indices), then carries (``carry_outputs``, keys; those starting with
    ``step:`` are per-step results such as the gradient norm, not carried).
    """

    num_params: int
    num_buffers: int
    state_inputs: list[tuple[int, str]]
    num_user_inputs: int
    state_outputs: list[tuple[int, str]]
    gradient_outputs: list[int]
    hyper_inputs: list[tuple[int, str]] = field(default_factory=list)
    num_scaler_inputs: int = 0
    carry_inputs: list[str] = field(default_factory=list)
    carry_outputs: list[str] = field(default_factory=list)
    has_loss: bool = True

    @property
    def num_hyper_inputs(self) -> int:
        return len(self.hyper_inputs)

    def inputs(self, graph: fx.Graph) -> GraphInputs:
        """``graph``'s placeholders by what they are, in this layout's order."""
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        groups, start = [], 0
        for size in (self.num_params, self.num_buffers, len(self.state_inputs), self.num_user_inputs,
                     self.num_hyper_inputs, self.num_scaler_inputs):
            groups.append(placeholders[start : start + size])
            start += size
        return GraphInputs(*groups, carries=placeholders[start:])


@dataclass(frozen=True)
class GraphInputs:
    """A step graph's placeholders by what they are (``GraphLayout.inputs``): parameters, buffers, optimizer-state
    tensors (in ``state_inputs`` order), user tensors, hyper-parameters, loss-scaler tensors and carries."""

    params: list[fx.Node]
    buffers: list[fx.Node]
    states: list[fx.Node]
    user: list[fx.Node]
    hyper: list[fx.Node]
    scaler: list[fx.Node]
    carries: list[fx.Node]


def layout_of(gm: fx.GraphModule) -> GraphLayout:
    return gm.meta["deft_layout"]
