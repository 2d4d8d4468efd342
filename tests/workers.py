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
    tensors.update({f"buffer:{n}": b for n, b in model.named_buffers()})
    names = {p: n for n, p in model.named_parameters()}
    for p, state in optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state:{names[p]}:{key}"] = value
    return tensors


def compare_with_ddp(rank: int, world_size: int, case: str, steps: int, policy: str = "wfbp") -> dict:
    """Train one model with torch DDP and one with deft_compile on the same per-rank data;
    report, per step, the worst difference over parameters, buffers and optimizer state."""
    make_model, make_optimizer, make_batch, loss_fn, ddp_kwargs, _exact = CASES[case]
    torch.manual_seed(0)
    base = make_model()
    ddp_model, deft_model = copy.deepcopy(base), copy.deepcopy(base)
    ddp = DistributedDataParallel(ddp_model, **ddp_kwargs)
    ddp_optimizer, deft_optimizer = make_optimizer(ddp_model), make_optimizer(deft_model)
    step = deft_compile(deft_model, deft_optimizer, loss_fn, policy=policy, config=DeftConfig(first_bucket_mb=0.0002, bucket_cap_mb=0.004))
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
    return {"steps": report, "buckets": len(step.graph.buckets), "traces": step.trace_count}
