"""The device clock (deft_compile.timing): chosen by the device, read once per window, brackets each profiled node.

The CUDA branch runs here with host stand-ins for its events and its device sleep, so its bookkeeping (what is
recorded where, what is read when) is checked on a machine without a GPU; benchmarks/gpu_check.py checks it on one.
"""

from __future__ import annotations

import time

import pytest
import torch

from deft_compile.timing import CudaClock, Elapsed, EventElapsed, HostClock, clock_for, comm_device, resolve_ms
from deft_compile.tools.launcher import run_local_workers
from timing_workers import HostEvent, closed_loop_on_device_clock


@pytest.mark.parametrize("available", [True, False])
def test_the_clock_follows_the_device_never_the_machine(monkeypatch, available):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    assert type(clock_for("cpu")) is HostClock
    assert type(clock_for(torch.device("cpu"))) is HostClock
    assert type(clock_for(None)) is HostClock
    assert type(clock_for("cuda")) is CudaClock and type(clock_for(torch.device("cuda", 1))) is CudaClock
    assert clock_for("cuda:1").device == torch.device("cuda", 1)


def test_a_device_span_is_read_only_when_resolved():
    HostEvent.reads = []
    clock = CudaClock("cuda", event_factory=HostEvent, synchronize=lambda: None)
    spans = []
    for _ in range(3):
        mark = clock.mark()
        time.sleep(0.002)
        spans.append(clock.since(mark).plus(1.0))
    assert all(isinstance(span, EventElapsed) for span in spans)
    assert HostEvent.reads == []  # nothing waited for while the spans were taken
    values = resolve_ms([*spans, 2.5, Elapsed(4.0)])
    assert len(HostEvent.reads) == 3  # each end event read once
    assert all(3.0 <= v < 1000.0 for v in values[:3]) and values[3:] == [2.5, 4.0]
    assert resolve_ms(spans) == values[:3] and len(HostEvent.reads) == 3  # read once, remembered


def test_the_host_clock_times_calls_and_nodes():
    clock = HostClock()
    result, ms = clock.time_call(lambda: time.sleep(0.003) or 7)
    assert result == 7 and ms >= 3.0
    spans = clock.time_nodes(lambda timed: [timed(lambda: time.sleep(0.001)) for _ in range(4)])
    assert len(spans) == 4 and all(span.ms >= 1.0 for span in spans)


def test_the_profiler_brackets_every_node_behind_a_device_sleep():
    """On a device the profiler queues each node's kernels behind a short device sleep (and a run behind a longer
    one), brackets them with events and reads the events after the run: every timed node gets a time."""
    from deft_compile.step.profiler import measure_node_times
    from deft_compile.step.optim_support import hyperparameter_inputs
    from models import captured_batchnorm_cnn

    captured, optimizer, batch = captured_batchnorm_cnn()
    inputs = [*captured.model_state.params, *captured.model_state.buffers, *batch, *hyperparameter_inputs(optimizer)]
    sleeps: list[float] = []
    syncs: list[int] = []
    HostEvent.reads = []
    clock = CudaClock("cuda", event_factory=HostEvent, sleep=sleeps.append, synchronize=lambda: syncs.append(1))
    times = measure_node_times(captured, inputs, warmup=1, repeats=2, clock=clock)
    computed = [n for n in captured.graph_module.graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
    assert set(times) == set(computed) and all(ms >= 0.0 for ms in times.values())
    runs = 3
    assert len(sleeps) == runs * (len(computed) + 1)  # one lead per run, one per node
    assert sleeps.count(max(sleeps)) == runs and max(sleeps) > min(sleeps)
    # each timed run's node spans read once, after the run; the warm-up run's are never read
    assert len(HostEvent.reads) == (runs - 1) * len(computed)
    assert len(syncs) == 2 * runs  # before and after each run, never inside it


def test_collectives_take_tensors_where_their_backend_does(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "get_backend", lambda group: group)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setitem(dist.Backend.backend_capability, "device_only", ["cuda"])
    assert comm_device("gloo") == torch.device("cpu")
    assert comm_device("nccl") == torch.device("cuda", 0)
    assert comm_device("device_only") == torch.device("cuda", 0)


def test_the_closed_loop_reads_the_device_clock_once_per_window():
    """With events for a clock, a step's time is read when its window (or duel block) completes, all of the window
    at once, and never in the step that recorded it otherwise: most steps read nothing."""
    steps = 24
    results = [r.value for r in run_local_workers(closed_loop_on_device_clock, 2, (steps,), timeout_s=240)]
    for report in results:
        reads, measured = report["reads"], report["measured_steps"]
        assert measured >= 3, report
        reading_steps = sorted(set(reads))
        assert len(reading_steps) < steps / 2, report  # windows complete now and then, not every step
        assert len(reads) >= measured, report  # every measured step's time was read
    assert results[0]["windows"] == results[1]["windows"]
