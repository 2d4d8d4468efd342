"""A zero learning rate (a warm-up's first step, the end of a linear decay, where Trainer's default schedule
arrives) with Adam and AdamW: their capturable update divides by the step size, which at lr = 0 made NaN in every
row whose second moment was 0 (embedding rows no batch used). The compiled step matches eager instead."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from deft_compile import DeftConfig, deft_compile


@pytest.mark.parametrize("optimizer_cls", [torch.optim.Adam, torch.optim.AdamW])
def test_zero_learning_rate_matches_eager(optimizer_cls):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 3))
    reference = copy.deepcopy(model)
    decay = 0.01 if optimizer_cls is torch.optim.AdamW else 0.0  # Adam's decay is L2: no zero gradients left
    optimizer = optimizer_cls(model.parameters(), lr=0.0, weight_decay=decay)
    eager = optimizer_cls(reference.parameters(), lr=0.0, weight_decay=decay)
    step = deft_compile(model, optimizer, F.cross_entropy, policy="wfbp", config=DeftConfig(compiler="aten"))
    inputs, targets = torch.tensor([1, 2]), torch.tensor([0, 1])  # embedding rows 0 and 3-9: zero gradient
    for lr in (0.0, 0.0, 1e-2, 0.0):
        for group in (*optimizer.param_groups, *eager.param_groups):
            group["lr"] = lr
        step(inputs, targets)
        eager.zero_grad()
        F.cross_entropy(reference(inputs), targets).backward()
        eager.step()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert torch.isfinite(p).all(), f"lr={lr}: {name} is not finite"
            assert (p - q).abs().max() <= 1e-6 * q.abs().max() + 1e-28, f"lr={lr}: {name} differs from eager"
