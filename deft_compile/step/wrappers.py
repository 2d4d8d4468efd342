"""Models and optimizers that reach deft_compile inside a wrapper: DistributedDataParallel, accelerate's optimizer.

deft_compile averages gradients itself, so a ``DistributedDataParallel`` around the
model would average them a second time. The rules:

- ``deft_compile(DDP(model), ...)`` trains ``model`` (``ddp.module``) and turns the DDP
  object's communication off (its gradient all-reduce and its buffer broadcast, which the
  step does itself), saying so once in the log.
- ``deft_compile(model, ...)`` where ``model`` holds a DDP submodule raises ``DeftError``
  naming the submodule: its forward would run inside the traced step.
- ``deft_compile(torch.compile(model), ...)`` (also inside DDP) trains ``model``: the step is
  traced and compiled whole, and tracing through Dynamo's wrapper fails.
- ``torch.compile(model, backend="deft")`` called inside a DDP forward (``DDP(compiled)``,
  what ``transformers.Trainer`` builds around a compiled model) turns that DDP's gradient
  all-reduce off, saying so once; its buffer broadcast stays, since the backend broadcasts
  no buffers. Only the parameters in the graphs the backend compiled are averaged then: a
  parameter of the DDP module that gets a gradient without being in any of them (used by
  eager code between graph breaks) raises ``DeftError`` from that backward, instead of
  training on a local gradient.
- An optimizer that wraps another (accelerate's ``AcceleratedOptimizer``) raises
  ``UnsupportedOptimizerError`` naming the optimizer inside it.

"Off" is for good: ``DDP.no_sync()`` restores ``require_backward_grad_sync`` when it exits,
so the flag alone would come back on; the DDP object's class is swapped for a subclass of
its own whose sync flags read False and ignore writes. With the flag False, DDP's forward
never prepares its reducer for backward, so the reducer's autograd hooks return at once and
nothing is all-reduced (not even the unused-parameter bitmap of
``find_unused_parameters=True``).
"""

from __future__ import annotations

import logging
import threading

import torch
import torch.nn as nn
from torch._dynamo.eval_frame import OptimizedModule
from torch.nn.parallel import DistributedDataParallel

from deft_compile.errors import DeftError, UnsupportedOptimizerError

log = logging.getLogger("deft_compile")

_classes: dict[tuple[type, bool], type] = {}
_lock = threading.Lock()


def communication_off(ddp: DistributedDataParallel) -> bool:
    """Whether ``ddp``'s gradient all-reduce has been turned off here."""
    return getattr(type(ddp), "_deft_communication_off", False)


def turn_off_ddp(ddp: DistributedDataParallel, *, keep_buffer_broadcast: bool, reason: str) -> None:
    """Turn ``ddp``'s gradient all-reduce off for good (and its buffer broadcast unless ``keep_buffer_broadcast``);
    logs ``reason`` once per DDP object."""
    if communication_off(ddp):
        return
    ddp.__class__ = _silenced_class(type(ddp), keep_buffer_broadcast)
    # static_graph=True queues one delayed all-reduce of every gradient in its first backward
    ddp._static_graph_delay_allreduce_enqueued = True
    what = "gradient all-reduce is" if keep_buffer_broadcast else "gradient all-reduce and buffer broadcast are"
    log.warning("%s; DDP's own %s turned off, so gradients are averaged once", reason, what)


