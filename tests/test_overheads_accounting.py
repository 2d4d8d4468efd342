"""``CompiledStep.overheads`` counts each second once: the step's ``make_fx`` captures in ``capture_seconds``, the
passes and regions of each step graph in ``graph_seconds``, and the eager pass before the first capture in
``planning_seconds`` (one process, aten: no Inductor, no communication)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from deft_compile import DeftConfig, deft_compile


def test_captures_graphs_and_planning_are_counted_apart() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = deft_compile(model, optimizer, F.cross_entropy, policy="wfbp",
                        config=DeftConfig(compiler="aten", dynamic_shapes=False))
    cache = step.runner.cache
    step(torch.randn(6, 8), torch.randint(0, 4, (6,)))
    first = dict(step.overheads)
    assert first["captures"] == 1 and first["graphs"] == 1, first
    assert first["capture_seconds"] > 0 and first["graph_seconds"] > 0, first
    # the one graph built so far traced its capture inside: its build time is the two accounts together
    assert abs(cache.last_trace_seconds - first["capture_seconds"] - first["graph_seconds"]) < 1e-9, first
    # the eager forward and backward that creates AdamW's state before the capture is planning's
    assert first["planning_seconds"] > 0, first

    step(torch.randn(6, 8), torch.randint(0, 4, (6,)))  # the same shapes: nothing built, nothing counted
    assert step.overheads == first

    step(torch.randn(5, 8), torch.randint(0, 4, (5,)))  # a new batch size: a second capture and graph
    second = dict(step.overheads)
    assert second["captures"] == 2 and second["graphs"] == 2, second
    captured = second["capture_seconds"] - first["capture_seconds"]
    built = second["graph_seconds"] - first["graph_seconds"]
    assert captured > 0 and built > 0, second
    assert abs(cache.last_trace_seconds - captured - built) < 1e-9, second
    assert second["planning_seconds"] == first["planning_seconds"], "only the first call plans"
