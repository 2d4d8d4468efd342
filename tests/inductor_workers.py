"""Workers of the 2-process Inductor tests (module level so spawn can import them).

Each measures its bound in the same launch (tests/bounds.py): the reference it compares deft with, with the model
compiled by ``torch.compile``, against that reference.
"""

from __future__ import annotations

import re

import torch

from default_route_workers import compile_beside_ddp
from workers import compare_with_ddp


def inductor_vs_ddp(rank: int, world_size: int, case: str, steps: int, compiler: str = "inductor") -> dict:
    """``workers.compare_with_ddp`` with an Inductor compiler (policy "wfbp"), plus the FX graph's collective order
    and the order the lowered step runs them in: the regional program's (``inductor``), the generated wrapper's
    (``inductor-graph``); and the bound, ``default_route_workers.compile_beside_ddp`` on the same case and steps
    (``compiled``)."""
    from deft_compile.step.lowering import collective_order

    result = compare_with_ddp(rank, world_size, case, steps, compiler=compiler)
    fx_order = [
        {"all_reduce": "all_reduce", "wait_tensor": "wait", "broadcast": "broadcast"}[m]
        for m in re.findall(r"_c10d_functional\.(all_reduce|wait_tensor|broadcast)_?\.default\(", result["code"])
    ]
    return {"steps": result["steps"], "compilers": result["compilers"], "fx_order": fx_order,
            "program_order": result.get("program_order"), "code_order": collective_order(result["generated_code"]),
            "history": result["lowering_history"], "buckets": result["buckets"],
            "compiled": compile_beside_ddp(rank, world_size, case, steps)}


def backend_inductor_vs_ddp(rank: int, world_size: int) -> dict:
    """torch.compile(backend="deft") with Inductor: wfbp vs DDP (SGD and AdamW), each with its bound (``compiled``:
    DDP around ``torch.compile(model)``, Inductor, against DDP, the same optimizer and batches, measured the same way),
    then policy="deft" runs and keeps the replicas identical."""
    import copy

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import deft_compile.backend as backend
    from backend_workers import MLP, STEPS, TINY_BUCKETS, _batches, _errors, _fresh, _loss

    from deft_compile.step.lowering import lowered_counts

    results: dict = {}
    optimizers = {
        "sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01),
        "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1),
    }
    for name, make_optimizer in optimizers.items():
        _fresh()
        torch.manual_seed(0)
        base = MLP()
        ddp_model, deft_model = copy.deepcopy(base), copy.deepcopy(base)
        ddp = DistributedDataParallel(ddp_model)
        ddp_opt, deft_opt = make_optimizer(ddp_model), make_optimizer(deft_model)
        compiled = torch.compile(deft_model, backend="deft", options={**TINY_BUCKETS, "compiler": "inductor"})
        worst = 0.0
        for x, y in _batches(rank, STEPS):
            ddp_opt.zero_grad()
            _loss(ddp(x), y).backward()
            ddp_opt.step()
            deft_opt.zero_grad()
            _loss(compiled(x), y).backward()
            deft_opt.step()
            worst = max(worst, _errors(deft_model, ddp_model)[1])
        results[name] = {"max_rel": worst, "buckets": [len(c.buckets) for c in backend.compiled_backwards()]}
        _fresh()
        torch.manual_seed(0)
        base = MLP()
        eager_model, compiled_model = copy.deepcopy(base), copy.deepcopy(base)
        eager, compiled = DistributedDataParallel(eager_model), DistributedDataParallel(torch.compile(compiled_model))
        eager_opt, compiled_opt = make_optimizer(eager_model), make_optimizer(compiled_model)
        drift = 0.0
        for x, y in _batches(rank, STEPS):
            for module, optimizer in ((eager, eager_opt), (compiled, compiled_opt)):
                optimizer.zero_grad()
                _loss(module(x), y).backward()
                optimizer.step()
            drift = max(drift, _errors(compiled_model, eager_model)[1])
        results[name]["compiled"] = drift
    _fresh()
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    compiled = torch.compile(model, backend="deft", options={**TINY_BUCKETS, "policy": "deft", "compiler": "inductor"})
    for x, y in _batches(rank, STEPS):
        optimizer.zero_grad()
        _loss(compiled(x), y).backward()
        optimizer.step()
    optimizer.zero_grad()
    backend.flush(model)
    optimizer.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(gathered, flat)
    results["deft"] = {
        "replicas_equal": all(torch.equal(gathered[0], g) for g in gathered),
        "buckets": [[b.delayed for b in c.buckets] for c in backend.compiled_backwards()],
        "finite": bool(torch.isfinite(flat).all()),
    }
    results["lowered"] = dict(lowered_counts)
    return results