class BackendCoverage:
    """The parameters of one DDP module that graphs compiled by backend 'deft' average; a gradient reaching any
    other parameter of the module raises ``DeftError`` (a hook on each parameter not covered yet)."""

    def __init__(self, ddp: DistributedDataParallel) -> None:
        self._names = {p: name for name, p in ddp.module.named_parameters() if p.requires_grad}
        self._covered: set[int] = set()
        self._hooks = {id(p): p.register_post_accumulate_grad_hook(self._uncovered) for p in self._names}

    def cover(self, params) -> None:
        for p in params:
            self._covered.add(id(p))
            hook = self._hooks.pop(id(p), None)
            if hook is not None:
                hook.remove()

    def _uncovered(self, param: torch.Tensor) -> None:
        if id(param) in self._covered:
            return
        raise DeftError(
            f"parameter {self._names.get(param, '?')!r} of the module inside DistributedDataParallel got a gradient "
            f"outside the graphs backend 'deft' compiled (eager code between graph breaks), so it would not be "
            f"averaged: DDP's own all-reduce is off because the backend averages the compiled graphs' gradients. "
            f"Remove the graph break, or train with deft_compile() (transformers: "
            f"deft_compile.integrations.transformers.DeftTrainer)"
        )


def guard_backend_ddp(ddp: DistributedDataParallel) -> BackendCoverage:
    """For backend 'deft' compiling inside ``ddp``'s forward: ``ddp``'s gradient all-reduce off (its buffer
    broadcast kept) and the coverage guard, created once per DDP object."""
    coverage = getattr(ddp, "_deft_backend_coverage", None)
    if coverage is None:
        turn_off_ddp(ddp, keep_buffer_broadcast=True, reason=(
            "backend 'deft' compiles a module inside a DistributedDataParallel and averages its gradients in the "
            "compiled backward"))
        coverage = ddp._deft_backend_coverage = BackendCoverage(ddp)
    return coverage


def _silenced_class(base: type, keep_buffer_broadcast: bool) -> type:
    with _lock:
        key = (base, keep_buffer_broadcast)
        if key not in _classes:
            def always(value: bool) -> property:
                return property(lambda self: value, lambda self, _value: None)

            namespace = {
                "__doc__": f"{base.__name__} whose communication deft_compile turned off (deft_compile.step.wrappers).",
                "_deft_communication_off": True,
                "require_backward_grad_sync": always(False),
                # DDP broadcasts buffers before a forward only while this is True; its forward sets it from the
                # gradient flag, so it is pinned here either way
                "require_forward_param_sync": always(keep_buffer_broadcast),
            }
            _classes[key] = type(f"{base.__name__}WithoutGradientSync", (base,), namespace)
        return _classes[key]


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module ``deft_compile`` trains: ``model.module`` for a DDP (whose communication is turned off), the
    original module of a ``torch.compile``d one (the step is compiled whole, ``DeftConfig.compiler``; tracing
    through Dynamo's wrapper fails), else ``model``; a DDP inside the model raises ``DeftError``."""
    while True:
        if isinstance(model, DistributedDataParallel):
            turn_off_ddp(model, keep_buffer_broadcast=False, reason=(
                f"deft_compile() got a DistributedDataParallel: it trains the module inside "
                f"({type(model.module).__name__}) and averages the gradients itself"))
            model = model.module
        elif isinstance(model, OptimizedModule):
            log.info("deft_compile() got a torch.compile'd module: it traces the module inside (%s) and compiles the "
                     "whole step itself (DeftConfig.compiler)", type(model._orig_mod).__name__)
            model = model._orig_mod
        else:
            break
    inner = [name for name, module in model.named_modules() if isinstance(module, DistributedDataParallel)]
    if inner:
        raise DeftError(
            f"the model holds DistributedDataParallel submodule(s) {', '.join(map(repr, inner))}: deft_compile "
            f"averages the gradients itself, and DDP's forward would run inside the traced step. Pass the model "
            f"without DDP: replace each of them by the module it wraps (its .module)"
        )
    return model


def check_unwrapped_optimizer(optimizer: object) -> None:
    """Raise ``UnsupportedOptimizerError`` for an optimizer that wraps another (accelerate's ``AcceleratedOptimizer``)."""
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer):
        raise UnsupportedOptimizerError(
            f"{type(optimizer).__qualname__} wraps a {type(inner).__qualname__}; deft_compile applies the update "
            f"itself and needs the optimizer inside: pass `optimizer.optimizer`, or do not hand the optimizer to "
            f"accelerator.prepare() (see docs/INTEGRATIONS.md)"
        )
