"""Steps on inputs whose sequence length changes from call to call and from rank to rank (module level so the test
launcher can import them)."""

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


def train_lengths(compiler: str, lengths: list[int], optimizer: str = "sgd", policy: str = "deft", **config) -> dict:
    """One process: ``lengths`` as the sequence length of each call. Losses, the final parameters, how many
    captures were traced and what the lowering compiled per region."""
    model = small_gpt()
    if optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = deft_compile(model, opt, policy=policy, config=DeftConfig(compiler=compiler, **config))
    data = torch.Generator().manual_seed(7)
    losses = [float(step(*batch(length, data))) for length in lengths]
    step.flush()
    per_region = collections.Counter(entry.get("region", entry["graph"]) for entry in step.lowering.history)
    return {
        "losses": losses,
        "params": {name: p.detach().clone() for name, p in model.named_parameters()},
        "captures": step.runner.capture_count,
        "compiles_per_region": dict(per_region),
        "fallbacks": [entry["fallback_reason"] for entry in step.lowering.history if entry.get("fallback_reason")],
    }


def lengths_of(rank: int, steps: int) -> list[int]:
    """Each rank its own sequence of lengths (dynamic padding gives every rank its own batch length)."""
    return [5 + (3 * t + 5 * rank) % 11 for t in range(steps)]


def per_rank_lengths_beside_ddp(rank: int, world_size: int, compiler: str, steps: int) -> dict:
    """``wfbp`` with SGD and torch DDP on the same per-rank batches, whose lengths differ across steps and ranks;
    the worst relative difference over parameters and momentum after each step, and the captures traced."""
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
        errors = []
        for (name, p), q in zip(deft_model.named_parameters(), ddp_model.parameters()):
            scale = q.detach().abs().max().item() or 1.0
            errors.append((p.detach() - q.detach()).abs().max().item() / scale)
            buf_p, buf_q = deft_opt.state[p].get("momentum_buffer"), ddp_opt.state[q].get("momentum_buffer")
            if buf_q is not None:
                errors.append((buf_p - buf_q).abs().max().item() / (buf_q.abs().max().item() or 1.0))
        worst.append(max(errors))
    return {"worst": worst, "losses": losses, "captures": step.runner.capture_count,
            "buckets": len(step.graph.items), "lengths": lengths_of(rank, steps)}
