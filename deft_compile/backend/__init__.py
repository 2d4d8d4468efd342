"""``torch.compile(model, backend="deft")``: DDP-style gradient averaging inside Dynamo's backward graphs.

Registered once, through the ``torch_dynamo_backends`` entry point
(``deft = "deft_compile.backend:deft_backend"``); this module registers
nothing itself, because torch refuses a second registration of a name.

Per graph Dynamo hands over, ``aot_autograd`` produces a forward and a
backward graph. The forward runs unchanged. In the backward, the gradients of
the parameters (the forward inputs that are ``nn.Parameter``s) are bucketed in
the order the graph produces them, each bucket is averaged by an async
all-reduce launched right after its last gradient, and waited just before the
graph returns. The optimizer is not in any graph: the user's
``optimizer.step()`` applies what backward returned. See docs/BACKEND.md.

Delayed buckets (``options={"delay": True}`` or a list of parameters) return
the averaged gradient of the previous backward; the first backward returns no
gradient for them (``param.grad`` stays None, so the optimizer leaves them,
their momentum and their weight decay alone). ``flush(model)`` returns the last
pending gradients.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch.utils.weak import WeakIdKeyDictionary

from deft_compile.backend.options import BackendOptions, parse_options
from deft_compile.backend.passes import (
    BackwardBucket,
    clone_graph_module,
    gradient_outputs,
    gradient_ready_order,
    insert_gradient_allreduce,
    plan_buckets,
)
from deft_compile.backend.planning import ForwardTimer, PlannedBackward
from deft_compile.backend.runtime import DelayedBackward
from deft_compile.backend.state import DelayedStateError, flush, reset as _reset_state, state_for
from deft_compile.step.distributed import broadcast_from_rank0, resolve_group
from deft_compile.errors import DeftError
from deft_compile.step.lowering import LazyLowered, lower
from deft_compile.step.pipeline import CommGroup
from deft_compile.step.wrappers import guard_backend_ddp

__all__ = ["deft_backend", "flush", "reset", "DelayedStateError", "BackendGraphError", "CompiledBackward", "compiled_backwards"]


log = logging.getLogger("deft_compile")


class BackendGraphError(DeftError):
    """The backward graph does not have the shape this backend relies on (one output per forward input)."""


_broadcast_lock = threading.Lock()
_broadcast_done: WeakIdKeyDictionary = WeakIdKeyDictionary()  # parameters already broadcast (by identity)
_compiled: deque[CompiledBackward] = deque(maxlen=64)  # recent ones only: each holds a graph module


@dataclass(frozen=True)
class CompiledBackward:
    """What the backend did to one backward graph: its buckets and the rewritten (steady-state) graph."""

    buckets: list[BackwardBucket]
    graph_module: fx.GraphModule


def deft_backend(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    options: Mapping[str, Any] | None = None,
    mode: str | None = None,
) -> Callable[..., Any]:
    """The Dynamo backend: compile one captured graph (see module docstring).

    ``options`` are ``torch.compile``'s ``options=`` (``bucket_cap_mb``,
    ``first_bucket_mb``, ``delay``, ``process_group``, ``broadcast_parameters``).
    """
    if mode not in (None, "default"):
        raise ValueError(f"backend 'deft' has no mode {mode!r}; leave mode unset and pass options= instead")
    opts = parse_options(options)
    group, process_group = resolve_group(opts.process_group)
    # aot_module_simplified's forward inputs: the module's own parameters and buffers, then the inputs.
    full_args: list[Any] = [
        *(p for _, p in gm.named_parameters(remove_duplicate=False)),
        *(b for _, b in gm.named_buffers(remove_duplicate=False)),
        *example_inputs,
    ]
    params = {i: x for i, x in enumerate(full_args) if isinstance(x, nn.Parameter) and x.requires_grad}
    num_inputs = len(full_args)
    ddp = DistributedDataParallel._get_active_ddp_module()  # DDP(compiled): Dynamo compiles inside DDP's forward
    if ddp is not None and group is not None:
        guard_backend_ddp(ddp).cover(params.values())  # DDP's own all-reduce off (deft_compile.step.wrappers)
    del full_args  # the backward compiler may run lazily: keep parameters, not the example batch
    if process_group is not None and opts.broadcast_parameters:
        _broadcast_once(list(params.values()), process_group)
    forwards: list[ForwardTimer] = []

    def fw_compiler(fw: fx.GraphModule, fw_inputs: Sequence[Any]) -> Callable[..., Any]:
        forward = ForwardTimer(_lowered(fw, fw_inputs, opts.compiler, "forward"))
        forwards.append(forward)
        return forward

    def plain_bw_compiler(bw: fx.GraphModule, bw_inputs: Sequence[Any]) -> Callable[..., Any]:
        return _lowered(bw, bw_inputs, opts.compiler, "backward")

    planned = opts.policy == "deft" and group is not None
    if not params or (group is None and not any(opts.is_delayed(p) for p in params.values())):
        return aot_autograd(fw_compiler=fw_compiler, bw_compiler=plain_bw_compiler)(gm, example_inputs)

    def bw_compiler(bw: fx.GraphModule, _bw_inputs: Sequence[Any]) -> Callable[..., Any]:
        if planned:
            forward = forwards[-1] if forwards else None
            return PlannedBackward(bw, params, opts, process_group, forward,
                                   lambda chosen: compile_backward(bw, num_inputs, params, chosen, group))
        return compile_backward(bw, num_inputs, params, opts, group)

    return aot_autograd(fw_compiler=fw_compiler, bw_compiler=bw_compiler)(gm, example_inputs)


def compile_backward(
    bw: fx.GraphModule,
    num_inputs: int,
    params: Mapping[int, nn.Parameter],
    opts: BackendOptions,
    group: CommGroup | None,
) -> Callable[..., Any]:
    """Rewrite one backward graph: bucket its parameter gradients and average them (see passes).

    ``params`` maps forward-input positions to the parameters there; the
    backward graph returns the gradient of forward input i at output i.
    """
    outputs = gradient_outputs(bw)
    if len(outputs) != num_inputs:
        raise BackendGraphError(
            f"the backward graph returns {len(outputs)} values for {num_inputs} forward inputs; "
            "backend 'deft' cannot tell which are parameter gradients (an aot_autograd wrapper such as "
            "input deduplication or effect tokens changed the calling convention)"
        )
    ready = gradient_ready_order(bw, sorted(params))
    in_order = [params[p] for p in ready]
    buckets = plan_buckets(
        ready,
        [p.numel() * p.element_size() for p in in_order],
        [(p.dtype, p.device) for p in in_order],
        [opts.is_delayed(p) for p in in_order],
        first_bucket_bytes=opts.first_bucket_bytes,
        bucket_cap_bytes=opts.bucket_cap_bytes,
    )
    group_name = group.name if group is not None else None
    world_size = group.world_size if group is not None else 1
    delayed = [b for b in buckets if b.delayed]
    if not delayed:
        steady = insert_gradient_allreduce(bw, buckets=buckets, group_name=group_name, world_size=world_size, first_step=False)
        _compiled.append(CompiledBackward(buckets, steady))
        return make_boxed_func(LazyLowered(steady, opts.compiler, "backward"))
    state = state_for([[params[p] for p in b.positions] for b in delayed], collective=group is not None)
    first = insert_gradient_allreduce(
        clone_graph_module(bw), buckets=buckets, group_name=group_name, world_size=world_size, first_step=True
    )
    steady = insert_gradient_allreduce(bw, buckets=buckets, group_name=group_name, world_size=world_size, first_step=False)
    _compiled.append(CompiledBackward(buckets, steady))
    return DelayedBackward(LazyLowered(first, opts.compiler, "first backward"),
                           LazyLowered(steady, opts.compiler, "backward"), len(outputs), state)


def compiled_backwards() -> list[CompiledBackward]:
    """The last (up to 64) backward graphs rewritten in this process, oldest first, for inspection and tests."""
    return list(_compiled)


def reset() -> None:
    """Forget delayed state, broadcast bookkeeping and plans (call with ``torch._dynamo.reset()``)."""
    _reset_state()
    with _broadcast_lock:
        _broadcast_done.clear()
    _compiled.clear()


def _lowered(gm: fx.GraphModule, inputs: Sequence[Any], compiler: str, label: str) -> Callable[..., Any]:
    """A boxed callable running ``gm`` lowered with ``compiler`` (Inductor: compiled now, from the fake inputs)."""
    if compiler == "aten":
        return make_boxed_func(gm.forward)
    lowered = lower(gm, inputs, compiler)
    if lowered.compiler == "inductor":
        log.info("Inductor compiled %s graph (%d nodes) in %.2f s", label, len(gm.graph.nodes), lowered.compile_seconds)
    return make_boxed_func(lowered.run)


def _broadcast_once(params: Sequence[nn.Parameter], process_group: dist.ProcessGroup) -> None:
    """Rank 0's values into every rank's parameters, the first time a graph uses them (DDP's constructor).

    Runs at compile time, before the graph first executes. Every rank compiles
    the same graphs in the same order, so the broadcasts match up.
    """
    with _broadcast_lock:
        todo = [p for p in params if p not in _broadcast_done]
        for p in todo:
            _broadcast_done[p] = True
    if todo:
        broadcast_from_rank0(todo, process_group)
