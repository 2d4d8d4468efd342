"""Where a policy's first call applies every update it computes, the optimizer's state is created before the
first capture (``optim_support.initialize_state``): the step is captured once, its second call builds no new
trace, and the numbers are those of the state the traced first update would have made, bit for bit (in one
process; the 2-process comparisons with DDP in tests/test_equivalence_ddp.py and tests/test_policies.py run the
same path)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from deft_compile import DeftConfig, deft_compile
from deft_compile.step.optim_support import initialize_state


class _WithUnused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        self.unused = nn.Linear(3, 3)  # trained, but never reached by the loss

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


OPTIMIZERS = {
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    "adam-amsgrad": lambda p: torch.optim.Adam(p, lr=1e-2, amsgrad=True, weight_decay=0.01),
    "rmsprop-centered": lambda p: torch.optim.RMSprop(p, lr=1e-2, momentum=0.9, centered=True),
    "sgd-nesterov": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3),
}


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [(torch.randn(6, 8, generator=generator), torch.randint(0, 4, (6,), generator=generator))
            for _ in range(n)]


def _train(name: str, base: nn.Module, steps: int) -> tuple[nn.Module, torch.optim.Optimizer, object]:
    model = copy.deepcopy(base)
    optimizer = OPTIMIZERS[name](model.parameters())
    step = deft_compile(model, optimizer, F.cross_entropy, policy="wfbp", config=DeftConfig(compiler="aten"))
    for x, y in _batches(steps):
        step(x, y)
    return model, optimizer, step


def _check_same(name: str, a: tuple, b: tuple) -> None:
    (model, optimizer, _), (other, other_optimizer, _) = a, b
    for (n, p), q in zip(model.named_parameters(), other.parameters()):
        assert torch.equal(p, q), f"{name}: {n}"
        state, expected = optimizer.state.get(p, {}), other_optimizer.state.get(q, {})
        assert state.keys() == expected.keys(), f"{name} {n}: {state.keys()} against {expected.keys()}"
        for key in state:
            assert torch.equal(torch.as_tensor(state[key]), torch.as_tensor(expected[key])), (name, n, key)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_one_capture_and_the_numbers_of_a_state_made_by_the_first_update(name, monkeypatch):
    """Against the same step with the state left to the traced first update (the second call's update traced
    again): bit for bit, state keys included; a parameter the loss never reaches gets no state."""
    torch.manual_seed(0)
    base = _WithUnused()
    initialized = _train(name, base, 4)
    assert initialized[2].capture_count == 1, "the second call reuses the first call's capture"
    assert not initialized[1].state.get(initialized[0].unused.weight)
    from deft_compile.step import optim_support

    monkeypatch.setattr(optim_support, "initialize_state", lambda optimizer, trained: False)
    lazy = _train(name, base, 4)
    # the second call's capture has the state as inputs: the update traced alone, on the first's forward and backward
    assert lazy[2].capture_count == 1 and lazy[2].overheads["update_recaptures"] == 1
    _check_same(name, initialized, lazy)


@pytest.mark.parametrize("name", ["rmsprop-centered", "sgd-nesterov"])
def test_eager_numbers_bit_for_bit(name):
    """SGD and RMSprop have no bias correction (which the capturable Adam computes in float32 tensors, eager in
    Python floats: round-off, tests/test_local.py): eager PyTorch's numbers and state exactly."""
    torch.manual_seed(0)
    base = _WithUnused()
    eager = copy.deepcopy(base)
    eager_optimizer = OPTIMIZERS[name](eager.parameters())
    for x, y in _batches(4):
        eager_optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(eager(x), y).backward()
        eager_optimizer.step()
    _check_same(name, _train(name, base, 4), (eager, eager_optimizer, None))


def test_state_is_left_alone_where_its_first_update_would_differ():
    model = nn.Linear(2, 2)
    dampened = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, dampening=0.5)
    assert not initialize_state(dampened, list(model.parameters())) and not dampened.state
    adagrad = torch.optim.Adagrad(model.parameters())  # its state exists from the constructor
    assert not initialize_state(adagrad, list(model.parameters()))
    adam = torch.optim.Adam(model.parameters())
    assert initialize_state(adam, [model.weight])
    assert set(adam.state[model.weight]) == {"step", "exp_avg", "exp_avg_sq"} and model.bias not in adam.state
    assert float(adam.state[model.weight]["step"]) == 0.0 and not adam.state[model.weight]["exp_avg"].any()
    assert model.weight.grad is None and adam.param_groups[0]["capturable"] is False, "the groups are restored"
    assert not initialize_state(adam, [model.weight]), "state that exists is never replaced"


def test_policies_that_move_updates_keep_the_lazy_state():
    """ByteScheduler applies each update in the next call on a process group: no parameter may hold state
    before its first update, as under eager PyTorch, so its step is captured once without state and once with it
    (that one tracing the update alone, on the first capture's forward and backward)."""
    torch.manual_seed(0)
    model = _WithUnused()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = deft_compile(model, optimizer, F.cross_entropy, policy="bytescheduler", config=DeftConfig(compiler="aten"))
    for x, y in _batches(2):
        step(x, y)
    assert step.capture_count == 1 and step.overheads["update_recaptures"] == 1
