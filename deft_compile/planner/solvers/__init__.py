"""Solvers: turn a Profile into a Plan for one scheduling policy.

``solve(profile, policy, **options)`` dispatches to ``wfbp``,
``bytescheduler``, ``usbyte``, ``deft``, ``dssync`` or ``dlcp``; each module's docstring states its
algorithm, search and assumptions. No torch here.
"""

from __future__ import annotations

from typing import Any, Callable

import dataclasses

from deft_compile.planner.plan import WIRE_DTYPES, WIRE_FULL, Plan, Profile, check_wire_dtype
from deft_compile.planner.simulator import UPDATE_WAITS_FOR_ALL, simulate
from deft_compile.planner.solvers.bytescheduler import solve_bytescheduler
from deft_compile.planner.solvers.deft import solve_deft
from deft_compile.planner.solvers.dlcp import solve_dlcp
from deft_compile.planner.solvers.dssync import dssync_partition, solve_dssync
from deft_compile.planner.solvers.hybrid import PRIORITY_SOLVERS, with_priority_synchronous
from deft_compile.planner.solvers.knapsack import knapsack_01, knapsack_time
from deft_compile.planner.solvers.usbyte import solve_usbyte
from deft_compile.planner.solvers.wfbp import solve_wfbp

SOLVERS: dict[str, Callable[..., Plan]] = {
    "wfbp": solve_wfbp,
    "bytescheduler": solve_bytescheduler,
    "usbyte": solve_usbyte,
    "deft": solve_deft,
    "dssync": solve_dssync,
    "dlcp": solve_dlcp,
}
POLICIES: tuple[str, ...] = tuple(SOLVERS)
# The communication schedulers the papers compare; DS-Sync and DLCP change what is averaged.
SCHEDULING_POLICIES: tuple[str, ...] = ("wfbp", "bytescheduler", "usbyte", "deft")


def solve(profile: Profile, policy: str, **options: Any) -> Plan:
    """Plan for ``policy`` on ``profile``; options go to that policy's solver.

    ``synchronous_schedule`` (``"bytescheduler"`` or ``"usbyte"``, ``policy="deft"`` only) carries the
    parameters DeFT leaves synchronous on that priority schedule (``solvers.hybrid``).

    ``update_waits_for_all=True`` (set by the step for global-norm clipping and loss scaling) is for
    every policy: the plan records it and its prediction lets no update start before every gradient
    it applies arrived. The knapsacks need no change: a delayed bucket they place is hidden before
    the next update anyway, so the extra wait only shows where communication is exposed.

    ``wire_dtype`` (``"float32"``, ``"bfloat16"``, ``"float16"``) asks every item whose gradients narrow
    (float32, float64) to cross the link in that dtype; the solver prices those items at their narrowed
    bytes. ``wire_dtypes`` (the step passes ``DeftConfig.wire_dtypes``) are the dtypes allowed: a
    ``wire_dtype`` outside them is an error. Without ``wire_dtype`` every policy sends full precision,
    except ``deft`` given ``wire_prices`` (dtype -> parameter -> ms per step, the Preserver's): it chooses each
    bucket's wire dtype among the allowed ones by price (``planner.wire``); prices of a dtype not allowed are
    dropped.
    DLCP's chunk selection sends full precision only.
    """
    try:
        solver = SOLVERS[policy]
    except KeyError:
        raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}") from None
    waits_for_all = bool(options.pop(UPDATE_WAITS_FOR_ALL, False))
    synchronous_schedule = options.pop("synchronous_schedule", None) if policy == "deft" else None
    _check_wire(policy, options)
    plan = solver(profile, **options)
    if synchronous_schedule is not None:  # DeFT's delayed buckets, the synchronous rest on a priority schedule
        plan = with_priority_synchronous(profile, plan, synchronous_schedule)
    if waits_for_all:
        plan = dataclasses.replace(plan, options={**plan.options, UPDATE_WAITS_FOR_ALL: True})
        plan.predicted_iteration_ms = simulate(profile, plan, record=False, check=False).iteration_ms
    return plan


def _check_wire(policy: str, options: dict[str, Any]) -> None:
    """Take ``wire_dtypes`` out of ``options`` and check ``wire_dtype`` against it; a full-precision
    ``wire_dtype`` goes too (every solver's default). Without ``wire_dtypes`` every known dtype is allowed: the
    step passes ``DeftConfig.wire_dtypes``, and a plan's recorded options (re-solved by the closed loop) hold only
    a wire and prices that were allowed when it was made."""
    allowed = tuple(options.pop("wire_dtypes", WIRE_DTYPES))
    for dtype in allowed:
        check_wire_dtype(dtype)
    if "keep_float32" in options and policy != "deft":
        raise ValueError(f"keep_float32 keeps buckets of policy 'deft' off its 16-bit wire; policy {policy!r} sends "
                         "one wire_dtype")
    wire_prices = options.pop("wire_prices", None)
    if wire_prices:
        if policy != "deft":
            raise ValueError(f"wire_prices choose each bucket's wire dtype in policy 'deft'; policy {policy!r} sends "
                             "one wire_dtype")
        for dtype in wire_prices:
            check_wire_dtype(dtype)
        allowed_prices = {dtype: prices for dtype, prices in wire_prices.items()
                          if dtype in allowed and dtype != WIRE_FULL}
        if allowed_prices:  # a dtype DeftConfig.wire_dtypes leaves out is never chosen
            options["wire_prices"] = allowed_prices
    wire_dtype = check_wire_dtype(str(options.pop("wire_dtype", WIRE_FULL)))
    if wire_dtype not in allowed:
        raise ValueError(f"wire_dtype={wire_dtype!r} is not among the allowed wire dtypes {list(allowed)} "
                         "(DeftConfig.wire_dtypes)")
    if wire_dtype == WIRE_FULL:
        return
    if policy == "dlcp":
        raise ValueError(f"policy 'dlcp' sends its chunks in full precision; wire_dtype={wire_dtype!r} is not "
                         "supported")
    options["wire_dtype"] = wire_dtype


__all__ = ["POLICIES", "PRIORITY_SOLVERS", "SCHEDULING_POLICIES", "SOLVERS", "dssync_partition", "knapsack_01",
           "knapsack_time", "solve", "solve_bytescheduler", "solve_deft", "solve_dlcp", "solve_dssync", "solve_usbyte",
           "solve_wfbp", "with_priority_synchronous"]
