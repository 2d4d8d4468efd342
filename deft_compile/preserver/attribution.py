"""Is a loss rise staleness's doing? A paired replay: what ran since the best window, against synchronous.

The Preserver's loss rules see a window mean rise above the best window. That is
harm only if staleness caused it: a learning-rate schedule, a hard stretch of
data or a memorizing model raises the loss of synchronous training just as much
(the suite's VGG-16-BN on 8 random-label batches spikes so under synchronous training).
Comparing with a *later* synchronous window cannot tell the two apart, because
the loss moves between windows by itself. Nor can a replay that starts at the
signal: by then the harm is in the weights, and synchronous steps from there do
no better for a while (measured: docs/CONVERGENCE.md, the staleness benchmark).

So after each loss window that sets a new best, the monitor copies the weights,
buffers and optimizer state before the first stale step (the synchronous steps
before it are the same in both arms), and keeps the minibatches from there on with
the schedule each step ran (the ``Schedule`` of every parameter the plan made stale).
At a signal each rank replays them locally (no communication) twice from that
copy: once with the schedules that ran (the delayed semantics the step runs, local
gradients in place of averaged ones: a delayed parameter applies the previous
step's gradient; under ``delayed_update="compensated"`` it computes that gradient
at the predicted weights and applies it in the Nesterov form of its first moment,
as ``deft_compile.passes.compensation`` does) and once synchronous. Both arms draw the same dropout masks per
step and end with a flush, so both applied every gradient; same start, same
data, same optimizer, and the only difference is the staleness under suspicion.
A stale plan trails synchronous training by its staleness even when harmless (a
delayed bucket applies each gradient one step late), so the stale arm's final
loss is held against the synchronous arm's loss ``lag_steps`` steps before the
end: harm is being worse than that. The losses are taken over the last kept
minibatches (all-rank means, by the caller).

Costs: one copy of the weights and optimizer state, refreshed after every new best
window while stale steps run (never in a synchronous run), and the kept minibatches
(at most ``PreserverConfig.attribution_max_steps``);
after a signal, per arm one more copy, one eager forward/backward per kept step
and forwards to evaluate.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch
from torch.utils._pytree import tree_map

from deft_compile.preserver.staleness import predicted_weights, seeded_loss

#: (delay d, period K) of a parameter under the plan being judged; missing names are synchronous (0, 1)
Schedule = dict[str, tuple[int, int]]

_REPLAY_SEED = 0x5EED_2


class Snapshot:
    """Copies of a model's trained parameters, buffers and its optimizer's hyperparameters and state.

    The replay's optimizer is built fresh from its type, groups and state rather than deep-copied, so hooks a
    user registered on the live optimizer (and whatever they reference) do not run in the replay.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        trained = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        self.names = [name for name, _ in trained]
        self.params = [p.detach().clone() for _, p in trained]
        self.frozen = {name: p.detach().clone() for name, p in model.named_parameters() if not p.requires_grad}
        self.buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
        index = {id(p): i for i, (_, p) in enumerate(trained)}
        self.optimizer_type = type(optimizer)
        self.groups = [({k: v for k, v in group.items() if k != "params"}, [index[id(p)] for p in group["params"]
                                                                              if id(p) in index])
                       for group in optimizer.param_groups]
        self.state = {index[id(p)]: tree_map(_clone, dict(optimizer.state[p]))
                      for group in optimizer.param_groups for p in group["params"]
                      if id(p) in index and p in optimizer.state}

    def shadow(self) -> tuple[list[torch.Tensor], torch.optim.Optimizer]:
        """Fresh leaf copies of the parameters with an optimizer of the same type, groups and state."""
        params = [p.clone().requires_grad_(True) for p in self.params]
        optimizer = self.optimizer_type([{**hyper, "params": [params[i] for i in members]}
                                         for hyper, members in self.groups if members])
        for i, state in self.state.items():
            optimizer.state[params[i]] = tree_map(_clone, state)
        return params, optimizer


