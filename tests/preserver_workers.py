"""Workers of tests/test_preserver.py that name the delayed semantics they train with: the regression MLP of
``workers._regression_deft`` (momentum SGD near the edge of stability, a plan that delays all but one bucket)
under ``DeftConfig(delayed_update=...)``, and a run that reports the Preserver's trade and admission decisions."""

from __future__ import annotations

import copy

import torch

from deft_compile import DeftConfig, deft_compile
from workers import _mlp_with_delaying_profile, delaying_profile


def regression_step(rank: int, world_size: int, lr: float, steps: int, plan_options: dict, preserver,
                    delayed_update: str, noisy_from: int | None = None):
    """``workers._regression_deft`` with ``delayed_update``: (step, batches)."""
    import torch.nn as nn
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    data = torch.Generator().manual_seed(10 + rank)
    teacher = torch.randn(16, 1, generator=torch.Generator().manual_seed(0))
    batches = []
    for t in range(steps):
        x = torch.randn(64, 16, generator=data)
        noise = 3.0 * torch.randn(64, 1, generator=data) if noisy_from is not None and t >= noisy_from else 0.0
        batches.append((x, x @ teacher + noise))
    scratch = copy.deepcopy(model)
    profile = delaying_profile(scratch, torch.optim.SGD(scratch.parameters(), lr=lr), F.mse_loss, batches[0], world_size)
    config = DeftConfig(plan_options={"first_bucket_bytes": 1, "bucket_cap_bytes": 1, "allow_period": False,
                                      **plan_options}, preserver=preserver, delayed_update=delayed_update)
    return deft_compile(model, optimizer, F.mse_loss, policy="deft", profile=profile, config=config), batches


def semantics_preserver_run(rank: int, world_size: int, lr: float, enabled: bool, steps: int, delayed_update: str,
                            synchronous: bool = False, trade: bool = True, check_every: int = 5) -> dict:
    """``workers.preserver_run`` under ``delayed_update``."""
    from deft_compile.preserver import PreserverConfig

    step, batches = regression_step(
        rank, world_size, lr, steps, {"max_staleness": 0} if synchronous else {},
        PreserverConfig(enabled=enabled, check_every=check_every, staleness_every=check_every, trade=trade),
        delayed_update)
    losses = [float(step(x, y)) for x, y in batches]
    step.flush()
    return {"losses": losses, "history": step.plan_history, "semantics": step.delayed_update,
            "events": [str(e) for e in (step.preserver.history if step.preserver else [])],
            "overheads": step.overheads}


def semantics_attribution_run(rank: int, world_size: int, lr: float, steps: int, noisy_from: int | None,
                              delayed_update: str, preserver_options: dict | None = None) -> dict:
    """``workers.attribution_run`` (the Preserver's loss rules only) under ``delayed_update``."""
    from deft_compile.preserver import PreserverConfig

    step, batches = regression_step(rank, world_size, lr, steps, {},
                                    PreserverConfig(check_every=5, staleness_every=0, trade=False,
                                                    **(preserver_options or {})), delayed_update, noisy_from)
    losses = [float(step(x, y)) for x, y in batches]
    step.flush()
    return {"losses": losses, "history": step.plan_history, "events": [str(e) for e in step.preserver.history],
            "dismissed": [e.reason for e in step.preserver.dismissed], "level": step.preserver.level,
            "delayed_now": sum(1 for item in step.plan.items if item.delay), "overheads": step.overheads}


def trade_run(rank: int, world_size: int, steps: int, delayed_update: str, preserver_options: dict | None = None,
              closed_loop: bool = False, lr: float | None = None, link_ms: float | None = None) -> dict:
    """The seeded ``mlp_dropout_sgd`` model on a slow-link profile whose plan delays buckets, the Preserver's trade
    from a synchronous start, under ``delayed_update``: the plan history, the Preserver's decisions and its final
    state. ``link_ms``: each all-reduce's time in the profile (default 2.5 ms, under the 4 ms of compute per bucket;
    above it the plan solved without prices gives buckets a period)."""
    import dataclasses

    from deft_compile.planner.closed_loop import ClosedLoopConfig
    from deft_compile.planner.plan import LinkCost
    from deft_compile.preserver import PreserverConfig

    model, optimizer, loss_fn, batches, profile = _mlp_with_delaying_profile(rank, world_size, steps)
    if link_ms is not None:
        profile = dataclasses.replace(profile, links=[LinkCost("slow", link_ms, 0.0)])
    if lr is not None:
        for group in optimizer.param_groups:
            group["lr"] = lr
    options = {"start_synchronous": True, **(preserver_options or {})}
    step = deft_compile(model, optimizer, loss_fn, policy="deft", profile=profile,
                        config=DeftConfig(first_bucket_mb=1e-6, bucket_cap_mb=1e-6, delayed_update=delayed_update,
                                          preserver=PreserverConfig(**options),
                                          closed_loop=ClosedLoopConfig(enabled=closed_loop, min_window_ms=0.0,
                                                                       warmup_steps=2, measure_steps=3, duel_rounds=4,
                                                                       duel_steps=3, tolerance=1e9,
                                                                       duel_max_rounds=0, priority_candidate=False)))
    for t in range(steps):
        step(*batches[t])
    step.flush()
    preserver = step.preserver
    return {"semantics": step.delayed_update, "history": [(h["step"], h["reason"]) for h in step.plan_history],
            "delayed": [h["delayed_items"] for h in step.plan_history],
            "events": [str(e) for e in preserver.history], "settled": preserver.settled,
            "settled_why": preserver.settled_why, "probes": [s for s, _ in preserver.staleness_log],
            "admission": preserver.admission, "overheads": step.overheads, "graphs": step.trace_count,
            "state": preserver.state_dict()}
