"""The step thread's own clocks: the CPU time it ran, and the time it was ready to run but waited for its core.

A step's wall time on a CPU host splits three ways: the step thread running (``time.thread_time``), the step
thread runnable while another thread held its core (the run-queue delay, the kernel's ``run_delay``), and the
step thread asleep (waiting for a collective). The closed loop reads the first two around every step: the CPU
time bounds the refined compute (``planner.refine.compute_floor``), and the run-queue delay measures what
communication running beside the step cost it (``planner.refine.measured_contention``), which the step's time alone
cannot tell apart from a slow link.

The run-queue delay comes from ``/proc/thread-self/schedstat`` (Linux, kernels with scheduler statistics: its
second field, in nanoseconds). Where that file does not exist, ``ThreadClock.run_queue`` is None and the closed
loop falls back to what it did without it.
"""

from __future__ import annotations

import time

SCHEDSTAT = "/proc/thread-self/schedstat"


def run_queue_seconds() -> float | None:
    """The calling thread's run-queue delay so far (seconds it was runnable but not running), or None where the
    kernel does not report it."""
    try:
        with open(SCHEDSTAT, "rb") as stats:
            fields = stats.read().split()
        return int(fields[1]) * 1e-9
    except (OSError, IndexError, ValueError):
        return None


class ThreadClock:
    """``start()`` before a step, ``stop()`` after it on the same thread: (CPU seconds, run-queue seconds or
    None) the calling thread spent in between."""

    def __init__(self) -> None:
        self._cpu = 0.0
        self._queue: float | None = None

    def start(self) -> None:
        self._queue = run_queue_seconds()
        self._cpu = time.thread_time()

    def stop(self) -> tuple[float, float | None]:
        cpu = time.thread_time() - self._cpu
        queue = run_queue_seconds()
        waited = None if queue is None or self._queue is None else max(0.0, queue - self._queue)
        return cpu, waited
