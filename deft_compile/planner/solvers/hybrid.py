"""DeFT's delayed buckets with the synchronous rest on a priority schedule (ByteScheduler's or US-Byte's).

Why: where the Preserver prices staleness high, DeFT keeps few buckets delayed
and the rest synchronous, waited for at the end of backward like DDP, so the
input-side buckets' communication, ready last, is exposed every step. A
priority schedule gives those synchronous parameters DDP's numbers too, but
sends the input side first and waits for each layer's gradients just before
that layer's forward in the next step, so the next forward hides part of what
is left. The two compose because they touch disjoint parameters: the delayed
buckets keep their window, delay, period and link; every other parameter is
carried as the priority solver cut and ordered it for the whole model.

Issue order (FIFO per link): the delayed buckets first, in DeFT's order (they
are issued at the start of the next forward or backward, before any gradient
of that step is ready), then the priority items in their commit order. The
simulator scores the result like any plan (``finish``); the closed loop
measures it (``deft_compile.step.closed_loop``).

Limits: one link (the priority solvers plan one FIFO stream; a multi-link DeFT
plan splits synchronous buckets over links, which this would undo) — a
multi-link profile raises ``ValueError``.
"""

from __future__ import annotations

import dataclasses

from deft_compile.planner.plan import WIRE_FULL, CommItem, Plan, Profile
from deft_compile.planner.solvers.bytescheduler import solve_bytescheduler
from deft_compile.planner.solvers.common import finish
from deft_compile.planner.solvers.usbyte import solve_usbyte

#: priority schedules the synchronous part of a DeFT plan can take (``synchronous_schedule`` option)
PRIORITY_SOLVERS = {"bytescheduler": solve_bytescheduler, "usbyte": solve_usbyte}


def with_priority_synchronous(profile: Profile, plan: Plan, schedule: str) -> Plan:
    """``plan`` (DeFT's) with its synchronous parameters carried by ``schedule``'s priority plan.

    The result keeps the policy and options of ``plan`` plus ``synchronous_schedule``; its metadata records
    the priority plan's options. A plan with no delays or periods becomes the priority plan's items alone. Each
    parameter crosses the link in the wire dtype ``plan`` gave it; a priority item whose parameters ``plan`` sent
    in different dtypes sends full precision.
    """
    if schedule not in PRIORITY_SOLVERS:
        raise ValueError(f"synchronous_schedule must be one of {', '.join(PRIORITY_SOLVERS)}; got {schedule!r}")
    if len(profile.links) != 1:
        raise ValueError(f"synchronous_schedule={schedule!r} plans one link; the profile has {len(profile.links)} "
                         "(DeFT's multi-link plan splits synchronous buckets over the links)")
    stale = sorted((item for item in plan.items if item.delay or item.period > 1), key=lambda item: item.order)
    stale_params = {s.param for item in stale for s in item.slices}
    wire_of = wire_by_param(plan)
    priority = PRIORITY_SOLVERS[schedule](profile, wire_dtype=plan.options.get("wire_dtype", _narrowest(wire_of)))
    rest = []  # the priority items less the delayed parameters (a US-Byte block may cross parameters)
    for item in sorted(priority.items, key=lambda item: item.order):
        slices = tuple(s for s in item.slices if s.param not in stale_params)
        if slices:
            rest.append(dataclasses.replace(item, slices=slices, wire_dtype=_wire_of_slices(slices, wire_of)))
    first_bucket = 1 + max((item.bucket for item in stale), default=-1)
    items: list[CommItem] = []
    for position, item in enumerate(stale + rest):
        bucket = item.bucket if position < len(stale) else first_bucket + position
        items.append(dataclasses.replace(item, id=position, order=position, bucket=bucket))
    options = {**plan.options, "synchronous_schedule": schedule}
    metadata = {**plan.metadata, "synchronous_schedule": {"policy": schedule, "options": dict(priority.options),
                                                          "stale_items": len(stale), "priority_items": len(rest)}}
    return finish(profile, plan.policy, items, options, metadata)


def wire_by_param(plan: Plan) -> dict[int, str]:
    """Each parameter's wire dtype in ``plan`` (a parameter split over items takes its first item's)."""
    wire: dict[int, str] = {}
    for item in plan.items:
        for s in item.slices:
            wire.setdefault(s.param, item.wire_dtype)
    return wire


def _narrowest(wire_of: dict[int, str]) -> str:
    """The 16-bit dtype a priority solver sizes its items in: the first of those ``wire_of`` uses, else float32."""
    narrow = sorted({dtype for dtype in wire_of.values() if dtype != WIRE_FULL})
    return narrow[0] if narrow else WIRE_FULL


def _wire_of_slices(slices, wire_of: dict[int, str]) -> str:
    """An item's wire dtype: its parameters' where they agree, float32 where they differ."""
    wires = {wire_of.get(s.param, WIRE_FULL) for s in slices}
    return wires.pop() if len(wires) == 1 else WIRE_FULL


def priority_plan_with_wire(profile: Profile, policy: str, wire_of: dict[int, str]) -> Plan:
    """``policy``'s priority plan (ByteScheduler's or US-Byte's) with each parameter in the wire dtype ``wire_of``
    gives it (a DeFT plan's choice, ``wire_by_param``): the solver sizes its items in the narrowest dtype used, and
    an item whose parameters differ sends float32. Without a narrowed parameter, the solver's float32 plan."""
    dtype = _narrowest(wire_of)
    plan = PRIORITY_SOLVERS[policy](profile, wire_dtype=dtype)
    if dtype == WIRE_FULL:
        return plan
    items = [dataclasses.replace(item, wire_dtype=_wire_of_slices(item.slices, wire_of)) for item in plan.items]
    return finish(profile, plan.policy, items, dict(plan.options), dict(plan.metadata))
