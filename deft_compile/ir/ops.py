"""Marker ops that the capture puts into the step graph.

Passes find the places they rewrite by matching these op overloads, never by node
names. A marker is an identity at run time; ``passes.markers.strip_markers``
replaces every marker that is left once the other passes ran.

* ``deft.gradient(grad, index)``: ``grad`` is the gradient of parameter ``index``
  (position in the captured parameter list), as the optimizer will read it.
* ``deft.phase(x, name)``: the end of a phase ("forward") in program order; ``x``
  is only there to give the node a data dependency on the phase's result.
"""

from __future__ import annotations

import torch
from torch import Tensor


@torch.library.custom_op("deft::gradient", mutates_args=())
def gradient(grad: Tensor, index: int) -> Tensor:
    return grad.clone()


@gradient.register_fake
def _gradient_fake(grad: Tensor, index: int) -> Tensor:
    return torch.empty_like(grad)


@torch.library.custom_op("deft::phase", mutates_args=())
def phase(x: Tensor, name: str) -> Tensor:
    return x.clone()


@phase.register_fake
def _phase_fake(x: Tensor, name: str) -> Tensor:
    return torch.empty_like(x)


GRADIENT = torch.ops.deft.gradient.default
PHASE = torch.ops.deft.phase.default
MARKERS = (GRADIENT, PHASE)
