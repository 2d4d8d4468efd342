"""Workers for the integrations: DDP-wrapped models, DCP checkpoints (2 gloo processes each).

Collectives are counted with the torch profiler: gloo records one ``gloo:<collective>`` event per
collective it runs, whoever issued it (DDP's reducer in C++, the step's functional collectives).
"""

from __future__ import annotations

import collections
import copy

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from deft_compile import DeftConfig, deft_compile
from models import CASES
from workers import POLICY_OPTIONS, _compare, _named_state, synthetic_profile


def count_collectives(fn) -> dict[str, int]:
    """Run ``fn()`` under the torch profiler; gloo's collectives by kind (``all_reduce``, ``broadcast``, ...)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return dict(collections.Counter(e.name.split(":", 1)[1] for e in prof.events() if e.name.startswith("gloo:")))


# -- DCP checkpoints -------------------------------------------------------------------------------------------
def dcp_checkpoint_run(rank: int, world_size: int, case: str, start: int, stop: int, load: str | None,
                       save: str | None) -> dict:
    """Train steps ``[start, stop)`` with deft (a delaying plan, the Preserver on), optionally resuming from / saving
    to a DCP checkpoint (``deft_compile.checkpoint``) with an LR scheduler as an extra entry."""
    from deft_compile import checkpoint

    make_model, make_optimizer, make_batch, loss_fn, _ddp_kwargs, _exact = CASES[case]
    torch.manual_seed(0)
    model = make_model()
    optimizer = make_optimizer(model)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    data = torch.Generator().manual_seed(1234 + rank)
    batches = [make_batch(data) for _ in range(stop)]
    scratch = copy.deepcopy(model)
    profile = synthetic_profile(scratch, make_optimizer(scratch), loss_fn, batches[0], world_size)
    step = deft_compile(model, optimizer, loss_fn, policy="deft", profile=profile,
                        config=DeftConfig(plan_options=POLICY_OPTIONS["deft"]))
    if load is not None:
        checkpoint.load(step, load, extra={"scheduler": scheduler})
    for t in range(start, stop):
        torch.manual_seed(100 * rank + t)
        step(*batches[t])
        scheduler.step()
    report = {"pending_before_save": len(step.pending),
              "stateless_params": sum(1 for p in model.parameters() if not optimizer.state.get(p))}
    if save is not None:
        checkpoint.save(step, save, extra={"scheduler": scheduler})
    state = step.state_dict()
    report.update(state={k: v.clone() for k, v in _named_state(model, optimizer).items()},
                  pending={k: v.clone() for k, v in state["pending"].items()}, step_count=step.step_count,
                  preserver=state["preserver"], lr=[g["lr"] for g in optimizer.param_groups],
                  delayed=sum(1 for item in step.plan.items if item.delay))
    return report
