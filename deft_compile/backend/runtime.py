"""The callable that runs a rewritten backward graph and carries delayed buckets between calls.

Why a wrapper: the backward graph's output arity is fixed by ``aot_autograd``
(one gradient per forward input), but a delayed bucket needs one more value
out (its all-reduce still in flight) and one more in (the previous step's).
The wrapper feeds the previous buffers in, keeps the new ones, and returns
exactly the gradients ``aot_autograd`` expects.
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx

from deft_compile.backend.state import DelayedBuckets


class DelayedBackward:
    """Boxed backward callable (``aot_autograd`` passes the inputs as one list).

    ``first`` runs while nothing is pending (first step, or after ``flush``): it
    launches the delayed buckets and returns ``None`` for their gradients.
    ``steady`` additionally takes the pending buffers, waits them and returns
    them as the delayed gradients.
    """

    def __init__(self, first: fx.GraphModule, steady: fx.GraphModule, num_gradients: int, state: DelayedBuckets) -> None:
        # An instance attribute, not a class one: Dynamo wraps the compiled backward with
        # functools.wraps, which copies the instance __dict__ and would drop a class attribute.
        self._boxed_call = True
        self.first = first
        self.steady = steady
        self.num_gradients = num_gradients
        self.state = state

    def __call__(self, args: list[Any]) -> tuple[Any, ...]:
        pending = self.state.take()
        inputs = list(args)
        args.clear()  # boxed convention: let activations be freed as the graph consumes them
        if pending is None:
            outputs = self.first(*inputs)
        else:
            outputs = self.steady(*inputs, *pending)
        del inputs
        self.state.pending = list(outputs[self.num_gradients :])
        return tuple(outputs[: self.num_gradients])
