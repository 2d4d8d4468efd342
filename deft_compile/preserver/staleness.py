"""Staleness error: how much one update changes a minibatch gradient, measured on the same minibatch.

A delayed bucket applies ḡ_{t−1}, computed at the weights w_{t−1}, where
synchronous training would apply ḡ_t, computed at w_t. The difference has two
parts: a different minibatch (sampling noise, which synchronous SGD has too and
which averages out), and different weights (the systematic error staleness
adds). Comparing consecutive applied gradients mixes both, and on real data the
noise dominates (the ratio tends to √2 for independent minibatches whatever the
staleness). Recomputing the gradient of *the same* minibatch at the weights
before and after one step removes the noise and leaves the second part only::

    e_i = ‖g_i(w_{t+1}; B_t) − g_i(w_t; B_t)‖ / ‖g_i(w_t; B_t)‖

Under compensated staleness (``delayed_update="compensated"``) the late gradient was computed at the
predicted weights ŵ_t (``predicted_weights``), so the error is measured from there:
‖g_i(w_{t+1}; B_t) − g_i(ŵ_t; B_t)‖ / ‖g_i(ŵ_t; B_t)‖.

for the parameters i of a bucket. It costs two extra forward/backward passes
in eager mode, so the Preserver measures it every ``staleness_every`` steps.

The recomputation never disturbs training: buffers (BatchNorm running stats)
are cloned, both passes draw the same dropout masks from a forked RNG (so the
masks cancel), and the live parameters' ``.grad`` are not touched.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch.func import functional_call

from deft_compile.outputs import loss_of

_RECOMPUTE_SEED = 0x5EED

#: optimizer state holding the running second moment each step divides by, per optimizer type
_SECOND_MOMENT = {torch.optim.Adam: "exp_avg_sq", torch.optim.AdamW: "exp_avg_sq", torch.optim.RMSprop: "square_avg",
                  torch.optim.Adagrad: "sum"}


def update_metric(optimizer: torch.optim.Optimizer) -> dict[torch.Tensor, torch.Tensor]:
    """Per parameter with a second moment yet: √P with P = 1 / (√v + eps), the diagonal preconditioner its update
    applies (Adam, AdamW, RMSprop, Adagrad). A step moves p by about −lr·P·g, so Σ P·g² is its first-order
    progress and √P-weighted norms measure gradients as the optimizer uses them. Plain SGD has none (P = 1)."""
    key = next((k for cls, k in _SECOND_MOMENT.items() if isinstance(optimizer, cls)), None)
    if key is None:
        return {}
    metric = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            v = optimizer.state.get(p, {}).get(key)
            if isinstance(v, torch.Tensor) and v.shape == p.shape:
                metric[p] = (v.detach().sqrt() + group.get("eps", 1e-8)).reciprocal().sqrt()
    return metric


def rate_scales(optimizer: torch.optim.Optimizer) -> dict[torch.Tensor, float]:
    """Per parameter whose group runs below its scheduler's base learning rate (``initial_lr``, which every
    ``torch.optim.lr_scheduler`` sets): base / current. A staleness price measured there is scaled up by it: one
    step's gradient change grows with the step's size (to first order Δg ≈ H·Δw, and Δw ∝ lr for SGD and the Adam
    family alike), and a delay adopted in the warm-up runs on at the peak rate. Under decay the scale prices
    staleness above what it costs at the current rate, which keeps a late decision on the synchronous side."""
    scales = {}
    for group in optimizer.param_groups:
        base, lr = group.get("initial_lr"), float(group["lr"])
        if base is not None and 0 < lr < float(base):
            for p in group["params"]:
                scales[p] = float(base) / lr
    return scales


def predicted_weights(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Each parameter at the weights a compensated delayed update computes its gradient at
    (``DeftConfig(delayed_update="compensated")``, ``deft_compile.passes.compensation``): SGD w − lr·v, Adam and
    AdamW w − lr·m̂/(√v̂ + ε) from the current state; w itself where the optimizer holds no state for it yet."""
    group_of = {p: g for g in optimizer.param_groups for p in g["params"]}
    out = []
    for p in params:
        state, group = optimizer.state.get(p, {}), group_of.get(p)
        direction = None
        if group is not None and isinstance(optimizer, torch.optim.SGD):
            direction = state.get("momentum_buffer")
        elif group is not None and "exp_avg" in state:
            step = float(state["step"])
            beta1, beta2 = group["betas"]
            moment = state["exp_avg"] / (1 - beta1 ** step)
            direction = moment / ((state["exp_avg_sq"] / (1 - beta2 ** step)).sqrt() + group["eps"])
        weights = p.detach().clone()
        if direction is not None:
            weights.sub_(direction * group["lr"])
        out.append(weights)
    return out


