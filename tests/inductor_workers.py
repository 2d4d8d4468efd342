"""Workers of the 2-process Inductor tests (module level so spawn can import them)."""

from __future__ import annotations

import re

import torch

from deft_compile import DeftConfig, deft_compile
from workers import _compare, _ddp_pair, _named_state


def inductor_vs_ddp(rank: int, world_size: int, case: str, steps: int) -> dict:
    """Train with torch DDP and with deft_compile(compiler="inductor", policy="wfbp") on the same data;
    per step the worst relative difference, plus the generated code's collective order and the FX graph's."""
    from deft_compile.step.lowering import collective_order

    _, make_batch, loss_fn, _, ddp_model, ddp, ddp_optimizer, deft_model, deft_optimizer = _ddp_pair(case)
    step = deft_compile(deft_model, deft_optimizer, loss_fn, policy="wfbp",
                        config=DeftConfig(first_bucket_mb=0.0002, bucket_cap_mb=0.004, compiler="inductor"))
    data = torch.Generator().manual_seed(1234 + rank)
    report, compilers = [], []
    for t in range(steps):
        inputs, targets = make_batch(data)
        torch.manual_seed(100 * rank + t)
        ddp_optimizer.zero_grad(set_to_none=True)
        ddp_loss = loss_fn(ddp(inputs), targets)
        ddp_loss.backward()
        ddp_optimizer.step()
        torch.manual_seed(100 * rank + t)
        deft_loss = step(inputs, targets)
        entry = _compare(_named_state(deft_model, deft_optimizer), _named_state(ddp_model, ddp_optimizer))
        entry.update(step=t, loss_diff=abs(ddp_loss.item() - deft_loss.item()))
        report.append(entry)
        compilers.append(step.compiler)
    fx_order = [
        {"all_reduce": "all_reduce", "wait_tensor": "wait", "broadcast": "broadcast"}[m]
        for m in re.findall(r"_c10d_functional\.(all_reduce|wait_tensor|broadcast)\.default\(", step.graph.graph_module.code)
    ]
    source = step.lowering.last.source_code
    return {"steps": report, "compilers": compilers, "fx_order": fx_order, "code_order": collective_order(source),
            "history": step.lowering.history, "buckets": len(step.graph.items)}
