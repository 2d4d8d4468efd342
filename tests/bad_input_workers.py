"""Worker functions of the bad-input matrix (tests/test_bad_inputs.py): what a user may hand the step that DDP either
takes (then the step must give DDP's numbers) or that must be refused with a clear ``DeftError`` on every rank."""

from __future__ import annotations

import copy
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from deft_compile import DeftConfig, deft_compile
from deft_compile.preserver import PreserverConfig
from models import CASES
from workers import (
    POLICY_OPTIONS,
    PlanReference,
    _compare,
    _named_state,
    _step_beside_ddp,
    plan_schedule_by_name,
    synthetic_profile,
)

CASE = "mlp_dropout_sgd"


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def batch_sizes(rank: int, steps: int, pattern: str) -> list[int]:
    """Per-rank batch sizes: ``uneven``: rank 1's batch shrinks from 8 to 6 at step 3 and grows back at step 5 (a
    retrace on one rank only, with delayed gradients pending); ``last``: every rank's last batch is 5."""
    if pattern == "uneven":
        return [6 if rank == 1 and t in (3, 4) else 8 for t in range(steps)]
    if pattern == "last":
        return [5 if t == steps - 1 else 8 for t in range(steps)]
    raise ValueError(pattern)


def _batches(rank: int, steps: int, pattern: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    data = torch.Generator().manual_seed(1234 + rank)
    return [(torch.randn(n, 16, generator=data), torch.randint(0, 4, (n,), generator=data))
            for n in batch_sizes(rank, steps, pattern)]


def _case_step(rank: int, world_size: int, policy: str, compiler: str | None, batches, **config):
    """``CASE``'s model twice (reference, deft) and the deft step of ``policy`` on a synthetic profile."""
    make_model, make_optimizer, _make_batch, loss_fn, _ddp_kwargs, _exact = CASES[CASE]
    torch.manual_seed(0)
    base = make_model()
    ref_model, deft_model = copy.deepcopy(base), copy.deepcopy(base)
    ref_optimizer, deft_optimizer = make_optimizer(ref_model), make_optimizer(deft_model)
    scratch = copy.deepcopy(base)
    profile = synthetic_profile(scratch, make_optimizer(scratch), loss_fn, batches[0], world_size)
    solver = "deft" if policy.startswith("deft") else policy
    step = deft_compile(deft_model, deft_optimizer, loss_fn, policy=solver, profile=profile,
                        config=DeftConfig(plan_options=POLICY_OPTIONS.get(policy, {}),
                                          **({"compiler": compiler} if compiler else {}), **config))
    return loss_fn, (ref_model, ref_optimizer), (deft_model, deft_optimizer), step


def shapes_beside_ddp(rank: int, world_size: int, policy: str, pattern: str, steps: int,
                      compiler: str | None = None) -> dict:
    """Batches whose size differs across ranks or shrinks at the end: ``wfbp``/``bytescheduler`` against torch DDP
    (updates deferred to the next forward compared with DDP's previous step), ``deft`` (delays) against the eager
    reference of its plan, which averages the ranks' gradients as DDP does. After ``flush`` everything against
    the last step. ``deft`` on an Inductor compiler also measures its bound (tests/bounds.py, ``compiled``): a second
    reference of the plan with its model compiled by ``torch.compile`` (Inductor, Dropout from ATen's generator),
    against the eager one, on the same batch sizes and Dropout seeds, per step and after ``flush``."""
    batches = _batches(rank, steps, pattern)
    loss_fn, (ref_model, ref_optimizer), (deft_model, deft_optimizer), step = _case_step(
        rank, world_size, policy, compiler, batches, preserver=PreserverConfig(enabled=False))
    report, compiled_report = [], []
    if policy.startswith("deft"):
        sides = [(ref_model, ref_optimizer)]
        if step.config.compiler != "aten":
            from default_route_workers import _draw_dropout_like_eager

            _draw_dropout_like_eager()
            compiled_model = copy.deepcopy(ref_model)
            sides.append((compiled_model, CASES[CASE][1](compiled_model)))
            compiled_model.compile()  # in place: the same parameter names
        references = []
        for t, (inputs, targets) in enumerate(batches):
            torch.manual_seed(100 * rank + t)
            step(inputs, targets)
            pending = len(step.pending)
            if not references:  # the plan exists once the first step ran
                references = [PlanReference(model, optimizer, loss_fn, plan_schedule_by_name(step), world_size,
                                            local=step.config.delayed_update == "local",
                                            compensated=step.config.delayed_update == "compensated")
                              for model, optimizer in sides]
            for reference in references:
                torch.manual_seed(100 * rank + t)
                reference.step(inputs, targets)
            eager = _named_state(ref_model, ref_optimizer)
            report.append({**_compare(_named_state(deft_model, deft_optimizer), eager),
                           "step": t, "pending": pending, "traces": step.trace_count})
            compiled_report += [{**_compare(_named_state(*side), eager), "step": t} for side in sides[1:]]
        step.flush()
        for reference in references:
            reference.flush()
        compiled_report += [{**_compare(_named_state(*side), _named_state(ref_model, ref_optimizer)), "step": "flush"}
                            for side in sides[1:]]
    else:
        ddp = DistributedDataParallel(ref_model)
        for t, (inputs, targets) in enumerate(batches):
            entry, deferred = _step_beside_ddp(step, rank, t, inputs, targets, loss_fn, ddp, ref_model, ref_optimizer,
                                               deft_model, deft_optimizer)
            report.append({**entry, "step": t, "pending": len(deferred), "traces": step.trace_count})
        step.flush()
    final = _compare(_named_state(deft_model, deft_optimizer), _named_state(ref_model, ref_optimizer))
    return {"steps": report, "final": final, "compiled": compiled_report, "compiler": step.compiler,
            "params": {n: p.detach().clone() for n, p in deft_model.named_parameters()},
            "delayed": sum(1 for item in step.plan.items if item.delay) if step.plan is not None else None}


def differing_models(rank: int, world_size: int) -> dict:
    """Rank 1's model has other values (DDP broadcasts rank 0's at construction; so does the step); then a model
    whose ``requires_grad`` differs on rank 1, and an optimizer whose learning rate differs (refused)."""
    report = {}
    torch.manual_seed(rank)  # other initial values on each rank
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))  # rank 0's values, everywhere
    step = deft_compile(model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy, policy="wfbp")
    report["values_broadcast"] = all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters()))
    step(torch.randn(4, 4), torch.randint(0, 2, (4,)))
    gathered = [torch.zeros_like(model[0].weight) for _ in range(world_size)]
    torch.distributed.all_gather(gathered, model[0].weight.detach())
    report["replicas_equal_after_a_step"] = all(torch.equal(gathered[0], g) for g in gathered)
    frozen = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    if rank == 1:
        frozen[0].weight.requires_grad_(False)
    try:
        deft_compile(frozen, torch.optim.SGD([p for p in frozen.parameters() if p.requires_grad], lr=0.1),
                     F.cross_entropy, policy="wfbp")
        report["requires_grad"] = None
    except Exception as exc:  # noqa: BLE001 - the test reads the type and message
        report["requires_grad"] = _error(exc)
    other = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    try:
        deft_compile(other, torch.optim.SGD(other.parameters(), lr=0.1 * (rank + 1)), F.cross_entropy, policy="wfbp")
        report["learning_rate"] = None
    except Exception as exc:  # noqa: BLE001
        report["learning_rate"] = _error(exc)
    return report


