"""Worker functions for tests/test_backend.py, run in spawned gloo processes (module level so spawn can import them).

One launch runs every scenario in turn (``all_scenarios``): starting processes
and compiling are the slow parts on a 2-core machine, so they are paid once.
"""

from __future__ import annotations

import copy
import operator
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

import deft_compile.backend as deft_backend_module
from deft_compile.passes.collectives import ALL_REDUCE, WAIT

aten = torch.ops.aten
VIEW_OPS = {aten.view.default, aten.split_with_sizes.default}

STEPS = 4
TINY_BUCKETS = {"first_bucket_mb": 0.0002, "bucket_cap_mb": 0.0005}  # several buckets on tiny models


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 16)
        self.b = nn.Linear(16, 16)
        self.c = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.relu(self.a(x)))))


class BrokenMLP(MLP):
    """The same model with a graph break in forward: Dynamo hands the backend two graphs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        torch._dynamo.graph_break()
        return self.c(torch.tanh(self.b(h)))


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def _batches(rank: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1000 + rank)  # each rank its own data, as in data parallelism
    return [(torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)) for _ in range(steps)]


def _errors(actual: nn.Module, expected: nn.Module) -> tuple[float, float]:
    """(max absolute difference, max of that over each tensor's largest magnitude) over the parameters."""
    worst_abs = worst_rel = 0.0
    for a, e in zip(actual.parameters(), expected.parameters()):
        diff = (a.detach().double() - e.detach().double()).abs().max().item()
        scale = e.detach().double().abs().max().item()
        worst_abs = max(worst_abs, diff)
        worst_rel = max(worst_rel, diff / scale if scale > 0 else diff)
    return worst_abs, worst_rel


def schedule_report() -> dict:
    """How the rewritten backward graphs place collectives, found by op overload.

    ``launch_after_last_gradient``: every all-reduce's flatten chain starts right
    after the last gradient it reads is produced. ``waits_at_end``: after the
    first wait only waits, views and the output follow.
    """
    report = {"graphs": 0, "all_reduces": 0, "buckets": 0, "launch_after_last_gradient": True, "waits_at_end": True}
    for compiled in deft_backend_module.compiled_backwards():
        nodes = list(compiled.graph_module.graph.nodes)
        position = {n: i for i, n in enumerate(nodes)}
        report["graphs"] += 1
        report["buckets"] += len(compiled.buckets)
        for node in nodes:
            if node.target is not ALL_REDUCE:
                continue
            report["all_reduces"] += 1
            scaled = node.args[0]
            flat = scaled.args[0]
            pieces = flat.args[0] if flat.target is aten.cat.default else [flat.args[0]]
            # a piece is reshape(gradient), or the gradient itself when it is 1-D (no no-op node)
            gradients = [piece.args[0] if piece.target is aten.reshape.default else piece for piece in pieces]
            chain = [piece for piece in pieces if piece.target is aten.reshape.default] + [flat]
            chain_start = min(position[n] for n in chain)
            last_gradient = max(position[g] for g in gradients)
            if chain_start != last_gradient + 1:
                report["launch_after_last_gradient"] = False
        waits = [i for i, n in enumerate(nodes) if n.target is WAIT]
        if waits:
            tail = nodes[waits[0] :]
            if any(n.op != "output" and n.target not in VIEW_OPS | {WAIT, operator.getitem} for n in tail):
                report["waits_at_end"] = False
    return report


def _fresh() -> None:
    torch._dynamo.reset()
    deft_backend_module.reset()


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)


def sync_vs_ddp(rank: int, model_cls: type[nn.Module]) -> dict:
    """Synchronous backend vs torch DDP, same data and optimizer; errors after every step.

    Rank 1 starts from different weights: the backend's first-call broadcast
    must make it train rank 0's model, as DDP's constructor does. The input
    requires grad: its gradient is not a parameter gradient and must stay local.
    """
    _fresh()
    torch.manual_seed(rank)  # different initial weights per rank on purpose
    base = model_cls()
    ddp_model, deft_model = copy.deepcopy(base), copy.deepcopy(base)
    ddp = DistributedDataParallel(ddp_model)
    ddp_opt, deft_opt = _sgd(ddp_model), _sgd(deft_model)
    compiled = torch.compile(deft_model, backend="deft", options=dict(TINY_BUCKETS))
    steps = []
    for x, y in _batches(rank, STEPS):
        x_ddp, x_deft = x.clone().requires_grad_(), x.clone().requires_grad_()
        ddp_opt.zero_grad()
        ddp_loss = _loss(ddp(x_ddp), y)
        ddp_loss.backward()
        ddp_opt.step()
        deft_opt.zero_grad()
        deft_loss = _loss(compiled(x_deft), y)
        deft_loss.backward()
        deft_opt.step()
        max_abs, max_rel = _errors(deft_model, ddp_model)
        steps.append(
            {
                "max_abs": max_abs,
                "max_rel": max_rel,
                "loss_diff": abs(ddp_loss.item() - deft_loss.item()),
                "input_grad_diff": (x_deft.grad - x_ddp.grad).abs().max().item(),
            }
        )
    compiled_graphs = deft_backend_module.compiled_backwards()
    return {
        "steps": steps,
        "graphs": len(compiled_graphs),
        "buckets": [len(c.buckets) for c in compiled_graphs],
        "delayed": [b.delayed for c in compiled_graphs for b in c.buckets],
        "schedule": schedule_report(),
    }


