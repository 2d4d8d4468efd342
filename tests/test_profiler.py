"""The profiler's compute times: measured on copies, nothing of the live model or the random state changes."""

from __future__ import annotations

import torch

from deft_compile.planner.profiler import measure_node_times
from deft_compile.step.capture import split_user_inputs
from deft_compile.step.optim_support import lr_inputs
from models import captured_batchnorm_cnn


def _captured_and_inputs():
    captured, optimizer, batch = captured_batchnorm_cnn()
    user_tensors, _, _ = split_user_inputs(batch, {})
    state = captured.model_state
    return captured, [*state.params, *state.buffers, *user_tensors, *lr_inputs(optimizer)]


def test_the_live_model_and_random_state_are_untouched():
    captured, inputs = _captured_and_inputs()
    before = [t.clone() for t in inputs]
    rng = torch.get_rng_state()
    measure_node_times(captured, inputs, repeats=1)
    assert all(torch.equal(a, b) for a, b in zip(before, inputs))
    assert torch.equal(rng, torch.get_rng_state())