def non_finite_beside_ddp(rank: int, world_size: int, steps: int, at: int) -> dict:
    """An inf in rank 1's input at step ``at``: its gradients are NaN, the all-reduce spreads them, DDP's parameters
    become NaN on every rank and training goes on. ``wfbp`` must do exactly the same, without raising."""
    make_model, make_optimizer, _make_batch, loss_fn, _ddp_kwargs, _exact = CASES[CASE]
    batches = _batches(rank, steps, "last")
    if rank == 1:
        batches[at][0][0, 0] = float("inf")
    torch.manual_seed(0)
    base = make_model()
    ddp_model, deft_model = copy.deepcopy(base), copy.deepcopy(base)
    ddp_optimizer, deft_optimizer = make_optimizer(ddp_model), make_optimizer(deft_model)
    ddp = DistributedDataParallel(ddp_model)
    step = deft_compile(deft_model, deft_optimizer, loss_fn, policy="wfbp")
    losses, same = [], []
    for t, (inputs, targets) in enumerate(batches):
        torch.manual_seed(100 * rank + t)
        ddp_optimizer.zero_grad(set_to_none=True)
        expected = loss_fn(ddp(inputs), targets)
        expected.backward()
        ddp_optimizer.step()
        torch.manual_seed(100 * rank + t)
        actual = step(inputs, targets)
        losses.append((float(expected), float(actual)))
        ours, theirs = _named_state(deft_model, deft_optimizer), _named_state(ddp_model, ddp_optimizer)
        same.append(ours.keys() == theirs.keys() and all(
            torch.equal(ours[k].isnan(), theirs[k].isnan()) and torch.equal(ours[k].nan_to_num(), theirs[k].nan_to_num())
            for k in theirs))
    return {"losses": losses, "same_as_ddp": same,
            "nan_params": sum(int(p.isnan().any()) for p in deft_model.parameters())}


