"""Worker of tests/test_closed_loop.py's graph-cache test: plan switches back and forth, counting graph builds."""

from __future__ import annotations

import torch

from deft_compile import DeftConfig, deft_compile
from deft_compile.preserver import PreserverConfig
from workers import POLICY_OPTIONS, reference_case


def switching_run(rank: int, world_size: int, rounds: int, policies: tuple[str, ...], max_cached_graphs: int) -> dict:
    """``deft`` on a slow-link profile (closed loop and Preserver off), switching between the plans of ``policies``
    (``"deft"``: its plan with delays; ``"deft-sync"``: ``max_staleness=0``; others: that solver's plan) every two
    steps, ``rounds`` times round; a flush after every visit. Returns the graph builds after each round, the cache's
    size and the plans' hashes."""
    from deft_compile.planner.solvers import solve

    loss_fn, _ref_model, _ref_optimizer, model, optimizer, batches, profile = reference_case(
        "mlp_dropout_sgd", rank, world_size, 2 * rounds * len(policies))
    step = deft_compile(model, optimizer, loss_fn, policy="deft", profile=profile,
                        config=DeftConfig(plan_options=POLICY_OPTIONS["deft"], max_cached_graphs=max_cached_graphs,
                                          preserver=PreserverConfig(enabled=False)))
    step(*batches[0])
    plans = {}
    for policy in policies:
        if policy == "deft":
            plans[policy] = step.plan
        elif policy == "deft-sync":
            plans[policy] = solve(step.profile, "deft", **{**step.plan.options, "max_staleness": 0,
                                                             "allow_period": False})
        else:
            plans[policy] = solve(step.profile, policy)
    builds, t = [], 1
    for _ in range(rounds):
        for policy in policies:
            step.switch_plan({}, f"test: {policy}", plan=plans[policy])
            for _ in range(2):
                step(*batches[t % len(batches)])
                t += 1
            step.flush()
        builds.append(step.trace_count)
    torch.distributed.barrier()
    return {"builds": builds, "cached": len(step.runner.cache.graphs), "captures": step.capture_count,
            "hashes": sorted({plan.hash() for plan in plans.values()})}
