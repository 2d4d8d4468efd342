"""Worker functions the distributed tests run in spawned processes (module level so spawn can import them)."""

from __future__ import annotations

import copy

import torch
from torch.nn.parallel import DistributedDataParallel

from deft_compile import DeftConfig, deft_compile
from models import CASES


def _max_errors(actual: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    """(max absolute difference, that divided by the largest magnitude of ``expected``)."""
    actual, expected = actual.double(), expected.double()
    absolute = (actual - expected).abs().max().item() if actual.numel() else 0.0
    scale = expected.abs().max().item() if expected.numel() else 0.0
    return absolute, absolute / scale if scale > 0 else absolute


def _named_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    tensors = {f"param:{n}": p.detach() for n, p in model.named_parameters()}
    tensors.update({f"grad:{n}": p.grad for n, p in model.named_parameters() if p.grad is not None})
    tensors.update({f"buffer:{n}": b for n, b in model.named_buffers()})
    names = {p: n for n, p in model.named_parameters()}
    for p, state in optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state:{names[p]}:{key}"] = value
    return tensors


def compare_with_ddp(rank: int, world_size: int, case: str, steps: int, dump_dir: str | None = None, policy: str = "wfbp") -> dict:
    """Train one model with torch DDP and one with deft_compile on the same per-rank data;
    report, per step, the worst difference over parameters, buffers and optimizer state."""
    make_model, make_optimizer, make_batch, loss_fn, ddp_kwargs, _exact = CASES[case]
    torch.manual_seed(0)
    base = make_model()
    ddp_model, deft_model = copy.deepcopy(base), copy.deepcopy(base)
    ddp = DistributedDataParallel(ddp_model, **ddp_kwargs)
    ddp_optimizer, deft_optimizer = make_optimizer(ddp_model), make_optimizer(deft_model)
    step = deft_compile(
        deft_model,
        deft_optimizer,
        loss_fn,
        policy=policy,
        config=DeftConfig(first_bucket_mb=0.0002, bucket_cap_mb=0.004),
        dump_dir=f"{dump_dir}/rank{rank}" if dump_dir else None,
    )
    data = torch.Generator().manual_seed(1234 + rank)
    report = []
    for t in range(steps):
        inputs, targets = make_batch(data)
        torch.manual_seed(100 * rank + t)  # each rank its own Dropout stream, as in DDP
        ddp_optimizer.zero_grad(set_to_none=True)
        ddp_loss = loss_fn(ddp(inputs), targets)
        ddp_loss.backward()
        ddp_optimizer.step()
        torch.manual_seed(100 * rank + t)
        deft_loss = step(inputs, targets)
        expected = _named_state(ddp_model, ddp_optimizer)
        actual = _named_state(deft_model, deft_optimizer)
        missing = sorted(set(expected) ^ set(actual))
        worst_abs, worst_rel, worst_name = 0.0, 0.0, ""
        for name in expected.keys() & actual.keys():
            absolute, relative = _max_errors(actual[name], expected[name])
            if relative > worst_rel or (relative == worst_rel and absolute > worst_abs):
                worst_abs, worst_rel, worst_name = absolute, relative, name
        report.append(
            {
                "step": t,
                "loss_diff": abs(ddp_loss.item() - deft_loss.item()),
                "max_abs": worst_abs,
                "max_rel": worst_rel,
                "worst": worst_name,
                "missing": missing,
                "compared": len(expected.keys() & actual.keys()),
            }
        )
    return {
        "steps": report,
        "buckets": len(step.graph.buckets),
        "traces": step.trace_count,
        "code": step.graph.graph_module.code,
    }


def _tiny_step(hidden: int, **config):
    import torch.nn as nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = deft_compile(model, optimizer, lambda out, y: ((out - y) ** 2).mean(), config=DeftConfig(**config))
    return step


def mismatched_models(rank: int, world_size: int) -> str:
    """Rank 1 builds a wider hidden layer; construction must refuse before any broadcast."""
    try:
        _tiny_step(8 if rank == 0 else 9)
    except Exception as exc:  # noqa: BLE001 - the test inspects the type and message
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def dead_peer(rank: int, world_size: int, mode: str) -> str:
    """Rank 1 dies (or hangs) after one step; rank 0's next step must fail and name rank 1."""
    import os
    import time

    step = _tiny_step(8, peer_check_timeout_s=2.0)
    batch = (torch.randn(4, 4), torch.randn(4, 1))
    step(*batch)
    if rank == 1:
        if mode == "dies":
            os._exit(3)
        time.sleep(12)
        return "slept"
    try:
        step(*batch)
    except Exception as exc:  # noqa: BLE001 - the test inspects the type and message
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def compare_with_eager(case: str, steps: int, batches=None, optimizer_override=None) -> list[dict]:
    """World size 1: the compiled step against plain eager training, per step."""
    make_model, make_optimizer, make_batch, loss_fn, _ddp_kwargs, _exact = CASES[case]
    make_optimizer = optimizer_override or make_optimizer
    torch.manual_seed(0)
    base = make_model()
    eager_model, deft_model = copy.deepcopy(base), copy.deepcopy(base)
    eager_optimizer, deft_optimizer = make_optimizer(eager_model), make_optimizer(deft_model)
    step = deft_compile(deft_model, deft_optimizer, loss_fn)
    data = torch.Generator().manual_seed(7)
    report = []
    for t in range(steps):
        inputs, targets = batches[t] if batches is not None else make_batch(data)
        torch.manual_seed(t)
        eager_optimizer.zero_grad(set_to_none=True)
        eager_loss = loss_fn(eager_model(inputs), targets)
        eager_loss.backward()
        eager_optimizer.step()
        torch.manual_seed(t)
        deft_loss = step(inputs, targets)
        expected = _named_state(eager_model, eager_optimizer)
        actual = _named_state(deft_model, deft_optimizer)
        worst_abs, worst_rel = 0.0, 0.0
        for name in expected.keys() & actual.keys():
            absolute, relative = _max_errors(actual[name], expected[name])
            worst_abs, worst_rel = max(worst_abs, absolute), max(worst_rel, relative)
        report.append(
            {"max_abs": worst_abs, "max_rel": worst_rel, "loss_diff": abs(eager_loss.item() - deft_loss.item()),
             "same_keys": set(expected) == set(actual), "traces": step.trace_count}
        )
    return report
