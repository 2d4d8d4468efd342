"""Workers for the training-loop features (clipping, accumulation, loss scaling, model outputs) in 2 processes.

Each trains torch DDP (or the eager reference of DeFT's delayed semantics) and deft_compile side by side on
the same per-rank data and reports, per step, the worst difference (``workers._compare``).
"""

from __future__ import annotations

import contextlib
import copy

import torch
from torch.nn.parallel import DistributedDataParallel

from deft_compile import DeftConfig, deft_compile
from workers import (
    POLICY_OPTIONS,
    PlanReference,
    _compare,
    _ddp_pair,
    _named_state,
    plan_schedule_by_name,
    reference_case,
)


def clip_with_ddp(rank: int, world_size: int, case: str, steps: int, max_norm: float) -> dict:
    """wfbp + ``max_grad_norm`` against DDP followed by ``clip_grad_norm_`` before ``optimizer.step()``."""
    _, make_batch, loss_fn, _, ddp_model, ddp, ddp_optimizer, deft_model, deft_optimizer = _ddp_pair(case)
    step = deft_compile(deft_model, deft_optimizer, loss_fn, policy="wfbp",
                        config=DeftConfig(first_bucket_mb=0.0002, bucket_cap_mb=0.004, max_grad_norm=max_norm))
    data = torch.Generator().manual_seed(1234 + rank)
    report = []
    for t in range(steps):
        inputs, targets = make_batch(data)
        torch.manual_seed(100 * rank + t)
        ddp_optimizer.zero_grad(set_to_none=True)
        loss_fn(ddp(inputs), targets).backward()
        norm = torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), max_norm)
        ddp_optimizer.step()
        torch.manual_seed(100 * rank + t)
        step(inputs, targets)
        entry = _compare(_named_state(deft_model, deft_optimizer), _named_state(ddp_model, ddp_optimizer))
        entry.update(step=t, norm=float(norm), deft_norm=float(step.last_grad_norm))
        report.append(entry)
    return {"steps": report, "collectives": step.graph.graph_module.code.count("all_reduce")}


def delayed_reference_run(rank: int, world_size: int, case: str, steps: int, options: str,
                          max_norm: float | None = None, accumulation: int = 1,
                          delayed_update: str = "averaged") -> dict:
    """deft with a delaying plan (and clipping / accumulation) against ``PlanReference`` of the same plan."""
    loss_fn, ref_model, ref_optimizer, deft_model, deft_optimizer, batches, profile = reference_case(
        case, rank, world_size, steps)
    step = deft_compile(deft_model, deft_optimizer, loss_fn, policy="deft", profile=profile,
                        config=DeftConfig(plan_options=POLICY_OPTIONS[options], max_grad_norm=max_norm,
                                          accumulation_steps=accumulation, delayed_update=delayed_update))
    reference = None
    report = []
    for t, (inputs, targets) in enumerate(batches):
        torch.manual_seed(100 * rank + t)
        step(inputs, targets)
        if reference is None:
            schedule = {name: (delay, period * accumulation, offset * accumulation + accumulation - 1)
                        for name, (delay, period, offset) in plan_schedule_by_name(step).items()}
            reference = PlanReference(ref_model, ref_optimizer, loss_fn, schedule, world_size, max_grad_norm=max_norm,
                                      compensated=delayed_update == "compensated")
        torch.manual_seed(100 * rank + t)
        reference.step(inputs, targets)
        entry = _compare(_named_state(deft_model, deft_optimizer), _named_state(ref_model, ref_optimizer))
        entry.update(step=t, updated=step.last_call_updated,
                     norms=[None if n is None else float(n) for n in (step.last_grad_norm, reference.last_norm)])
        reference.last_norm = None
        report.append(entry)
    step.flush()
    reference.flush()
    final = _compare(_named_state(deft_model, deft_optimizer), _named_state(ref_model, ref_optimizer))
    delayed = sum(1 for item in step.plan.items if item.delay)
    return {"steps": report, "final": final, "delayed_items": delayed}


def accumulation_with_ddp(rank: int, world_size: int, case: str, steps: int, accumulation: int, policy: str) -> dict:
    """``accumulation_steps=N`` against DDP with ``no_sync()`` on the first N-1 micro-batches and the loss / N;
    compared after every update (in between DDP holds partial sums in ``.grad``, deft none)."""
    _, make_batch, loss_fn, _, ddp_model, ddp, ddp_optimizer, deft_model, deft_optimizer = _ddp_pair(case)
    step = deft_compile(deft_model, deft_optimizer, loss_fn, policy=policy,
                        config=DeftConfig(first_bucket_mb=0.0002, bucket_cap_mb=0.004, accumulation_steps=accumulation))
    data = torch.Generator().manual_seed(1234 + rank)
    report = []
    for t in range(steps):
        inputs, targets = make_batch(data)
        last = t % accumulation == accumulation - 1
        torch.manual_seed(100 * rank + t)
        with contextlib.nullcontext() if last else ddp.no_sync():
            (loss_fn(ddp(inputs), targets) / accumulation).backward()
        if last:
            ddp_optimizer.step()
        torch.manual_seed(100 * rank + t)
        step(inputs, targets)
        if last:  # .grad on both sides: the mean over the cycle's micro-batches and the ranks
            entry = _compare(_named_state(deft_model, deft_optimizer), _named_state(ddp_model, ddp_optimizer))
            entry.update(step=t, updated=step.last_call_updated)
            report.append(entry)
            ddp_optimizer.zero_grad(set_to_none=True)
        elif step.last_call_updated or any(p.grad is not None for p in deft_model.parameters()):
            report.append({"step": t, "error": "updated or left gradients in the middle of an accumulation cycle"})
    return {"steps": report, "collectives_last_graph": step.graph.graph_module.code.count("all_reduce")}