def nan_under_the_preserver(rank: int, world_size: int, steps: int, nan_at: int, where: str) -> dict:
    """deft with the Preserver watching (loss windows of 2 steps, staleness measured every 4). ``where="loss"``: the
    loss is NaN at step ``nan_at`` while its gradients are finite (a term without parameters is NaN), so DDP would
    train on with finite parameters; ``where="gradient"``: an inf in rank 1's input at that step makes the gradients
    NaN, and every parameter after it (as under DDP). What the step raised (nothing, it must), its losses, whether
    the replicas are one model, the Preserver's events and best loss."""
    make_model, make_optimizer, _make_batch, _loss_fn, _ddp_kwargs, _exact = CASES[CASE]
    batches = _batches(rank, steps, "last")[:steps - 1]
    if where == "gradient" and rank == 1:
        batches[nan_at][0][0, 0] = float("inf")
    torch.manual_seed(0)
    model = make_model()
    optimizer = make_optimizer(model)
    scratch = copy.deepcopy(model)

    def loss_fn(output: torch.Tensor, targets: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        labels, nan = targets  # a term without parameters: NaN at one step, 0 otherwise
        return F.cross_entropy(output, labels) + nan

    first = (batches[0][0], (batches[0][1], torch.zeros(())))
    profile = synthetic_profile(scratch, make_optimizer(scratch), loss_fn, first, world_size)
    step = deft_compile(model, optimizer, loss_fn, policy="deft", profile=profile,
                        config=DeftConfig(plan_options=POLICY_OPTIONS["deft"],
                                          preserver=PreserverConfig(check_every=2, staleness_every=4)))
    losses, error = [], None
    try:
        for t, (inputs, targets) in enumerate(batches):
            torch.manual_seed(100 * rank + t)
            nan = math.nan if t == nan_at and where == "loss" else 0.0
            losses.append(float(step(inputs, (targets, torch.tensor(nan)))))
        step.flush()
    except Exception as exc:  # noqa: BLE001 - the test reads it
        error = _error(exc)
    gathered = [torch.zeros_like(model.net[0].weight) for _ in range(world_size)]
    torch.distributed.all_gather(gathered, model.net[0].weight.detach())
    preserver = step.preserver
    return {"error": error, "losses": losses, "finite_params": all(bool(p.isfinite().all()) for p in model.parameters()),
            "replicas_equal": all(torch.equal(gathered[0].nan_to_num(), g.nan_to_num()) for g in gathered),
            "events": [event.reason for event in preserver.history] if preserver is not None else None,
            "best_loss": preserver.best_loss if preserver is not None else None,
            "delayed": sum(1 for item in step.plan.items if item.delay) if step.plan is not None else None}


class _CastsInput(nn.Module):
    """A model that casts its input to float32 itself: any float input dtype works in eager."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.to(torch.float32))


def changed_after_compile(rank: int, world_size: int, change: str) -> dict:
    """Train 3 steps beside DDP, change something the step captured (``change``), then train 3 more: the error
    this rank raised (None if none), and whether the parameters are DDP's (which makes the same change where it
    can: a parameter group of the model's own trainable parameters added to the optimizer, inputs of another dtype
    that the model casts)."""
    torch.manual_seed(0)
    base = _CastsInput()
    model, ddp_model = copy.deepcopy(base), copy.deepcopy(base)
    if change in ("unfreeze_group", "frozen_then_unfrozen"):  # the last layer's group comes later
        optimizer = torch.optim.SGD(model.net[0].parameters(), lr=0.1, momentum=0.9)
        ddp_optimizer = torch.optim.SGD(ddp_model.net[0].parameters(), lr=0.1, momentum=0.9)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        ddp_optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.1, momentum=0.9)
    if change == "frozen_then_unfrozen":  # and frozen until then
        model.net[2].requires_grad_(False)
    step = deft_compile(model, optimizer, F.cross_entropy, policy="wfbp")
    ddp = DistributedDataParallel(ddp_model)
    data = torch.Generator().manual_seed(rank)
    report: dict = {"error": None}
    try:
        for t in range(6):
            x, y = torch.randn(8, 8, generator=data), torch.randint(0, 2, (8,), generator=data)
            ours = x
            if t == 3:
                if change == "half":
                    model.half()
                elif change == "to_float64":
                    model.to(torch.float64)
                elif change == "to_same_device":
                    model.to("cpu")
                elif change == "frozen_then_unfrozen":
                    model.net[2].requires_grad_(True)
                    optimizer.add_param_group({"params": list(model.net[2].parameters())})
                elif change == "foreign_param_group":
                    optimizer.add_param_group({"params": [nn.Parameter(torch.randn(3))]})
                elif change == "unfreeze_group":
                    optimizer.add_param_group({"params": list(model.net[2].parameters())})
                    ddp_optimizer.add_param_group({"params": list(ddp_model.net[2].parameters())})
            refused = change == "input_dtype_refused" or (change == "input_dtype_refused_on_rank_1" and rank == 1)
            if t >= 3 and (change == "input_dtype_cast_by_model" or refused):
                ours = x.double()
            if t == 3 and refused:
                model.forward = model.net.forward  # no cast: Linear refuses float64 inputs, as in eager
            if t >= 3 and change == "input_device":
                ours = x.to("meta")
            ddp_optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(ddp(x.double() if change == "input_dtype_cast_by_model" and t >= 3 else x), y).backward()
            ddp_optimizer.step()
            step(ours, y)
    except Exception as exc:  # noqa: BLE001 - the test reads the type and message
        report["error"] = _error(exc)
    report["same_as_ddp"] = all(torch.equal(p, q) for p, q in zip(model.parameters(), ddp_model.parameters()))
    return report


def trainer_refusals(rank: int, world_size: int) -> dict:
    """``DeftTrainer`` with settings it cannot honour: each raises, on every rank, before any training."""
    import tempfile

    import transformers

    from deft_compile.integrations.transformers import DeftTrainer

    model = nn.Sequential(nn.Linear(4, 2))
    refusals = {}
    with tempfile.TemporaryDirectory() as out:
        cases = {
            "torch_compile": dict(torch_compile=True),
            "deft_config_conflict": dict(max_grad_norm=1.0),
            "optimizer": dict(optim="adafactor"),
        }
        for name, extra in cases.items():
            try:
                args = transformers.TrainingArguments(output_dir=out, use_cpu=True, report_to=[], max_steps=1, **extra)
                config = DeftConfig(max_grad_norm=0.5) if name == "deft_config_conflict" else DeftConfig()
                trainer = DeftTrainer(model=model, args=args, train_dataset=[{"x": torch.zeros(4)}], deft_config=config)
                if name == "deft_config_conflict":
                    trainer.step_config()
                if name == "optimizer":
                    trainer.create_optimizer()
                refusals[name] = None
            except Exception as exc:  # noqa: BLE001 - the test reads the type and message
                refusals[name] = _error(exc)
    return refusals
