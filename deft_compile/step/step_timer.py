"""What one call of the step measured about itself, for the controllers that run after it.

- ``seconds``: the call's wall-clock time (the Preserver prices its own measurements against it);
- ``elapsed``: the call on the step's device clock (``deft_compile.timing``: CUDA events on a GPU, read when the
  closed loop's window completes), taken only when the closed loop runs;
- ``cpu_seconds`` and ``run_queue_seconds``: the step thread's CPU time and run-queue delay
  (``step.thread_clock``), read only when the closed loop runs and the step's kernels run on the step thread
  (a CPU device): two reads of ``/proc``, about 16 µs;
- ``measurable``: the call ran no graph cold (no compile, no first run), so its time is the plan's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from deft_compile.step.lowering import StepLowering
from deft_compile.step.thread_clock import ThreadClock


@dataclass(frozen=True)
class StepTiming:
    seconds: float
    elapsed: Any  # deft_compile.timing.Elapsed, or None when not taken
    cpu_seconds: float | None
    run_queue_seconds: float | None
    measurable: bool


class StepTimer:
    """``start`` before a call's graph runs, ``stop`` after its bookkeeping: the call's ``StepTiming``."""

    def __init__(self, lowering: StepLowering, cpu_timed: bool) -> None:
        self.lowering = lowering
        # the step thread's CPU time is its compute, and its run-queue delay what other threads took from that
        # compute, only where it runs the kernels itself (planner.refine.compute_floor, measured_contention)
        self.cpu_timed = cpu_timed
        self._thread_clock = ThreadClock()
        self._clock: Any = None
        self._cold_runs = 0
        self._started = 0.0
        self._mark: Any = None
        self._clocked = False

    def start(self, clock: Any, *, device_clock: bool) -> None:
        """``clock``: the step's device clock (``deft_compile.timing``); ``device_clock``: read it, and the
        thread's clocks, too (the closed loop runs)."""
        self._clock = clock
        self._cold_runs = self.lowering.cold_runs
        self._started = time.perf_counter()
        self._mark = clock.mark() if device_clock else None
        self._clocked = device_clock and self.cpu_timed
        if self._clocked:
            self._thread_clock.start()

    def stop(self) -> StepTiming:
        # the thread's clocks are read inside the step's own span (started after its mark, stopped before its
        # end is read), so their times never hold a wait that the step's time does not
        cpu_seconds, queue_seconds = self._thread_clock.stop() if self._clocked else (None, None)
        elapsed = self._clock.since(self._mark) if self._mark is not None else None
        seconds = time.perf_counter() - self._started
        return StepTiming(seconds, elapsed, cpu_seconds, queue_seconds, self.lowering.cold_runs == self._cold_runs)
