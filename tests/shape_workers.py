"""Steps on inputs whose sequence length changes from call to call and from rank to rank (module level so the test
launcher can import them), and their bounds (tests/bounds.py): the same steps with the model compiled by
``torch.compile`` against eager."""

from __future__ import annotations

import collections
import copy

import torch
from torch.nn.parallel import DistributedDataParallel

from deft_compile import DeftConfig, deft_compile
from deft_compile.tools.presets import GPT2Style

VOCAB = 64


def small_gpt(seed: int = 0) -> GPT2Style:
    torch.manual_seed(seed)
    return GPT2Style(vocab=VOCAB, dim=32, heads=2, layers=2, context=64)


def batch(length: int, generator: torch.Generator, rows: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (rows, length + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def _optimizer(model: torch.nn.Module, optimizer: str) -> torch.optim.Optimizer:
    if optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference of ``a`` from ``b`` over ``b``'s largest magnitude."""
    return (a - b).abs().max().item() / (b.abs().max().item() or 1.0)


def train_lengths(compiler: str, lengths: list[int], optimizer: str = "sgd", policy: str = "deft",
                  mark_dynamic: bool = False, **config) -> dict:
    """One process: ``lengths`` as the sequence length of each call (``mark_dynamic``: each batch's length marked
    with ``torch._dynamo.mark_dynamic``). Losses, the final parameters, how many captures were traced and what the
    lowering compiled per region."""
    model = small_gpt()
    opt = _optimizer(model, optimizer)
    step = deft_compile(model, opt, policy=policy, config=DeftConfig(compiler=compiler, **config))
    data = torch.Generator().manual_seed(7)
    losses = []
    for length in lengths:
        inputs = batch(length, data)
        if mark_dynamic:
            for tensor in inputs:
                torch._dynamo.mark_dynamic(tensor, 1)
        losses.append(float(step(*inputs)))
    step.flush()
    per_region = collections.Counter(entry.get("region", entry["graph"]) for entry in step.lowering.history)
    return {
        "losses": losses,
        "params": {name: p.detach().clone() for name, p in model.named_parameters()},
        "captures": step.capture_count,
        "compiles_per_region": dict(per_region),
        "fallbacks": [entry["fallback_reason"] for entry in step.lowering.history if entry.get("fallback_reason")],
    }


def compiled_lengths(lengths: list[int], optimizer: str = "sgd") -> dict:
    """The yardstick of ``train_lengths``: its model, optimizer and batches in a training loop, the model eager and
    compiled by ``torch.compile`` (its shapes made dynamic at the second length, as ``train_lengths``' capture is).
    Per call, the losses' relative difference; the final parameters' (``relative_error``, per tensor)."""
    runs = []
    torch._dynamo.reset()  # a fresh recompile budget: past it Dynamo runs the model eagerly
    for compiled in (False, True):
        model = small_gpt()
        opt = _optimizer(model, optimizer)
        forward = torch.compile(model) if compiled else model
        data = torch.Generator().manual_seed(7)
        losses = []
        for length in lengths:
            opt.zero_grad(set_to_none=True)
            loss = forward(*batch(length, data))
            loss.backward()
            opt.step()
            losses.append(float(loss))
        runs.append((losses, model))
    torch._dynamo.reset()
    (eager_losses, eager), (losses, model) = runs
    return {"losses": [abs(a - b) / abs(b) for a, b in zip(losses, eager_losses)],
            "params": {name: relative_error(p.detach(), q.detach())
                       for (name, p), q in zip(model.named_parameters(), eager.parameters())}}


def lengths_of(rank: int, steps: int) -> list[int]:
    """Each rank its own sequence of lengths (dynamic padding gives every rank its own batch length)."""
    return [5 + (3 * t + 5 * rank) % 11 for t in range(steps)]


def _worst_error(model: torch.nn.Module, optimizer: torch.optim.Optimizer, ddp_model: torch.nn.Module,
                 ddp_optimizer: torch.optim.Optimizer) -> float:
    """The worst ``relative_error`` over parameters and momentum buffers of ``model`` against ``ddp_model``."""
    errors = []
    for p, q in zip(model.parameters(), ddp_model.parameters()):
        errors.append(relative_error(p.detach(), q.detach()))
        buf_p, buf_q = optimizer.state[p].get("momentum_buffer"), ddp_optimizer.state[q].get("momentum_buffer")
        if buf_q is not None:
            errors.append(relative_error(buf_p, buf_q))
    return max(errors)


def per_rank_lengths_beside_ddp(rank: int, world_size: int, compiler: str, steps: int, yardstick: bool = False) -> dict:
    """``wfbp`` with SGD and torch DDP on the same per-rank batches, whose lengths differ across steps and ranks;
    the worst relative difference over parameters and momentum after each step, and the captures traced. With
    ``yardstick``, its bound (``compiled``): DDP around ``torch.compile(model)`` against DDP on the same batches,
    measured the same way."""
    base = small_gpt()
    ddp_model, deft_model = copy.deepcopy(base), copy.deepcopy(base)
    caps = dict(first_bucket_mb=0.02, bucket_cap_mb=0.05)
    ddp = DistributedDataParallel(ddp_model, bucket_cap_mb=caps["bucket_cap_mb"])
    ddp_opt = torch.optim.SGD(ddp_model.parameters(), lr=0.05, momentum=0.9)
    deft_opt = torch.optim.SGD(deft_model.parameters(), lr=0.05, momentum=0.9)
    step = deft_compile(deft_model, deft_opt, policy="wfbp", config=DeftConfig(compiler=compiler, **caps))
    data = torch.Generator().manual_seed(100 + rank)
    worst, losses = [], []
    for length in lengths_of(rank, steps):
        inputs, targets = batch(length, data)
        ddp_opt.zero_grad(set_to_none=True)
        ddp_loss = ddp(inputs, targets)
        ddp_loss.backward()
        ddp_opt.step()
        loss = step(inputs, targets)
        losses.append((float(ddp_loss), float(loss)))
        worst.append(_worst_error(deft_model, deft_opt, ddp_model, ddp_opt))
    result = {"worst": worst, "losses": losses, "captures": step.capture_count,
              "buckets": len(step.graph.items), "lengths": lengths_of(rank, steps)}
    if yardstick:
        sides = []
        for compiled in (False, True):  # DDP's default buckets (Dynamo's DDPOptimizer refuses a larger first one)
            model = copy.deepcopy(base)
            module = DistributedDataParallel(torch.compile(model) if compiled else model)
            sides.append((model, module, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)))
        data = torch.Generator().manual_seed(100 + rank)
        result["compiled"] = []
        for length in lengths_of(rank, steps):
            inputs, targets = batch(length, data)
            for _, module, optimizer in sides:
                optimizer.zero_grad(set_to_none=True)
                module(inputs, targets).backward()
                optimizer.step()
            (eager, _, eager_opt), (model, _, opt) = sides
            result["compiled"].append(_worst_error(model, opt, eager, eager_opt))
    return result
