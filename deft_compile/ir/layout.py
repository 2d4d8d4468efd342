"""The meaning of each input and output of a step graph (kept in ``gm.meta["deft_layout"]``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx as fx


@dataclass
class GraphLayout:
    """What each graph input and output is, in order.

    Inputs: parameters, buffers, optimizer-state tensors (``state_inputs``),
    ``num_user_inputs`` user tensors, ``num_lr_inputs`` learning rates (one
    0-dim float64 tensor per param group, or none), ``num_scaler_inputs`` loss-scaler
    tensors (none, or the scale and its growth tracker), then carries
    (``carry_inputs``: keys such as ``pending:3`` or ``acc:3``, and ``lr:0`` per param group: the learning
    rates of the previous call, for the updates it moved into this one).
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
    num_lr_inputs: int = 0
    num_scaler_inputs: int = 0
    carry_inputs: list[str] = field(default_factory=list)
    carry_outputs: list[str] = field(default_factory=list)
    has_loss: bool = True


def layout_of(gm: fx.GraphModule) -> GraphLayout:
    return gm.meta["deft_layout"]
