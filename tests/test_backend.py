"""``torch.compile(model, backend="deft")`` (world size 2, gloo, real processes).

- Synchronous mode equals torch DDP after every step, bit-identical (max
  absolute parameter difference 0.0, loss difference 0.0), with SGD momentum
  and weight decay, with and without a graph break, starting from different
  weights on each rank (the first call broadcasts rank 0's).
- Delayed mode equals an eager reference of the semantics in docs/BACKEND.md,
  bit-identical, for all parameters delayed and for a per-parameter selection,
  including the ``flush`` after the last step.
- ``deft`` is found through the real ``torch_dynamo_backends`` entry point.
"""

from __future__ import annotations

import importlib.metadata

import pytest

from backend_workers import STEPS, all_scenarios
from deft_compile.backend.options import parse_options
from deft_compile.tools.launcher import run_local_workers


@pytest.fixture(scope="module")
def reports() -> list[dict]:
    results = run_local_workers(all_scenarios, 2, timeout_s=180)
    return [r.value for r in results]


def _assert_exact(steps: list[dict], where: str) -> None:
    assert len(steps) == STEPS
    for t, step in enumerate(steps):
        assert step["max_abs"] == 0.0, f"{where} step {t}: {step}"


@pytest.mark.parametrize("scenario", ["sync_mlp", "sync_graph_break"])
def test_sync_equals_ddp_after_every_step(reports, scenario):
    for rank, report in enumerate(reports):
        result = report[scenario]
        _assert_exact(result["steps"], f"{scenario} rank {rank}")
        for step in result["steps"]:
            assert step["loss_diff"] == 0.0
            assert step["input_grad_diff"] == 0.0, "a non-parameter input gradient was averaged"
        assert not any(result["delayed"])
        schedule = result["schedule"]
        assert schedule["all_reduces"] == schedule["buckets"] == sum(result["buckets"])
        assert sum(result["buckets"]) >= 3, "the tiny bucket caps should give several buckets"
        assert schedule["launch_after_last_gradient"] and schedule["waits_at_end"]


def test_graph_break_gives_two_graphs_with_their_own_parameters(reports):
    for report in reports:
        assert report["sync_mlp"]["graphs"] == 1
        assert report["sync_graph_break"]["graphs"] == 2
        assert all(count >= 1 for count in report["sync_graph_break"]["buckets"]), "each graph averages its own parameters"


@pytest.mark.parametrize("scenario", ["delay_all", "delay_first_layer"])
def test_delayed_equals_reference(reports, scenario):
    for rank, report in enumerate(reports):
        result = report[scenario]
        _assert_exact(result["steps"], f"{scenario} rank {rank}")
        assert result["flush"]["max_abs"] == 0.0, f"{scenario} rank {rank} after flush"
        assert result["first_step_untouched"], "first step must leave delayed parameters and their state alone"
        assert result["flushed"] == result["delayed_names"]
        assert result["second_flush_empty"]
        assert result["schedule"]["launch_after_last_gradient"] and result["schedule"]["waits_at_end"]


def test_per_parameter_selection_splits_buckets(reports):
    buckets = reports[0]["delay_first_layer"]["buckets"]
    assert any(delayed for _, delayed in buckets) and not all(delayed for _, delayed in buckets)
    assert all(delayed for _, delayed in reports[0]["delay_all"]["buckets"])


def test_registered_through_entry_point():
    """The installed distribution declares the entry point, and torch discovers it through it."""
    names = [ep.name for ep in importlib.metadata.entry_points(group="torch_dynamo_backends")]
    assert "deft" in names, "reinstall with `pip install -e .` after adding the entry point to pyproject.toml"
    (entry,) = [ep for ep in importlib.metadata.entry_points(group="torch_dynamo_backends") if ep.name == "deft"]
    assert entry.value == "deft_compile.backend:deft_backend"

    import torch._dynamo
    from torch._dynamo.backends.registry import lookup_backend

    from deft_compile.backend import deft_backend

    assert "deft" in torch._dynamo.list_backends()
    assert lookup_backend("deft") is deft_backend


def test_options_are_checked():
    with pytest.raises(ValueError, match="unknown option.*bucket_cap"):
        parse_options({"bucket_cap": 1})
    with pytest.raises(ValueError, match="positive"):
        parse_options({"bucket_cap_mb": 0})
    with pytest.raises(ValueError, match="nn.Parameter"):
        parse_options({"delay": ["a.weight"]})
    assert parse_options({"delay": True}).delay_all


def test_single_process_has_no_collectives_but_still_delays():
    """Without a process group nothing is communicated; delay keeps its meaning (numbers do not depend on world size)."""
    import torch
    import torch.nn as nn

    import deft_compile.backend as backend
    from deft_compile.passes.collectives import COLLECTIVES, WAIT

    torch._dynamo.reset()
    backend.reset()
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
        compiled = torch.compile(model, backend="deft", options={"delay": list(model[0].parameters())})
        grads = []
        for _ in range(2):
            model.zero_grad()
            compiled(torch.randn(5, 3)).sum().backward()
            grads.append([p.grad is None for p in model.parameters()])
        assert grads == [[True, True, False, False], [False, False, False, False]]
        (record,) = backend.compiled_backwards()
        targets = {node.target for node in record.graph_module.graph.nodes}
        assert not targets & {*COLLECTIVES, WAIT}
        assert set(backend.flush(model)) == set(model[0].parameters())
    finally:
        torch._dynamo.reset()
        backend.reset()