def seeded_loss(model: torch.nn.Module, tensors: dict[str, torch.Tensor], loss_fn: Callable[..., torch.Tensor] | None,
                args: tuple, kwargs: dict[str, Any], seed: int = _RECOMPUTE_SEED) -> torch.Tensor:
    """The step's loss with ``tensors`` in place of the module's own (``functional_call``), drawing random numbers
    (dropout masks) from ``seed`` in a forked RNG, so training's stream is untouched and two calls with one seed
    draw the same masks. The loss is ``loss_fn(model(args[0]), args[1])`` as in the compiled step, or
    ``model(*args, **kwargs)`` without ``loss_fn``."""
    # manual_seed reseeds every device's generator: fork (save and restore) the CUDA ones too
    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(seed)
        if loss_fn is None:
            return loss_of(functional_call(model, tensors, args, kwargs))
        return loss_of(loss_fn(functional_call(model, tensors, (args[0],), kwargs), args[1]))


def _loss_at(model: torch.nn.Module, names: Sequence[str], params: Sequence[torch.Tensor],
             buffers: dict[str, torch.Tensor], loss_fn: Callable[..., torch.Tensor] | None,
             args: tuple, kwargs: dict[str, Any]) -> torch.Tensor:
    tensors: dict[str, torch.Tensor] = dict(zip(names, params))
    tensors.update({name: buffer.clone() for name, buffer in buffers.items()})
    return seeded_loss(model, tensors, loss_fn, args, kwargs)


def batch_gradients(
    model: torch.nn.Module,
    param_names: Sequence[str],
    values: Sequence[torch.Tensor],
    buffers: dict[str, torch.Tensor],
    loss_fn: Callable[..., torch.Tensor] | None,
    args: tuple,
    kwargs: dict[str, Any],
    watched: Sequence[int],
) -> tuple[torch.Tensor | None, ...]:
    """This batch's gradient of each watched parameter (None where the loss does not use it) with every parameter
    at ``values`` (in ``param_names`` order): one eager forward and backward pass with the step's dropout seed."""
    chosen = set(watched)
    leaves = [v.detach().requires_grad_(i in chosen) for i, v in enumerate(values)]
    with torch.enable_grad():
        loss = _loss_at(model, param_names, leaves, buffers, loss_fn, args, kwargs)
        return torch.autograd.grad(loss, [leaves[i] for i in watched], allow_unused=True)


def same_batch_gradient_change(
    model: torch.nn.Module,
    param_names: Sequence[str],
    before: Sequence[torch.Tensor],
    after: Sequence[torch.Tensor],
    buffers: dict[str, torch.Tensor],
    loss_fn: Callable[..., torch.Tensor] | None,
    args: tuple,
    kwargs: dict[str, Any],
    watched: Sequence[int],
    metric: dict[int, torch.Tensor] | None = None,
    keep: dict[int, torch.Tensor] | None = None,
) -> dict[int, tuple[float, float]]:
    """For each watched parameter index: (‖g(after) − g(before)‖², ‖g(before)‖²) on this batch.

    ``metric`` (by parameter index): elementwise weights the differences and gradients are multiplied by
    before the norms (the optimizer's √P, ``optim_support.update_metric``); plain norms without.

    ``before`` / ``after`` are every parameter's values (in ``param_names``
    order) before and after the step; the loss is ``loss_fn(model(args[0]),
    args[1])`` as in the compiled step (or ``model(*args, **kwargs)`` without
    ``loss_fn``). Squared norms are returned so callers can sum them over
    parameters and ranks before taking the ratio.
    """
    gradients = [batch_gradients(model, param_names, values, buffers, loss_fn, args, kwargs, watched)
                 for values in (before, after)]
    result = {}
    for index, g_before, g_after in zip(watched, *gradients):
        if g_before is None or g_after is None:
            continue
        if keep is not None:
            keep[index] = g_before
        weight = metric.get(index) if metric else None
        change, gradient = g_after - g_before, g_before
        if weight is not None:
            change, gradient = change * weight, gradient * weight
        result[index] = (float(change.double().square().sum()), float(gradient.double().square().sum()))
    return result
