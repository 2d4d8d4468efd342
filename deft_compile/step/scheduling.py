"""Bridge between the torch-free planner and the graph passes.

The planner speaks of parameters by their index in ``Profile.params``, which
is gradient-ready order; the passes speak of captured parameter indices (model
order). ``ProfileIndex`` keeps the mapping, and ``scheduled_items`` turns a
``Plan`` into the ``ScheduledItem``s that ``passes.schedule`` executes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from deft_compile.step.annotate import StepAnnotation
from deft_compile.step.capture import CapturedStep
from deft_compile.passes.schedule import (
    APPLY_NEXT_FORWARD,
    APPLY_NEXT_UPDATE,
    APPLY_THIS_STEP,
    LAUNCH_START_OF_BACKWARD,
    LAUNCH_START_OF_FORWARD,
    LAUNCH_WHEN_READY,
    DropSpec,
    ScheduledItem,
    Slice,
)
from deft_compile.step.pipeline import CommGroup
from deft_compile.planner.plan import (
    INT8_BLOCK,
    BEFORE_FORWARD_PREFIX,
    UPDATE_AT_NEXT_STEP,
    UPDATE_AT_STEP,
    WINDOW_BACKWARD,
    WINDOW_BACKWARD_NEXT,
    WINDOW_EXPOSED,
    WINDOW_FORWARD_NEXT,
    WIRE_FULL,
    LinkCost,
    ParamProfile,
    Plan,
    Profile,
)


@dataclass(frozen=True)
class ProfileIndex:
    """``ready[i]`` is the captured index of ``Profile.params[i]``; ``layer[c]`` the forward layer of captured ``c``."""

    ready: tuple[int, ...]
    layer: dict[int, int]

    @classmethod
    def of(cls, annotation: StepAnnotation) -> "ProfileIndex":
        ready = tuple(annotation.gradient_ready_order())
        uses = sorted(
            {a.first_forward_use for a in annotation.params if a.first_forward_use is not None},
            key=annotation.order.__getitem__,
        )
        position = {node: i for i, node in enumerate(uses)}
        layer = {
            a.index: position[a.first_forward_use] if a.first_forward_use is not None else 0 for a in annotation.params
        }
        return cls(ready=ready, layer=layer)


def dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def wire_torch_dtype(wire_dtype: str) -> torch.dtype | None:
    """The torch dtype a plan item's ``wire_dtype`` casts to; None for full precision (no cast)."""
    return None if wire_dtype == WIRE_FULL else getattr(torch, wire_dtype)


def static_profile(
    captured: CapturedStep, index: ProfileIndex, links: list[LinkCost], world_size: int, timings: dict | None = None
) -> Profile:
    """A Profile of the gradient-carrying parameters in ready order, with measured times when given.

    ``timings`` maps captured index -> (forward_ms, backward_ms, update_ms) and may
    carry ``"extra_forward_ms"``/``"extra_backward_ms"``.
    """
    timings = timings or {}
    names = captured.model_state.param_names
    params = captured.model_state.params
    entries = []
    for c in index.ready:
        forward_ms, backward_ms, update_ms = timings.get(c, (0.0, 0.0, 0.0))
        entries.append(
            ParamProfile(
                name=names[c],
                numel=params[c].numel(),
                dtype=dtype_name(params[c].dtype),
                forward_ms=forward_ms,
                backward_ms=backward_ms,
                update_ms=update_ms,
                layer=index.layer[c],
                bucket_key=f"{dtype_name(params[c].dtype)}/{params[c].device}",
            )
        )
    return Profile(
        params=entries,
        links=links,
        world_size=world_size,
        extra_forward_ms=float(timings.get("extra_forward_ms", 0.0)),
        extra_backward_ms=float(timings.get("extra_backward_ms", 0.0)),
        name=type(captured.model_state).__name__,
    )


def _drop_spec(plan: Plan, item, index: ProfileIndex, element_bytes: int) -> DropSpec | None:
    """The chunking of ``item`` under a drop rule carried in the plan's options (DLCP's: a deadline and per-item
    chunk budgets): chunk size in elements, budget, and each chunk's layer rank (input side first); None for a
    plan without one."""
    options = plan.options
    if "item_budgets" not in options or options.get("deadline_ms") is None:
        return None
    chunk_numel = max(1, options["chunk_bytes"] // element_bytes)
    layers: list[int] = []
    for s in item.slices:
        layers.extend([index.layer[index.ready[s.param]]] * s.count)
    ranks = tuple(min(layers[start : start + chunk_numel]) for start in range(0, len(layers), chunk_numel))
    return DropSpec(chunk_numel=chunk_numel, budget=int(options["item_budgets"][item.id]),
                    max_loss=float(options["max_loss"]), chunk_rank=ranks)


def scheduled_items(
    plan: Plan, index: ProfileIndex, groups: list[CommGroup], element_bytes: int = 4
) -> list[ScheduledItem]:
    """The plan's items in issue order, on captured parameter indices and process-group names."""
    items = []
    for item in plan.items:
        if item.link >= len(groups):
            raise ValueError(f"plan item {item.id} uses link {item.link} but only {len(groups)} process group(s) exist")
        group = groups[item.link]
        if item.update_at == UPDATE_AT_STEP:
            if item.window not in (WINDOW_BACKWARD, WINDOW_EXPOSED):
                raise ValueError(f"plan item {item.id}: window {item.window!r} with an update in the same step")
            apply, launch = APPLY_THIS_STEP, LAUNCH_WHEN_READY
        elif item.update_at.startswith(BEFORE_FORWARD_PREFIX):
            apply, launch = APPLY_NEXT_FORWARD, LAUNCH_WHEN_READY
        elif item.update_at == UPDATE_AT_NEXT_STEP:
            windows = {WINDOW_FORWARD_NEXT: LAUNCH_START_OF_FORWARD, WINDOW_BACKWARD_NEXT: LAUNCH_START_OF_BACKWARD}
            if item.window not in windows:
                raise ValueError(f"plan item {item.id}: delayed update with window {item.window!r} is not supported")
            apply, launch = APPLY_NEXT_UPDATE, windows[item.window]
        else:
            raise ValueError(f"plan item {item.id}: unknown update point {item.update_at!r}")
        slices = tuple(Slice(index.ready[s.param], s.offset, s.count) for s in item.slices)
        drop = _drop_spec(plan, item, index, element_bytes)
        items.append(
            ScheduledItem(
                id=item.id,
                slices=slices,
                group_name=group.name,
                world_size=group.world_size,
                launch=launch,
                apply=apply,
                period=item.period,
                offset=item.period_offset,
                drop=drop,
                wire_dtype=wire_torch_dtype(item.wire_dtype),
                block=INT8_BLOCK,
            )
        )
    return items


def with_accumulation(items: list[ScheduledItem], steps: int) -> list[ScheduledItem]:
    """Gradient accumulation over ``steps`` calls: an item communicating every K updates communicates every
    ``K * steps`` calls, on the last call of an accumulation cycle (its offset ``o`` becomes ``o * steps +
    steps - 1``); the schedule pass sums local gradients in between and applies their mean."""
    if steps == 1:
        return items
    return [
        dataclasses.replace(item, period=item.period * steps, offset=item.offset * steps + steps - 1) for item in items
    ]
