"""An input dimension marked with ``torch._dynamo.mark_dynamic`` is symbolic from the step's first call
(``step/symbolic.py``): one capture serves every length, with the numbers of the capture that becomes symbolic at
the second length (the aten route, so bit for bit). The Inductor route's compile counts are in
tests/test_shapes.py."""

from __future__ import annotations

import torch

from shape_workers import batch, small_gpt, train_lengths

LENGTHS = [9, 13, 7, 17, 13]


def test_a_marked_length_is_captured_once_with_the_same_numbers():
    marked, unmarked = train_lengths("aten", LENGTHS, mark_dynamic=True), train_lengths("aten", LENGTHS)
    assert marked["captures"] == 1 and unmarked["captures"] == 2
    assert marked["losses"] == unmarked["losses"]
    for name, value in marked["params"].items():
        assert torch.equal(value, unmarked["params"][name]), name


def test_a_mark_on_a_dimension_the_input_lacks_is_ignored():
    """A mark names a dimension by index; one past the input's rank changes nothing (the step stays static)."""
    from deft_compile import DeftConfig, deft_compile

    model = small_gpt()
    step = deft_compile(model, torch.optim.SGD(model.parameters(), lr=0.05), config=DeftConfig(compiler="aten"))
    inputs = batch(9, torch.Generator().manual_seed(0))
    inputs[0]._dynamo_dynamic_indices = {5}
    step(*inputs)
    assert step.runner.capture_count == 1 and not step.runner.captures[next(iter(step.runner.captures))].symbolic