def _average(grad: torch.Tensor, world_size: int) -> torch.Tensor:
    """DDP's averaging: scale by 1/world_size, then sum across ranks."""
    averaged = grad * (1.0 / world_size)
    dist.all_reduce(averaged)
    return averaged


def delayed_vs_reference(rank: int, world_size: int, select: Callable[[nn.Module], list[nn.Parameter]] | None) -> dict:
    """Delayed backend vs an eager reference of the documented delayed semantics.

    Reference, per step t: compute local g_t, average it; synchronous
    parameters get grad = avg(g_t); delayed parameters get grad = avg(g_{t-1}),
    or no gradient at all (``grad = None``, the optimizer skips them) at the
    first step. After the last step both sides apply the pending averaged
    gradients of the delayed parameters with one more ``optimizer.step()``
    (``flush``).
    """
    _fresh()
    torch.manual_seed(0)
    base = MLP()
    ref_model, deft_model = copy.deepcopy(base), copy.deepcopy(base)
    ref_opt, deft_opt = _sgd(ref_model), _sgd(deft_model)
    delay: bool | list[nn.Parameter] = True if select is None else select(deft_model)
    delayed_names = {n for n, p in deft_model.named_parameters() if delay is True or any(p is q for q in delay)}
    compiled = torch.compile(deft_model, backend="deft", options={**TINY_BUCKETS, "delay": delay})
    pending: dict[str, torch.Tensor] | None = None
    steps = []
    first_step_untouched = None
    for t, (x, y) in enumerate(_batches(rank, STEPS)):
        before = {n: p.detach().clone() for n, p in deft_model.named_parameters()}
        deft_opt.zero_grad()
        _loss(compiled(x), y).backward()
        if t == 0:
            first_step_untouched = all(
                p.grad is None for n, p in deft_model.named_parameters() if n in delayed_names
            )
        deft_opt.step()
        if t == 0:
            first_step_untouched = first_step_untouched and all(
                torch.equal(before[n], p) for n, p in deft_model.named_parameters() if n in delayed_names
            )
            first_step_untouched = first_step_untouched and not any(
                deft_opt.state.get(p) for n, p in deft_model.named_parameters() if n in delayed_names
            )

        ref_opt.zero_grad()
        _loss(ref_model(x), y).backward()
        current = {n: _average(p.grad, world_size) for n, p in ref_model.named_parameters()}
        for n, p in ref_model.named_parameters():
            if n in delayed_names:
                p.grad = None if pending is None else pending[n]
            else:
                p.grad = current[n]
        pending = {n: g for n, g in current.items() if n in delayed_names}
        ref_opt.step()
        max_abs, max_rel = _errors(deft_model, ref_model)
        steps.append({"max_abs": max_abs, "max_rel": max_rel})

    deft_opt.zero_grad()
    flushed = deft_backend_module.flush(deft_model)
    deft_opt.step()
    ref_opt.zero_grad()
    for n, p in ref_model.named_parameters():
        if n in delayed_names:
            p.grad = pending[n]
    ref_opt.step()
    flush_abs, flush_rel = _errors(deft_model, ref_model)
    names = {id(p): n for n, p in deft_model.named_parameters()}
    compiled_graphs = deft_backend_module.compiled_backwards()
    return {
        "steps": steps,
        "flush": {"max_abs": flush_abs, "max_rel": flush_rel},
        "flushed": sorted(names[id(p)] for p in flushed),
        "delayed_names": sorted(delayed_names),
        "first_step_untouched": first_step_untouched,
        "buckets": [(len(b.positions), b.delayed) for c in compiled_graphs for b in c.buckets],
        "schedule": schedule_report(),
        "second_flush_empty": deft_backend_module.flush(deft_model) == {},
    }


def all_scenarios(rank: int, world_size: int) -> dict:
    return {
        "sync_mlp": sync_vs_ddp(rank, MLP),
        "sync_graph_break": sync_vs_ddp(rank, BrokenMLP),
        "delay_all": delayed_vs_reference(rank, world_size, None),
        "delay_first_layer": delayed_vs_reference(rank, world_size, lambda m: list(m.a.parameters())),
    }
