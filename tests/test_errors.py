"""Bad input gets a clear error that names the cause (single process)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from deft_compile import deft_compile
from deft_compile.errors import LossError, TraceError, UnsupportedOptimizerError


def _mse(out, target):
    return ((out - target) ** 2).mean()


def test_lbfgs_is_refused():
    model = nn.Linear(4, 1)
    with pytest.raises(UnsupportedOptimizerError, match="LBFGS is not supported"):
        deft_compile(model, torch.optim.LBFGS(model.parameters()))


def test_optimizer_subclass_is_refused():
    class ClippingSGD(torch.optim.SGD):
        def step(self, closure=None):
            torch.nn.utils.clip_grad_norm_([p for g in self.param_groups for p in g["params"]], 1.0)
            return super().step(closure)

    model = nn.Linear(4, 1)
    with pytest.raises(UnsupportedOptimizerError, match="ClippingSGD"):
        deft_compile(model, ClippingSGD(model.parameters(), lr=0.1))


def test_non_scalar_loss_is_refused():
    model = nn.Linear(4, 2)
    step = deft_compile(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda out, y: (out - y) ** 2)
    with pytest.raises(LossError, match=r"scalar .*got shape \(3, 2\)"):
        step(torch.randn(3, 4), torch.randn(3, 2))


class Gate(nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return x * 2
        return x


def test_data_dependent_branch_names_module_and_line():
    model = nn.Sequential(nn.Linear(4, 4), Gate(), nn.Linear(4, 1))
    step = deft_compile(model, torch.optim.SGD(model.parameters(), lr=0.1), _mse)
    with pytest.raises(TraceError) as info:
        step(torch.randn(3, 4), torch.randn(3, 1))
    message = str(info.value)
    assert "module '1' (Gate)" in message
    assert "branch on a tensor's value" in message
    assert "if x.sum() > 0" in message
    assert "during forward" in message


def test_values_read_in_python_still_capture_exactly():
    """``.item()`` and ``nonzero`` do not stop the capture: the graph computes them at run time."""

    class ScaleByMax(nn.Module):
        def forward(self, x):
            return x * x.abs().max().item() + x[torch.nonzero(x > 0)[:, 0]].sum()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), ScaleByMax(), nn.Linear(4, 1))
    reference = nn.Sequential(nn.Linear(4, 4), ScaleByMax(), nn.Linear(4, 1))
    reference.load_state_dict(model.state_dict())
    step = deft_compile(model, torch.optim.SGD(model.parameters(), lr=0.01), _mse)
    opt = torch.optim.SGD(reference.parameters(), lr=0.01)
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        x, y = torch.randn(3, 4, generator=g), torch.randn(3, 1, generator=g)
        step(x, y)
        opt.zero_grad()
        _mse(reference(x), y).backward()
        opt.step()
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.equal(a, b)


def test_optimizer_over_foreign_tensors_is_refused():
    model = nn.Linear(4, 1)
    stray = nn.Parameter(torch.zeros(3))
    step = deft_compile(model, torch.optim.SGD([*model.parameters(), stray], lr=0.1), _mse)
    with pytest.raises(TraceError, match="not a parameter of the model"):
        step(torch.randn(2, 4), torch.randn(2, 1))


def test_loss_fn_call_needs_inputs_and_targets():
    model = nn.Linear(4, 1)
    step = deft_compile(model, torch.optim.SGD(model.parameters(), lr=0.1), F.mse_loss)
    with pytest.raises(TraceError, match=r"step\(inputs, targets\)"):
        step(torch.randn(2, 4))


def test_unknown_policy_is_refused():
    model = nn.Linear(4, 1)
    with pytest.raises(ValueError, match="unknown policy 'fastest'"):
        deft_compile(model, torch.optim.SGD(model.parameters(), lr=0.1), policy="fastest")
