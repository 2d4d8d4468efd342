"""Plans on a small profile whose wires differ, shared by the closed loop's rule tests and its loop tests. Pure:
planner only, no torch."""

from __future__ import annotations

from deft_compile.planner.plan import LinkCost, ParamProfile, Profile
from deft_compile.planner.solvers import solve
from deft_compile.planner.solvers.hybrid import priority_plan_with_wire, wire_by_param


def kept_wire_plans():
    """A profile of four 1 MB parameters, ``p0``..``p3``, and (DDP's buckets in float16, US-Byte's order in float16,
    the Preserver's synchronous re-plan that keeps ``p3`` float32)."""
    profile = Profile([ParamProfile(f"p{i}", 250_000, "float32", 1.0, 1.0, 0.0, layer=3 - i) for i in range(4)],
                      [LinkCost("l", 0.5, 1e-6)])
    buckets16 = solve(profile, "deft", **_OPTIONS)
    usbyte16 = priority_plan_with_wire(profile, "usbyte", wire_by_param(buckets16))
    return profile, buckets16, usbyte16, replan_keeping(profile, ["p3"])


_OPTIONS = {"first_bucket_bytes": 1_000_000, "bucket_cap_bytes": 1_000_000, "max_staleness": 0,
            "wire_prices": {"float16": {f"p{i}": 1e-4 for i in range(4)}}}


def replan_keeping(profile, kept: list[str]):
    """The Preserver's synchronous re-plan of ``kept_wire_plans``' profile that keeps ``kept`` float32."""
    return solve(profile, "deft", keep_float32=kept, **_OPTIONS)