def loss_scaling_with_ddp(rank: int, world_size: int, steps: int, overflow_at: int, dtype_name: str) -> dict:
    """fp16/bf16 autocast with dynamic loss scaling (a GradScaler shared with deft) against DDP + GradScaler;
    at ``overflow_at`` both scales jump to 2**40 so backward overflows in fp16 and the update is skipped."""
    dtype = getattr(torch, dtype_name)
    _, make_batch, loss_fn, _, ddp_model, ddp, ddp_optimizer, deft_model, deft_optimizer = _ddp_pair("mlp_dropout_sgd")
    ddp_scaler = torch.amp.GradScaler("cpu", growth_interval=3)
    deft_scaler = torch.amp.GradScaler("cpu", growth_interval=3)
    step = deft_compile(deft_model, deft_optimizer, loss_fn, policy="wfbp",
                        config=DeftConfig(first_bucket_mb=0.0002, bucket_cap_mb=0.004, loss_scale=deft_scaler,
                                          max_grad_norm=5.0))
    data = torch.Generator().manual_seed(1234 + rank)
    report = []
    for t in range(steps):
        inputs, targets = make_batch(data)
        if t == overflow_at:
            ddp_scaler._scale.fill_(2.0**40)
            deft_scaler._scale.fill_(2.0**40)
        torch.manual_seed(100 * rank + t)
        ddp_optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=dtype):
            loss = loss_fn(ddp(inputs), targets)
        ddp_scaler.scale(loss).backward()
        ddp_scaler.unscale_(ddp_optimizer)
        torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), 5.0)
        ddp_scaler.step(ddp_optimizer)
        ddp_scaler.update()
        torch.manual_seed(100 * rank + t)
        with torch.autocast("cpu", dtype=dtype):
            deft_loss = step(inputs, targets)
        state = {k: v for k, v in _named_state(deft_model, deft_optimizer).items() if not k.startswith("grad:")}
        expected = {k: v for k, v in _named_state(ddp_model, ddp_optimizer).items() if not k.startswith("grad:")}
        entry = _compare(state, expected)
        entry.update(step=t, scales=[ddp_scaler.get_scale(), deft_scaler.get_scale()], skipped=step.last_update_skipped,
                     loss_diff=abs(float(loss) - float(deft_loss)))
        report.append(entry)
    return {"steps": report}


def transformers_with_ddp(rank: int, world_size: int, family: str, steps: int) -> dict:
    """A ``transformers`` model built from a small config (random weights, nothing downloaded), whose forward
    returns a ``ModelOutput`` with ``.loss``: wfbp (no loss_fn) with clipping against DDP + ``clip_grad_norm_``.

    SGD with momentum: the attention key bias has a mathematically zero gradient (softmax ignores a constant
    shift), pure round-off that Adam would amplify to steps of size lr on both sides differently."""
    from hf_models import build_hf_model

    torch.manual_seed(0)
    base, make_batch = build_hf_model(family)
    ddp_model, deft_model = copy.deepcopy(base), copy.deepcopy(base)
    ddp = DistributedDataParallel(ddp_model)
    ddp_optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.1, momentum=0.9)
    deft_optimizer = torch.optim.SGD(deft_model.parameters(), lr=0.1, momentum=0.9)
    step = deft_compile(deft_model, deft_optimizer, policy="wfbp",
                        config=DeftConfig(first_bucket_mb=0.01, bucket_cap_mb=0.05, max_grad_norm=1.0))
    data = torch.Generator().manual_seed(1234 + rank)
    report = []
    for t in range(steps):
        batch = make_batch(data)
        torch.manual_seed(100 * rank + t)
        ddp_optimizer.zero_grad(set_to_none=True)
        output = ddp(**batch)
        output.loss.backward()
        torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), 1.0)
        ddp_optimizer.step()
        torch.manual_seed(100 * rank + t)
        deft_loss = step(**batch)
        entry = _compare(_named_state(deft_model, deft_optimizer), _named_state(ddp_model, ddp_optimizer))
        entry.update(step=t, loss_diff=abs(float(output.loss) - float(deft_loss)))
        report.append(entry)
    return {"steps": report, "buckets": step.graph.graph_module.code.count("all_reduce")}

