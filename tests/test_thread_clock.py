"""The step thread's clocks (``deft_compile.step.thread_clock``): CPU time and run-queue delay, read for real."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from deft_compile.step.thread_clock import SCHEDSTAT, ThreadClock, run_queue_seconds

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="run-queue delay is read from Linux's /proc")


@linux_only
def test_the_kernel_reports_the_run_queue_delay_here():
    """CI runs on Linux, where the closed loop measures the contention from this file; if it went missing the
    loop would silently fall back to the profile's contention, so its absence fails here."""
    assert os.path.exists(SCHEDSTAT)
    assert run_queue_seconds() is not None and run_queue_seconds() >= 0.0


@linux_only
def test_the_run_queue_delay_counts_the_time_another_process_held_the_core():
    """Pinned to one core beside a busy process pinned to the same core, a busy loop runs about half its wall
    time and waits for the core the other half: the CPU time sees only the first, the run-queue delay the second,
    and the two never add up to more than the wall time."""
    affinity = os.sched_getaffinity(0)
    core = min(affinity)
    competitor = subprocess.Popen([sys.executable, "-c", (
        f"import os, time\nos.sched_setaffinity(0, {{{core}}})\nend = time.time() + 5\n"
        "while time.time() < end:\n    pass\n")])
    clock = ThreadClock()
    try:
        os.sched_setaffinity(0, {core})  # the calling thread only
        time.sleep(0.3)  # the competitor is running
        clock.start()
        started = time.perf_counter()
        while time.perf_counter() - started < 0.6:
            pass
        wall = time.perf_counter() - started
        cpu, queued = clock.stop()
    finally:
        os.sched_setaffinity(0, affinity)
        competitor.kill()
        competitor.wait()
    assert queued is not None
    assert queued >= 0.2 * wall, (cpu, queued, wall)  # about half; another load on the host only adds to it
    assert cpu <= 0.8 * wall, (cpu, queued, wall)
    assert cpu + queued <= 1.05 * wall, (cpu, queued, wall)


def test_a_sleeping_thread_neither_runs_nor_waits_for_its_core():
    """Asleep (as the step thread is while it waits for a collective), the thread is neither running nor queued:
    what the closed loop counts as neither compute nor contention."""
    clock = ThreadClock()
    clock.start()
    time.sleep(0.3)
    cpu, queued = clock.stop()
    assert cpu < 0.05
    assert queued is None or queued < 0.05
