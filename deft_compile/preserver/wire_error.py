"""Measures what a narrower wire would do to this rank's gradients: the numbers ``wire_pricing`` prices.

For each gradient g and each narrower wire dtype it computes the error of the rounding the step performs on the
link, ``ε = q(g / W) − g / W`` (q: round to the dtype and back, as the all-reduce's input is; for the 8-bit wire,
``int8_round_trip``: the blocks of the parameter's gradient as they arrive), with ‖g‖ and ‖g‖²:
one rank's row, summed over ranks by the caller before pricing. Norms are taken in the optimizer's metric
where it has one (``metric_weights``).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from deft_compile.preserver.staleness import _SECOND_MOMENT, batch_gradients, update_metric


def metric_weights(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor],
                   gradients: Sequence[torch.Tensor | None],
                   metric: dict[torch.Tensor, torch.Tensor] | None = None) -> list[torch.Tensor | None]:
    """Per parameter, the elementwise weight its update applies to the gradient's error, √P with
    P = 1 / (√v̂ + eps), for the optimizers that divide by a second moment (Adam, AdamW, RMSprop, Adagrad):
    ``staleness.update_metric``'s (``metric`` where the caller has it), or from g² where the optimizer holds no
    second moment yet (Adam's bias-corrected v̂ after its first step). None for the others (SGD: the plain norm)."""
    if not any(isinstance(optimizer, cls) for cls in _SECOND_MOMENT):
        return [None] * len(params)
    if metric is None:
        metric = update_metric(optimizer)
    eps_of = {p: group.get("eps", 1e-8) for group in optimizer.param_groups for p in group["params"]}
    weights: list[torch.Tensor | None] = []
    for p, g in zip(params, gradients):
        weight = metric.get(p)
        if weight is None and g is not None:
            weight = (g.detach().abs() + eps_of.get(p, 1e-8)).reciprocal().sqrt()
        weights.append(weight)
    return weights


def int8_round_trip(flat: torch.Tensor) -> torch.Tensor:
    """``flat`` (a float32 gradient share, one parameter's) as the 8-bit wire delivers it (``passes/schedule.py``):
    per block of ``INT8_BLOCK`` elements round(g / s) · s with s = max|g| / 127. The step's blocks start at each
    plan slice; a parameter split over several items has its blocks start elsewhere, which this estimate ignores."""
    from deft_compile.planner.plan import INT8_BLOCK

    numel = flat.numel()
    blocks = torch.nn.functional.pad(flat.reshape(-1), (0, (-numel) % INT8_BLOCK)).view(-1, INT8_BLOCK)
    scale = blocks.abs().amax(dim=1, keepdim=True) / 127.0
    safe = torch.where(scale > 0, scale, 1.0)
    return (torch.clamp(torch.round(blocks / safe), -127.0, 127.0) * scale).view(-1)[:numel].view_as(flat)


def cast_error_norms(gradients: Sequence[torch.Tensor | None], world_size: int, dtypes: Sequence[str],
                     weights: Sequence[torch.Tensor | None] | None = None) -> list[float]:
    """One rank's numbers, per gradient: ‖g‖, ‖g‖², then per dtype ‖q(g / W) − g / W‖ (all in float64, weighted
    elementwise by ``weights`` where given; zeros for a missing gradient)."""
    row: list[float] = []
    for index, gradient in enumerate(gradients):
        if gradient is None:
            row.extend([0.0] * (2 + len(dtypes)))
            continue
        share = gradient.detach().float() / world_size
        weight = weights[index] if weights is not None else None
        exact = gradient.detach().double() * (weight.double() if weight is not None else 1.0)
        norm = float(torch.linalg.vector_norm(exact))
        row.extend([norm, norm * norm])
        for dtype in dtypes:
            rounded = int8_round_trip(share) if dtype == "int8" else share.to(getattr(torch, dtype)).to(share.dtype)
            error = rounded.double() - share.double()
            if weight is not None:
                error = error * weight.double()
            row.append(float(torch.linalg.vector_norm(error)))
    return row


def step_gradients(model: torch.nn.Module, names: Sequence[str], params: Sequence[torch.Tensor],
                   buffers: dict[str, torch.Tensor], loss_fn: Callable[..., torch.Tensor] | None, args: tuple,
                   kwargs: dict[str, Any]) -> list[torch.Tensor | None]:
    """This rank's gradient of the step's loss on its inputs at the current weights, eagerly (``staleness.batch_gradients``:
    the buffers cloned, random numbers from a forked generator, no ``.grad`` touched). None for a parameter the
    loss does not reach or that does not train."""
    trained = [i for i, p in enumerate(params) if p.requires_grad]
    grads = batch_gradients(model, names, params, buffers, loss_fn, args, kwargs, trained)
    out: list[torch.Tensor | None] = [None] * len(params)
    for i, g in zip(trained, grads):
        out[i] = g
    return out
