"""Workers for the integrations: DDP-wrapped models, DCP checkpoints (2 gloo processes each).

Collectives are counted with the torch profiler: gloo records one ``gloo:<collective>`` event per
collective it runs, whoever issued it (DDP's reducer in C++, the step's functional collectives).
"""

from __future__ import annotations

import collections
import contextlib
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
def assert_resumed_as_straight(rank: int, expected: dict, actual: dict) -> None:
    """A resumed ``dcp_checkpoint_run`` holds the straight run's state and pending gradients, bit for bit (and some
    gradients were pending)."""
    assert expected["state"].keys() == actual["state"].keys()
    for name, tensor in expected["state"].items():
        assert torch.equal(tensor, actual["state"][name]), f"rank {rank}: {name} differs after resuming"
    assert expected["pending"].keys() == actual["pending"].keys() and expected["pending"]
    for item, tensor in expected["pending"].items():
        assert torch.equal(tensor, actual["pending"][item]), f"rank {rank}: pending item {item} differs"


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


# -- DDP-wrapped models ----------------------------------------------------------------------------------------
class _EagerMiddle(nn.Module):
    """An MLP whose middle layer runs outside Dynamo's graphs (``torch._dynamo.disable``)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 4)

    @torch._dynamo.disable
    def middle(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.b(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.middle(torch.relu(self.a(x))))


def ddp_wrapped_scenarios(rank: int, world_size: int, steps: int = 3) -> dict:
    """Every way a DistributedDataParallel meets deft_compile, against torch DDP alone on the same data:
    ``deft_compile(DDP(model))``, a DDP submodule, ``DDP(torch.compile(model, backend="deft"))`` (also inside
    ``no_sync()``, as Trainer's accumulation calls it), one with a parameter used outside the compiled graphs,
    and an optimizer inside a wrapper."""
    import deft_compile.backend as backend
    from deft_compile.errors import DeftError, UnsupportedOptimizerError

    make_model, make_optimizer, make_batch, loss_fn, _ddp_kwargs, _exact = CASES["mlp_dropout_sgd"]
    data = torch.Generator().manual_seed(1234 + rank)
    batches = [make_batch(data) for _ in range(steps)]
    report: dict = {}

    def reference():
        torch.manual_seed(rank)  # different weights per rank: DDP's and the step's broadcast make them rank 0's
        model = make_model()
        return model, make_optimizer(model)

    # 1. deft_compile(DDP(model)): trains model.module, DDP's communication off
    ref_model, ref_optimizer = reference()
    ref = DistributedDataParallel(ref_model)
    model, optimizer = reference()
    wrapped = DistributedDataParallel(model)
    step = deft_compile(wrapped, optimizer, loss_fn, policy="wfbp",
                        config=DeftConfig(first_bucket_mb=0.0002, bucket_cap_mb=0.002))
    entries = []
    for t, (inputs, targets) in enumerate(batches):
        torch.manual_seed(100 * rank + t)
        ref_optimizer.zero_grad(set_to_none=True)
        ref_counts = count_collectives(lambda: loss_fn(ref(inputs), targets).backward())
        ref_optimizer.step()
        torch.manual_seed(100 * rank + t)
        counts = count_collectives(lambda: step(inputs, targets))
        entry = _compare(_named_state(model, optimizer), _named_state(ref_model, ref_optimizer))
        entry.update(counts=counts, ddp_counts=ref_counts)
        entries.append(entry)
    report["unwrapped"] = {"steps": entries, "trained": step.model is model, "buckets": len(step.items),
                           "ddp_after": count_collectives(lambda: loss_fn(wrapped(batches[0][0]), batches[0][1]).backward())}

    # 1b. deft_compile(DDP(torch.compile(model))): the module inside both
    model, optimizer = reference()
    nested = DistributedDataParallel(torch.compile(model))
    step = deft_compile(nested, optimizer, loss_fn, policy="wfbp")
    loss = step(*batches[0])
    report["compiled"] = {"trained": step.model is model, "finite": bool(torch.isfinite(loss))}

    # 2. a DDP inside the model
    holder = nn.Sequential(DistributedDataParallel(make_model()))
    try:
        deft_compile(holder, torch.optim.SGD(holder.parameters(), lr=0.1), loss_fn, policy="wfbp")
        report["inner"] = None
    except DeftError as error:
        report["inner"] = str(error)

    # 3. DDP(torch.compile(model, backend="deft")), the last step inside no_sync()
    ref_model, ref_optimizer = reference()
    ref = DistributedDataParallel(ref_model)
    model, optimizer = reference()
    compiled = DistributedDataParallel(torch.compile(model, backend="deft", options={"compiler": "aten"}))
    entries = []
    for t, (inputs, targets) in enumerate(batches):
        for m, o in ((ref, ref_optimizer), (compiled, optimizer)):
            torch.manual_seed(100 * rank + t)
            o.zero_grad(set_to_none=True)
            sync = compiled.no_sync() if (m is compiled and t == steps - 1) else contextlib.nullcontext()
            with sync:
                counts = count_collectives(lambda: loss_fn(m(inputs), targets).backward())
            o.step()
            if m is compiled:
                entry = _compare(_named_state(model, optimizer), _named_state(ref_model, ref_optimizer))
                entry.update(counts=counts, ddp_counts=ref_counts)
                entries.append(entry)
            else:
                ref_counts = counts
    report["ddp_of_compiled"] = {"steps": entries,
                                 "backend_buckets": sum(len(c.buckets) for c in backend.compiled_backwards())}

    # 4. a parameter used outside the compiled graphs: its gradient would not be averaged
    torch._dynamo.reset()
    backend.reset()
    eager = DistributedDataParallel(torch.compile(_EagerMiddle(), backend="deft", options={"compiler": "aten"}))
    try:
        eager(torch.randn(4, 16)).sum().backward()
        report["eager_param"] = None
    except DeftError as error:
        report["eager_param"] = str(error)

    # 5. an optimizer inside a wrapper (accelerate's AcceleratedOptimizer keeps it in .optimizer)
    class Wrapper(torch.optim.Optimizer):
        def __init__(self, inner):
            self.optimizer = inner

    plain = make_model()
    try:
        deft_compile(plain, Wrapper(torch.optim.SGD(plain.parameters(), lr=0.1)), loss_fn)
        report["optimizer_wrapper"] = None
    except UnsupportedOptimizerError as error:
        report["optimizer_wrapper"] = str(error)
    return report
