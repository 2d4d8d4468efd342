"""Helpers the solvers share: DDP bucket items, slicing, the wire dtype option, finishing a plan."""

from __future__ import annotations

from typing import Any, Sequence

from deft_compile.planner.plan import (WIRE_FULL, CommItem, ParamSlice, Plan, Profile, check_wire_dtype,
                                      whole_param_slices)
from deft_compile.planner.simulator import simulate


def bucket_slices(profile: Profile, buckets: Sequence[Sequence[int]]) -> list[tuple[ParamSlice, ...]]:
    """Whole-parameter slices per bucket, params in ready order."""
    return [whole_param_slices(profile, bucket) for bucket in buckets]


def split_slices(slices: Sequence[ParamSlice], counts: Sequence[int]) -> list[tuple[ParamSlice, ...]]:
    """Cut the flattened concatenation of ``slices`` into consecutive pieces of ``counts`` elements.

    Why: a bucket shared between links is one flat buffer cut into prefix
    shares; each share must be expressible as element ranges of parameters.
    """
    if sum(counts) != sum(s.count for s in slices):
        raise ValueError("counts must add up to the number of elements")
    pieces: list[tuple[ParamSlice, ...]] = []
    queue = list(slices)
    index = 0
    consumed = 0  # elements of queue[index] already used
    for want in counts:
        piece: list[ParamSlice] = []
        while want > 0:
            current = queue[index]
            take = min(want, current.count - consumed)
            piece.append(ParamSlice(current.param, current.offset + consumed, take))
            consumed += take
            want -= take
            if consumed == current.count:
                index += 1
                consumed = 0
        pieces.append(tuple(piece))
    return pieces


def wire_option(wire_dtype: str) -> dict[str, str]:
    """The plan option recording a narrowed wire; none for full precision, so such plans keep their hashes."""
    return {} if check_wire_dtype(wire_dtype) == WIRE_FULL else {"wire_dtype": wire_dtype}


def finish(profile: Profile, policy: str, items: list[CommItem], options: dict[str, Any],
           metadata: dict[str, Any] | None = None) -> Plan:
    """Validate the plan and attach the simulator's prediction."""
    plan = Plan(policy=policy, items=items, options=options, metadata=metadata or {})
    plan.validate(profile)
    timeline = simulate(profile, plan, record=False, check=False)
    plan.predicted_iteration_ms = timeline.iteration_ms
    return plan
