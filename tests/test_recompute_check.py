"""Activation checkpointing in a traced step: with Dropout in the recomputed layer the trace would draw a new mask
where eager restores the forward's (measured under Trainer: gradient norms 2.4e-2 relative off DDP's), so the step
refuses it with ``TraceError``; without random ops the recomputation is exact and the step equals eager."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from deft_compile import DeftConfig, deft_compile
from deft_compile.errors import TraceError


class Checkpointed(torch.nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 3)
        self.dropout = torch.nn.Dropout(p)

    def block(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(torch.tanh(self.a(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(checkpoint(self.block, x, use_reentrant=False))


def test_recomputed_dropout_is_refused():
    model = Checkpointed(p=0.1)
    step = deft_compile(model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy, policy="wfbp",
                        config=DeftConfig(compiler="aten"))
    with pytest.raises(TraceError, match="activation checkpointing"):
        step(torch.randn(4, 8), torch.tensor([0, 1, 2, 0]))


def test_recomputation_without_random_ops_is_exact():
    torch.manual_seed(0)
    model = Checkpointed(p=0.0)
    reference = copy.deepcopy(model)
    step = deft_compile(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), F.cross_entropy,
                        policy="wfbp", config=DeftConfig(compiler="aten"))
    eager = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        x, y = torch.randn(4, 8), torch.tensor([0, 1, 2, 0])
        step(x, y)
        eager.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        eager.step()
        for p, q in zip(model.parameters(), reference.parameters()):
            assert torch.equal(p, q)
