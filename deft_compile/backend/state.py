"""Delayed-gradient state kept across calls of compiled backward graphs, and ``flush``.

Why state outside the graph: in delayed mode the backward of step t returns
the averaged gradient of step t-1, whose all-reduce was launched by the
previous call. That in-flight buffer has to live somewhere between calls, and
has to be reachable from ``flush(model)`` after the last step. It is keyed by
the bucket layout (which parameters, in which buckets), not by graph, so a
recompiled graph (new input shape, say) with the same layout picks up the
gradients the previous graph left in flight.
"""

from __future__ import annotations

import threading
import weakref
from typing import Iterable

import torch
import torch.nn as nn
from torch.utils.weak import WeakIdKeyDictionary

from deft_compile.errors import DeftError

_c10d = torch.ops._c10d_functional


class DelayedStateError(DeftError):
    """A recompiled graph would drop delayed gradients still in flight."""


class DelayedBuckets:
    """The in-flight averaged gradients of one layout of delayed buckets.

    ``pending`` is None before the first backward (and after ``flush``), else
    one flat buffer per delayed bucket, possibly still being all-reduced.
    """

    def __init__(self, buckets: list[list[nn.Parameter]], collective: bool) -> None:
        self._params = [[weakref.ref(p) for p in bucket] for bucket in buckets]
        self.collective = collective
        self.pending: list[torch.Tensor] | None = None
        self.layout = layout_key(buckets)

    def parameters(self) -> list[nn.Parameter]:
        params = [ref() for bucket in self._params for ref in bucket]
        return [p for p in params if p is not None]

    def take(self) -> list[torch.Tensor] | None:
        """Hand the pending buffers to the caller (who waits them) and forget them."""
        pending, self.pending = self.pending, None
        return pending

    def flush(self) -> dict[nn.Parameter, torch.Tensor]:
        """Wait every pending bucket and split it into per-parameter averaged gradients."""
        pending = self.take()
        if pending is None:
            return {}
        result: dict[nn.Parameter, torch.Tensor] = {}
        for refs, flat in zip(self._params, pending):
            if self.collective:
                flat = _c10d.wait_tensor.default(flat)
            params = [ref() for ref in refs]
            if any(p is None for p in params):
                continue  # the model is gone; nothing to apply the gradient to
            pieces = torch.split(flat, [p.numel() for p in params])
            for param, piece in zip(params, pieces):
                result[param] = piece.view(param.shape)
        return result


def layout_key(buckets: list[list[nn.Parameter]]) -> tuple:
    return tuple(tuple((id(p), tuple(p.shape), p.dtype) for p in bucket) for bucket in buckets)


_lock = threading.Lock()
_by_layout: dict[tuple, DelayedBuckets] = {}
# By identity: tensors' __eq__ is elementwise, so ordinary weak dictionaries cannot hold them.
_owner: WeakIdKeyDictionary = WeakIdKeyDictionary()


def state_for(buckets: list[list[nn.Parameter]], collective: bool) -> DelayedBuckets:
    """The shared state of this bucket layout, created on first use.

    A layout that takes over parameters owned by another layout with gradients
    still in flight would lose them; that is refused with a clear error.
    """
    key = layout_key(buckets)
    with _lock:
        state = _by_layout.get(key)
        if state is not None:
            return state
        for bucket in buckets:
            for param in bucket:
                previous = _owner.get(param)
                if previous is not None and previous.pending is not None:
                    raise DelayedStateError(
                        "a new graph buckets delayed parameters differently from the graph that has their "
                        "gradients in flight; call deft_compile.backend.flush(model) and apply its gradients "
                        "before the step that recompiles (or keep the parameter order and sizes fixed)"
                    )
        state = DelayedBuckets(buckets, collective)
        _by_layout[key] = state
        for bucket in buckets:
            for param in bucket:
                _owner[param] = state
        return state


def flush(parameters: nn.Module | Iterable[nn.Parameter], *, set_grad: bool = True) -> dict[nn.Parameter, torch.Tensor]:
    """Wait the delayed all-reduces still in flight and return their averaged gradients.

    After the last training step the averaged gradient of that step is still
    pending (it would be applied by the next backward). ``flush`` waits it and
    returns ``{param: averaged gradient}``; with ``set_grad`` (default) it also
    writes each into ``param.grad`` (replacing what was there), so
    ``optimizer.zero_grad(); flush(model); optimizer.step()`` applies it and no
    gradient is lost. Parameters without a pending gradient are not touched.
    The next backward after a flush starts the delay afresh (returns no
    gradient for delayed parameters), so each gradient is applied exactly once.
    """
    params = list(parameters.parameters()) if isinstance(parameters, nn.Module) else list(parameters)
    with _lock:
        states: list[DelayedBuckets] = []
        for param in params:
            state = _owner.get(param)
            if state is not None and state not in states:
                states.append(state)
    result: dict[nn.Parameter, torch.Tensor] = {}
    for state in states:
        result.update(state.flush())
    if set_grad:
        with torch.no_grad():
            for param, grad in result.items():
                param.grad = grad.clone()
    return result


def reset() -> None:
    """Forget all delayed state (pending gradients are dropped, not applied); for tests and restarts."""
    with _lock:
        _by_layout.clear()
        _owner.clear()
