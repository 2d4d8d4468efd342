"""Inductor's check of the CPU's vector ISAs starts in the background when an Inductor step is made, and a compile
waits for it (``deft_compile.step.isa_key.start_isa_check``)."""

from __future__ import annotations

import os
import threading
import time

import pytest
from torch._inductor import cpu_vec_isa

from deft_compile.step import isa_key
from deft_compile.step import lowering


@pytest.fixture
def fresh_check(monkeypatch):
    """No background check started yet in this process, and a stand-in for Inductor's check that takes 0.3 s and
    records which thread ran it, when it began and when it ended (its result is the real list, computed once
    here)."""
    real = cpu_vec_isa.valid_vec_isa_list()
    calls: list[tuple[str, float, float]] = []

    def slow_check():
        began = time.perf_counter()
        time.sleep(0.3)
        calls.append((threading.current_thread().name, began, time.perf_counter()))
        return real

    monkeypatch.setattr(isa_key, "_check", None)
    monkeypatch.setattr(cpu_vec_isa, "valid_vec_isa_list", slow_check)
    return calls


def test_the_check_runs_once_in_its_own_thread_and_the_tag_waits_for_it(fresh_check):
    expected = isa_key.isa_cache_tag()  # the stand-in's own call, on this thread
    fresh_check.clear()
    started = time.perf_counter()
    isa_key.start_isa_check()
    isa_key.start_isa_check()  # once per process
    assert time.perf_counter() - started < 0.25, "starting the check does not wait for it"
    assert isa_key.isa_cache_tag() == expected
    calls = {name: (began, ended) for name, began, ended in fresh_check}
    assert [name for name, _, _ in fresh_check].count("deft-vec-isa-check") == 1, fresh_check
    # the pick's own call (the stand-in is not cached) began only after the background check ended
    assert calls[threading.current_thread().name][0] >= calls["deft-vec-isa-check"][1], fresh_check


def test_a_check_that_fails_in_the_background_is_made_again_by_the_compile(fresh_check, monkeypatch):
    real = cpu_vec_isa.valid_vec_isa_list
    failures = []

    def fails_once():
        if not failures:
            failures.append(threading.current_thread().name)
            raise RuntimeError("probe failed")
        return real()

    escaped = []
    monkeypatch.setattr(cpu_vec_isa, "valid_vec_isa_list", fails_once)
    monkeypatch.setattr(threading, "excepthook", escaped.append)
    isa_key.start_isa_check()
    tag = isa_key.isa_cache_tag()
    assert failures == ["deft-vec-isa-check"]
    assert escaped == [], "the thread's failure is logged, not raised"
    assert tag.startswith("deft-vec-isa=")
    assert [name for name, _, _ in fresh_check] == [threading.current_thread().name], "the compile's own check ran"


@pytest.mark.parametrize("compiler, starts", [("inductor", True), ("inductor-graph", True), ("aten", False)])
def test_an_inductor_step_starts_the_check_when_it_is_made(compiler, starts, monkeypatch):
    started = []
    monkeypatch.setattr(lowering, "start_isa_check", lambda: started.append(True))
    lowering.StepLowering(compiler)
    assert bool(started) == starts


def test_the_profile_times_nothing_before_the_check_ended(fresh_check, monkeypatch):
    """Node timing (``time_graph_nodes``: the step's profile, ``profile_model``, the backend's planning) waits for
    the background check: its probe processes would share the cores with the timed runs."""
    from test_profiler import _captured_and_inputs

    from deft_compile.step import profiler
    from deft_compile.step.pipeline import annotate_capture

    timed = []

    class Interpreter:
        def __init__(self, gm):
            timed.append(time.perf_counter())
            raise RuntimeError("stop here")

    monkeypatch.setattr(profiler, "_TimingInterpreter", Interpreter)
    captured, inputs = _captured_and_inputs()
    annotation = annotate_capture(captured)
    isa_key.start_isa_check()
    with pytest.raises(RuntimeError, match="stop here"):
        profiler.profile_step(captured, annotation, inputs, [], 1)
    background = [ended for name, _, ended in fresh_check if name == "deft-vec-isa-check"]
    assert len(background) == 1 and background[0] <= timed[0]


def test_a_fork_waits_for_the_check(fresh_check):
    """``os.fork`` waits for a check that runs (the child would have neither its thread nor its result), and the
    child holds no check of its own until it makes an Inductor step."""
    isa_key.start_isa_check()
    pid = os.fork()
    if pid == 0:  # the child: no check of its own started yet (exit status 0), nothing else
        os._exit(0 if isa_key._check is None else 1)
    forked = time.perf_counter()
    _, status = os.waitpid(pid, 0)
    background = [ended for name, _, ended in fresh_check if name == "deft-vec-isa-check"]
    assert len(background) == 1 and background[0] <= forked
    assert os.waitstatus_to_exitcode(status) == 0, "the child starts its own check"
