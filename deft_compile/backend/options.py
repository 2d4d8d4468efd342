"""The ``options={...}`` of ``torch.compile(model, backend="deft", options=...)``, parsed and checked.

Why a separate parser: ``torch.compile`` hands a non-inductor backend its
options dict unchecked, so a misspelt key would silently give DDP defaults.
Every key is validated here and unknown keys are refused with the list of
known ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import torch
import torch.distributed as dist
import torch.nn as nn

from deft_compile.planner.bucketing import DDP_BUCKET_CAP_BYTES, DDP_FIRST_BUCKET_BYTES, BucketSizes, MiB

KNOWN_OPTIONS = ("bucket_cap_mb", "first_bucket_mb", "delay", "process_group", "broadcast_parameters", "policy", "compiler")
BACKEND_POLICIES = ("wfbp", "deft")


@dataclass(frozen=True)
class BackendOptions(BucketSizes):
    """What the ``deft`` backend does with each graph.

    Attributes:
        bucket_cap_mb: size cap of a gradient bucket (DDP's ``bucket_cap_mb``).
        first_bucket_mb: size cap of the first bucket (DDP: 1 MiB).
        delay_all: every parameter gradient is delayed by one step.
        delayed_ids: ``id()`` of the parameters whose gradients are delayed
            (used when ``delay_all`` is false); ``delayed_params`` keeps them
            alive so an id is never reused by another tensor.
        process_group: the data-parallel group; None means the default group
            when ``torch.distributed`` is initialised.
        broadcast_parameters: broadcast rank 0's parameters the first time a
            graph that uses them is compiled, as DDP's constructor does.
        policy: ``"wfbp"`` (DDP's schedule; delays only where ``delay`` says)
            or ``"deft"`` (each backward graph is profiled at its first call
            and DeFT's knapsack picks the delayed buckets).
        compiler: ``"inductor"`` (forward and backward graphs lowered by
            Inductor, collectives in place) or ``"aten"``; default
            ``$DEFT_COMPILER`` or ``"inductor"``.
    """

    bucket_cap_mb: float = DDP_BUCKET_CAP_BYTES / MiB
    first_bucket_mb: float = DDP_FIRST_BUCKET_BYTES / MiB
    delay_all: bool = False
    delayed_ids: frozenset[int] = frozenset()
    delayed_params: tuple[nn.Parameter, ...] = field(default=(), compare=False, repr=False)
    process_group: dist.ProcessGroup | None = None
    broadcast_parameters: bool = True
    policy: str = "wfbp"
    compiler: str = "inductor"

    def is_delayed(self, param: torch.Tensor) -> bool:
        return self.delay_all or id(param) in self.delayed_ids


def parse_options(options: Mapping[str, Any] | None) -> BackendOptions:
    """Validate ``options`` and turn them into ``BackendOptions``.

    ``delay`` is ``True`` / ``False`` or an iterable of ``nn.Parameter`` objects
    (the parameters whose gradients are applied one step late).
    """
    options = dict(options or {})
    unknown = sorted(set(options) - set(KNOWN_OPTIONS))
    if unknown:
        raise ValueError(
            f"unknown option(s) {', '.join(map(repr, unknown))} for backend 'deft'; "
            f"known options: {', '.join(KNOWN_OPTIONS)}"
        )
    kwargs: dict[str, Any] = {}
    for key in ("bucket_cap_mb", "first_bucket_mb"):
        if key in options:
            value = options[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"option {key!r} must be a positive number of MiB, got {value!r}")
            kwargs[key] = float(value)
    delay = options.get("delay", False)
    if isinstance(delay, bool):
        kwargs["delay_all"] = delay
    else:
        params = _parameters(delay)
        kwargs["delayed_params"] = params
        kwargs["delayed_ids"] = frozenset(id(p) for p in params)
    group = options.get("process_group")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise ValueError(f"option 'process_group' must be a torch.distributed.ProcessGroup, got {type(group).__name__}")
    kwargs["process_group"] = group
    broadcast = options.get("broadcast_parameters", True)
    if not isinstance(broadcast, bool):
        raise ValueError(f"option 'broadcast_parameters' must be a bool, got {broadcast!r}")
    kwargs["broadcast_parameters"] = broadcast
    policy = options.get("policy", "wfbp")
    if policy not in BACKEND_POLICIES:
        raise ValueError(f"option 'policy' must be one of {', '.join(map(repr, BACKEND_POLICIES))}, got {policy!r}")
    if policy == "deft" and "delay" in options:
        raise ValueError("option 'delay' cannot be combined with policy='deft': the knapsack chooses the delays")
    kwargs["policy"] = policy
    from deft_compile.compilers import check_compiler, default_compiler

    compiler = options.get("compiler", None) or default_compiler()
    check_compiler(compiler, source="option 'compiler'")
    kwargs["compiler"] = compiler
    return BackendOptions(**kwargs)


def _parameters(delay: Any) -> tuple[nn.Parameter, ...]:
    if isinstance(delay, (str, bytes, torch.Tensor)) or not isinstance(delay, Iterable):
        raise ValueError(
            "option 'delay' must be True, False or an iterable of nn.Parameter objects "
            f"(e.g. list(model.head.parameters())), got {type(delay).__name__}"
        )
    params = tuple(delay)
    for index, param in enumerate(params):
        if not isinstance(param, nn.Parameter):
            raise ValueError(
                f"option 'delay' entry {index} is a {type(param).__name__}, not an nn.Parameter; "
                "pass the parameter objects themselves (names are not stable inside compiled graphs)"
            )
    return params
