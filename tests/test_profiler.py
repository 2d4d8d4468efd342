"""The profiler's compute times: measured on copies, nothing of the live model or the random state changes."""

from __future__ import annotations

import pytest
import torch

from deft_compile.step.pipeline import annotate_capture
from deft_compile.step.profiler import measure_node_times
from deft_compile.timing import Elapsed, HostClock
from deft_compile.step.capture import split_user_inputs
from deft_compile.step.optim_support import hyperparameter_inputs
from models import captured_batchnorm_cnn


def _captured_and_inputs():
    captured, optimizer, batch = captured_batchnorm_cnn()
    user_tensors, _, _ = split_user_inputs(batch, {})
    state = captured.model_state
    return captured, [*state.params, *state.buffers, *user_tensors, *hyperparameter_inputs(optimizer)]


def test_the_live_model_and_random_state_are_untouched():
    captured, inputs = _captured_and_inputs()
    before = [t.clone() for t in inputs]
    rng = torch.get_rng_state()
    measure_node_times(captured, inputs, repeats=1)
    assert all(torch.equal(a, b) for a, b in zip(before, inputs))
    assert torch.equal(rng, torch.get_rng_state())


class _CountingClock(HostClock):
    """The host clock, counting the graph's runs; each run's nodes report ``run_s`` seconds in all, so the budget's
    arithmetic does not depend on the host's speed."""

    def __init__(self, run_s: float) -> None:
        super().__init__()
        self.runs, self.run_s = 0, run_s

    def time_nodes(self, run):
        self.runs += 1
        spans = super().time_nodes(run)
        return [Elapsed(self.run_s * 1e3 / len(spans)) for _ in spans]


@pytest.mark.parametrize("warmup, budget_s, runs", [(1, None, 4), (1, 2.5, 4), (1, 1.5, 3), (1, 0.5, 2), (1, 0.0, 2),
                                                    (0, 0.0, 2), (0, 1.5, 2), (0, 2.5, 3)])
def test_the_timed_runs_stop_once_they_took_the_budget(warmup, budget_s, runs):
    """``warmup`` runs, then up to three timed runs of 1 s of node time each (by the test's clock), no further one
    once the timed runs' nodes took ``budget_s`` together, but at least one timed run after the graph's first: a
    long step is timed once after a warm-up, twice without one."""
    captured, inputs = _captured_and_inputs()
    clock = _CountingClock(1.0)
    times = measure_node_times(captured, inputs, warmup=warmup, repeats=3, clock=clock, budget_s=budget_s)
    assert clock.runs == runs
    computed = [n for n in captured.graph_module.graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
    assert set(times) == set(computed)
    assert sum(times.values()) == pytest.approx(1e3)


def test_the_steps_profile_passes_the_budget(monkeypatch):
    """``profile_step`` times the training step under ``PROFILE_BUDGET_S``."""
    from deft_compile.step import profiler

    seen = {}

    def measured(captured, inputs, **kwargs):
        seen.update(kwargs)
        raise RuntimeError("stop here")

    monkeypatch.setattr(profiler, "measure_node_times", measured)
    captured, inputs = _captured_and_inputs()
    with pytest.raises(RuntimeError, match="stop here"):
        profiler.profile_step(captured, annotate_capture(captured), inputs, [], 1)
    assert seen["budget_s"] == profiler.PROFILE_BUDGET_S


@pytest.fixture(scope="module")
def outcome(request):
    """The per-rank values of the 2-process runs, in one process pair in turn (tests/batched.py)."""
    from batched import Case, launch_cases
    from workers import contention_config_run, contention_probe_run

    return launch_cases(request, [
        Case("probe", contention_probe_run,
             tests=("test_the_contention_probe_agrees_across_ranks_and_reports_none_it_cannot_time",)),
        Case("config", contention_config_run, tests=("test_the_step_takes_its_contention_from_the_config",))])


def test_the_contention_probe_agrees_across_ranks_and_reports_none_it_cannot_time(outcome):
    """2 gloo workers: ``Profile.contention`` from a matmul loop beside one all-reduce is a share in [0, 1],
    the same number on both ranks (each plans from it); a message too short to time reports 0."""
    results = outcome("probe")
    assert results[0] == results[1]
    assert 0.0 <= results[0]["large"] <= 1.0 and results[0]["tiny"] == 0.0


def test_the_step_takes_its_contention_from_the_config(outcome):
    """``DeftConfig.contention``: 0 by default (an accelerator's), a given share as given, None measured (the
    test's small model sends messages too short to time: 0). Out of [0, 1] is refused."""
    from deft_compile import DeftConfig

    results = outcome("config")
    assert results[0] == results[1] == {"default": 0.0, "given": 0.25, "measured": 0.0}
    with pytest.raises(ValueError, match="contention"):
        DeftConfig(contention=1.5)


def test_a_link_probe_takes_fewer_rounds_of_a_size_predicted_to_pass_its_budget():
    """``probe_repeats``: the previous size's time scaled by the size ratio predicts a round; rounds past the
    budget are dropped, down to the fewest allowed; without a budget or a previous size, every round runs."""
    from deft_compile.step.profiler import LEAST_LINK_REPEATS, probe_repeats

    assert probe_repeats(None, 1 << 22, 6, 250.0) == 6
    assert probe_repeats((1 << 20, 40.0), 1 << 22, 6, None) == 6
    assert probe_repeats((1 << 16, 1.0), 1 << 20, 6, 250.0) == 6  # 16 ms a round: all six fit
    assert probe_repeats((1 << 20, 20.0), 1 << 22, 6, 250.0) == 3  # 80 ms a round: three fit
    assert probe_repeats((1 << 20, 40.0), 1 << 22, 6, 250.0) == LEAST_LINK_REPEATS == 3  # 160 ms: the fewest
    assert probe_repeats((1 << 20, 40.0), 1 << 22, 2, 250.0) == 2  # never more than asked
