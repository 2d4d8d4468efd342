"""Plans that do not follow measurement noise: quantised profiles and hysteresis against an incumbent plan.

Two launches of the same model on the same link measure slightly different
numbers (a shared machine, a busy moment, the link's jitter). A knapsack on
those numbers can flip between near-equal bucket sets, and every flip changes
the plan (its hash, its delayed buckets, its periods). Two mechanisms keep it
still; both are pure (no torch, no processes):

* ``quantise_profile``: every time (per-parameter forward/backward/update, the
  extras) and every link number (α, β) is snapped to a geometric grid of ratio
  ``1 + step`` (default 5 %). Numbers that differ by less than the grid mostly
  become equal, so the solver sees the same problem.
* ``solve_stable``: hysteresis. Given the plan in use (``incumbent``, e.g. the
  previous launch's plan from a plan cache, or the plan the closed loop runs),
  the new plan replaces it only when the simulator, on the *new* profile,
  predicts it faster by more than ``hysteresis`` (default 5 %). So a profile
  that moved by noise keeps the plan; one that moved for real changes it.
"""

from __future__ import annotations

import math
from typing import Any

from deft_compile.planner.plan import Plan, Profile

DEFAULT_QUANTUM = 0.05
DEFAULT_HYSTERESIS = 0.05


def _snap(value: float, ratio: float) -> float:
    if value <= 0 or not math.isfinite(value):
        return value
    return ratio ** round(math.log(value) / math.log(ratio))


def quantise_profile(profile: Profile, step: float = DEFAULT_QUANTUM) -> Profile:
    """``profile`` with every time and link number snapped to a geometric grid of ratio ``1 + step``."""
    if step <= 0:
        return profile
    ratio = 1.0 + step
    data = profile.to_dict()
    for param in data["params"]:
        for key in ("forward_ms", "backward_ms", "update_ms"):
            param[key] = _snap(param[key], ratio)
    for link in data["links"]:
        for key in ("alpha_ms", "beta_ms_per_byte"):
            link[key] = _snap(link[key], ratio)
    for key in ("extra_forward_ms", "extra_backward_ms", "message_cpu_ms"):
        data[key] = _snap(data[key], ratio)
    return Profile.from_dict(data)


def predicted_ms(profile: Profile, plan: Plan) -> float:
    """The simulator's iteration time of ``plan`` on ``profile``."""
    from deft_compile.planner.simulator import simulate

    return simulate(profile, plan, record=False, check=False).iteration_ms


def incumbent_fits(profile: Profile, incumbent: Plan) -> bool:
    """Whether ``incumbent`` is a valid plan for ``profile`` (same parameters and links)."""
    try:
        incumbent.validate(profile)
    except Exception:  # noqa: BLE001 - any mismatch means "do not reuse"
        return False
    return True


def solve_stable(
    profile: Profile,
    policy: str,
    *,
    incumbent: Plan | None = None,
    hysteresis: float = DEFAULT_HYSTERESIS,
    quantum: float = DEFAULT_QUANTUM,
    **options: Any,
) -> Plan:
    """``solve`` on the quantised profile, keeping ``incumbent`` unless the new plan is clearly faster.

    The returned plan's ``metadata["stability"]`` says which happened and the
    predicted times compared (on the measured, unquantised profile).
    """
    from deft_compile.planner.solvers import solve

    candidate = solve(quantise_profile(profile, quantum), policy, **options)
    candidate_ms = predicted_ms(profile, candidate)
    candidate.predicted_iteration_ms = candidate_ms
    if incumbent is None or incumbent.policy != policy or not incumbent_fits(profile, incumbent):
        candidate.metadata["stability"] = {"kept_incumbent": False, "quantum": quantum}
        return candidate
    incumbent_ms = predicted_ms(profile, incumbent)
    if incumbent.hash() == candidate.hash() or candidate_ms >= incumbent_ms * (1.0 - hysteresis):
        kept = Plan.from_dict(incumbent.to_dict())
        kept.predicted_iteration_ms = incumbent_ms
        kept.metadata["stability"] = {
            "kept_incumbent": True, "incumbent_ms": incumbent_ms, "candidate_ms": candidate_ms,
            "hysteresis": hysteresis, "quantum": quantum,
        }
        return kept
    candidate.metadata["stability"] = {
        "kept_incumbent": False, "incumbent_ms": incumbent_ms, "candidate_ms": candidate_ms,
        "hysteresis": hysteresis, "quantum": quantum,
    }
    return candidate
