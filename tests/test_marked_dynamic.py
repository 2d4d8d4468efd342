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


def test_a_mark_is_read_as_torch_compile_reads_it():
    """``mark_dynamic`` stores the index as given: -1 marks the last dimension, and an index outside the input's
    rank marks nothing (the step stays static)."""
    from deft_compile import DeftConfig, deft_compile
    from deft_compile.step.symbolic import ShapeFamilies

    inputs = batch(9, torch.Generator().manual_seed(0))
    torch._dynamo.mark_dynamic(inputs[0], -1)
    torch._dynamo.mark_dynamic(inputs[1], 5)
    assert ShapeFamilies.marked(inputs) == {(0, 1)}
    model = small_gpt()
    step = deft_compile(model, torch.optim.SGD(model.parameters(), lr=0.05), config=DeftConfig(compiler="aten"))
    unmarked = batch(9, torch.Generator().manual_seed(0))
    torch._dynamo.mark_dynamic(unmarked[0], 5)
    step(*unmarked)
    assert step.capture_count == 1 and not step.runner.cache.captures[next(iter(step.runner.cache.captures))].symbolic
