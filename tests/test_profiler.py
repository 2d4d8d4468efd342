"""The profiler's compute times: node minima scaled to the graph run whole."""

from __future__ import annotations

import time

import torch

from deft_compile.planner.profiler import measure_node_times, scaled_to_whole
from deft_compile.step.capture import capture_step, split_user_inputs
from deft_compile.step.optim_support import lr_inputs
from models import BatchNormCNN


def _captured_and_inputs():
    torch.manual_seed(0)
    model = BatchNormCNN()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    batch = (torch.randn(4, 3, 8, 8), torch.randint(0, 5, (4,)))
    loss_fn = lambda out, y: torch.nn.functional.cross_entropy(out, y)  # noqa: E731
    captured = capture_step(model, optimizer, loss_fn, batch, {}, [])
    user_tensors, _, _ = split_user_inputs(batch, {})
    state = captured.model_state
    return captured, [*state.params, *state.buffers, *user_tensors, *lr_inputs(optimizer)]


def test_node_times_add_up_to_the_whole_graph():
    """A whole run meets time that no single node shows (here 60 ms added to every whole run, as another rank's
    compute on a shared core or the dispatch between nodes would): calibrated node times add up to at least that,
    uncalibrated ones do not."""
    captured, inputs = _captured_and_inputs()
    plain_forward = captured.graph_module.forward

    def slower(*args):
        time.sleep(0.06)
        return plain_forward(*args)

    captured.graph_module.forward = slower
    calibrated = measure_node_times(captured, inputs, repeats=2)
    uncalibrated = measure_node_times(captured, inputs, repeats=2, calibrate=False)
    assert calibrated.keys() == uncalibrated.keys()
    assert sum(calibrated.values()) >= 60.0 > sum(uncalibrated.values())


def test_scaling_keeps_each_nodes_share():
    scaled = scaled_to_whole({"a": 1.0, "b": 3.0}, [10.0, 40.0, 12.0])  # median 12 ms
    assert scaled == {"a": 3.0, "b": 9.0}
    assert scaled_to_whole({"a": 1.0}, []) == {"a": 1.0}


def test_the_live_model_and_random_state_are_untouched():
    captured, inputs = _captured_and_inputs()
    before = [t.clone() for t in inputs]
    rng = torch.get_rng_state()
    measure_node_times(captured, inputs, repeats=1)
    assert all(torch.equal(a, b) for a, b in zip(before, inputs))
    assert torch.equal(rng, torch.get_rng_state())