def _clone(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def kept_batch(args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """A step's inputs, copied: a loader may refill the same tensors in place."""
    return tree_map(_clone, (tuple(args), dict(kwargs)))


def _tensors(snapshot: Snapshot, params: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Parameters by name, with fresh buffer copies (BatchNorm's running statistics never leak between arms)."""
    tensors = dict(zip(snapshot.names, params))
    tensors.update(snapshot.frozen)
    tensors.update({name: b.clone() for name, b in snapshot.buffers.items()})
    return tensors


def replay(model: torch.nn.Module, snapshot: Snapshot, loss_fn: Callable[..., Any] | None,
           batches: Sequence[tuple[tuple, dict[str, Any]]], schedules: Sequence[Schedule] | Schedule,
           max_grad_norm: float | None = None, evaluate_after: Sequence[int] = (),
           evaluate_on: int | None = None, compensated: bool = False) -> dict[int, float]:
    """Train copies of the snapshot on ``batches``, step t with ``schedules[t]``'s delays and periods (one
    ``Schedule`` for every step, or a list), flush, and return the mean loss of the final weights (key
    ``len(batches)``) and of the weights after each step count in ``evaluate_after``, over the last
    ``evaluate_on`` batches (all by default). An empty schedule is synchronous training.

    A parameter with delay 1 applies the previous step's gradient (nothing in the first step); with
    period K it accumulates K gradients and applies their mean; parameters with nothing to apply have no
    gradient, so the optimizer leaves them and their state alone (as in the compiled step). Where the
    schedule changes, what is pending is applied first, as ``CompiledStep.switch_plan`` flushes.
    ``max_grad_norm`` clips what each update applies, as ``DeftConfig.max_grad_norm`` does. ``compensated``:
    ``delayed_update="compensated"``: a delayed parameter's gradient is taken at its predicted weights
    (``staleness.predicted_weights``) and its update, flushes included, takes the Nesterov form of the first
    moment (``nesterov_correction``). A loss that is not finite is inf.
    """
    schedules = [schedules] * len(batches) if isinstance(schedules, dict) else list(schedules)
    evaluated = batches[-evaluate_on:] if evaluate_on else batches
    params, optimizer = snapshot.shadow()
    pending: dict[int, torch.Tensor] = {}
    accumulated: dict[int, tuple[torch.Tensor, int]] = {}
    losses: dict[int, float] = {}
    compensate: set[int] = set()  # parameters whose pending gradient a compensated update applies
    for t, (args, kwargs) in enumerate(batches):
        if t > 0 and schedules[t] != schedules[t - 1]:
            _flush(optimizer, params, pending, accumulated, max_grad_norm, compensate)
        delayed = {i for i, name in enumerate(snapshot.names) if schedules[t].get(name, (0, 1))[0]}
        leaves = list(params)
        if compensated and delayed:  # forward and backward at the weights the pending update is about to give
            for i, w in zip(sorted(delayed), predicted_weights(optimizer, [params[i] for i in sorted(delayed)])):
                leaves[i] = w.requires_grad_(True)
        with torch.enable_grad():
            loss = seeded_loss(model, _tensors(snapshot, leaves), loss_fn, args, kwargs, _REPLAY_SEED + t)
            grads = torch.autograd.grad(loss, leaves, allow_unused=True)
        applied = set(pending) & compensate
        compensate = delayed if compensated else set()
        for i, (name, p, g) in enumerate(zip(snapshot.names, params, grads)):
            delay, period = schedules[t].get(name, (0, 1))
            apply = pending.pop(i, None)
            if g is not None:
                total, count = accumulated.pop(i, (torch.zeros_like(g), 0))
                total, count = total + g, count + 1
                if count == period:
                    if delay:
                        pending[i] = total / count
                    else:
                        apply = total / count
                else:
                    accumulated[i] = (total, count)
            p.grad = apply
        _update(optimizer, params, max_grad_norm, applied)
        if t + 1 in evaluate_after and t + 1 < len(batches):
            losses[t + 1] = loss_over(model, snapshot, params, loss_fn, evaluated)
    _flush(optimizer, params, pending, accumulated, max_grad_norm, compensate)
    losses[len(batches)] = loss_over(model, snapshot, params, loss_fn, evaluated)
    return losses


def _flush(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor], pending: dict[int, torch.Tensor],
           accumulated: dict[int, tuple[torch.Tensor, int]], max_grad_norm: float | None,
           compensate: set[int] = frozenset()) -> None:
    """Apply whatever is pending or partly accumulated as one update (the pending gradients of ``compensate`` in
    Nesterov form), and forget it."""
    applied = set(pending) & set(compensate)
    for i, (total, count) in accumulated.items():
        pending.setdefault(i, total / count)
    accumulated.clear()
    if not pending:
        return
    for i, p in enumerate(params):
        p.grad = pending.get(i)
    pending.clear()
    _update(optimizer, params, max_grad_norm, applied)


def loss_over(model: torch.nn.Module, snapshot: Snapshot, params: Sequence[torch.Tensor],
               loss_fn: Callable[..., Any] | None, batches: Sequence[tuple[tuple, dict[str, Any]]]) -> float:
    with torch.no_grad():
        losses = [float(seeded_loss(model, _tensors(snapshot, params), loss_fn, args, kwargs, _REPLAY_SEED + t))
                  for t, (args, kwargs) in enumerate(batches)]
    return sum(losses) / len(losses) if all(math.isfinite(v) for v in losses) else math.inf


def lag_steps(schedules: Sequence[Schedule]) -> int:
    """Steps by which training with ``schedules`` trails synchronous training when staleness does no harm: the
    largest mean staleness d + (K − 1)/2 of any parameter in any of them, rounded up. The paired replay
    compares the stale arm with the synchronous one that many steps earlier: the lag is the price the trade
    already charges, not harm."""
    return math.ceil(max((delay + (period - 1) / 2 for schedule in schedules for delay, period in schedule.values()),
                         default=0.0))


def _update(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor], max_grad_norm: float | None,
            compensate: set[int] = frozenset()) -> None:
    """One optimizer step on the gradients set (clipped together), the parameters ``compensate`` in Nesterov form."""
    applied = [p for p in params if p.grad is not None]
    if max_grad_norm is not None and applied:
        torch.nn.utils.clip_grad_norm_(applied, max_grad_norm)
    corrected = [params[i] for i in sorted(compensate) if params[i].grad is not None]
    before = {p: (p.grad.detach().clone(), p.detach().clone()) for p in corrected}
    optimizer.step()
    with torch.no_grad():
        for p, (gradient, weights) in before.items():
            nesterov_correction(optimizer, p, gradient, weights)
    for p in params:
        p.grad = None


def nesterov_correction(optimizer: torch.optim.Optimizer, p: torch.Tensor, gradient: torch.Tensor,
                        weights: torch.Tensor) -> None:
    """Turn the optimizer step just taken on ``p`` (``gradient`` applied at ``weights``) into the Nesterov form
    of its first moment (``deft_compile.passes.compensation``): heavy-ball SGD ``w −= lr·v′`` becomes
    ``w −= lr·(g + β·v′)`` (nothing to do for ``nesterov=True``); Adam and AdamW divide ``β1·m′ + (1 − β1)·g``
    instead of ``m′``, with the same bias corrections and denominator. ``g`` is the gradient as the first moment
    saw it (with Adam's L2 weight decay, SGD's weight decay)."""
    group = next(g for g in optimizer.param_groups if any(q is p for q in g["params"]))
    state = optimizer.state[p]
    if isinstance(optimizer, torch.optim.SGD):
        if group["nesterov"] or not group["momentum"]:
            return
        g = gradient + group["weight_decay"] * weights if group["weight_decay"] else gradient
        p.sub_(group["lr"] * (g + (group["momentum"] - 1.0) * state["momentum_buffer"]))
        return
    beta1, beta2 = group["betas"]
    step = float(state["step"])
    g = gradient
    if not isinstance(optimizer, torch.optim.AdamW) and group["weight_decay"]:
        g = gradient + group["weight_decay"] * weights
    second = state["max_exp_avg_sq"] if group.get("amsgrad") else state["exp_avg_sq"]
    denom = (second / (1 - beta2 ** step)).sqrt() + group["eps"]
    p.sub_(group["lr"] / (1 - beta1 ** step) * (1 - beta1) * (g - state["exp_avg"]) / denom)
