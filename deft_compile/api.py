"""``deft_compile(model, optimizer, ...)``: the main entry point."""

from __future__ import annotations

import os
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from deft_compile.config import DeftConfig
from deft_compile.planner.plan import Profile
from deft_compile.step.runtime import CompiledStep
from deft_compile.step.wrappers import check_unwrapped_optimizer, unwrap_model


def deft_compile(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    *,
    policy: str = "deft",
    config: DeftConfig | None = None,
    process_group: dist.ProcessGroup | None = None,
    dump_dir: str | os.PathLike | None = None,
    profile: Profile | None = None,
) -> CompiledStep:
    """Compile a whole data-parallel training step of ``model`` and ``optimizer``.

    Returns a callable ``step``. ``step(inputs, targets)`` computes
    ``loss_fn(model(inputs), targets)`` when ``loss_fn`` is given; otherwise
    ``step(*args, **kwargs)`` expects ``model(*args, **kwargs)`` to return a
    scalar loss. Each call runs forward, backward, averages gradients across the
    ranks of ``process_group`` (default: the world group) and applies the
    optimizer update, in one captured graph; it returns the detached local loss.

    The live parameters, buffers and optimizer state are updated in place, so
    ``model.state_dict()`` and ``optimizer.state_dict()`` keep working. With no
    initialised process group (or a world size of 1) training is local and no
    collective runs. At construction, parameters and buffers are broadcast from
    rank 0, as ``DistributedDataParallel`` does.

    Args:
        model: the module to train. A ``DistributedDataParallel`` is unwrapped (the step trains its
            ``.module``) and its own communication turned off, logged once; a DDP submodule raises
            ``DeftError`` (``deft_compile.step.wrappers``).
        optimizer: a per-parameter optimizer over ``model``'s parameters (SGD,
            Adam, AdamW, RMSprop, Adagrad).
        loss_fn: optional ``loss_fn(output, targets) -> scalar``.
        policy: communication schedule: ``"deft"`` (default: DDP buckets,
            delayed where the knapsacks say it hides communication, update
            periods when communication exceeds compute, extra links, watched
            by the Preserver), ``"wfbp"`` (PyTorch DDP's schedule: same
            numbers as DDP), ``"bytescheduler"`` or ``"usbyte"`` (see
            ``docs/POLICIES.md``). On the first step the step is profiled
            (compute and link) unless the plan needs no times (``wfbp``).
        config: bucket sizes, buffer broadcasting and checks (``DeftConfig``).
        process_group: the data-parallel group.
        dump_dir: if set (or the environment variable ``DEFT_DUMP`` is), the
            readable graph after every pass is written there.
        profile: a saved ``deft_compile.planner.plan.Profile`` to plan from instead of
            measuring on the first step.
    """
    model = unwrap_model(model)
    check_unwrapped_optimizer(optimizer)
    if dump_dir is None and os.environ.get("DEFT_DUMP"):
        dump_dir = os.environ["DEFT_DUMP"]
    return CompiledStep(
        model,
        optimizer,
        loss_fn,
        policy=policy,
        config=config if config is not None else DeftConfig(),
        process_group=process_group,
        dump_dir=dump_dir,
        profile=profile,
    )
