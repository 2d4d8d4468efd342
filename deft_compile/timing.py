"""Device-correct timing: the one clock the profiler, the closed loop and the benchmarks measure with.

On a CPU device the calling thread runs the kernels itself, so a host clock (``time.perf_counter``) read around
them is their time. On a CUDA device the calling thread only launches kernels; the device runs them later, on its
streams, and a host clock measures launches. There the clock records CUDA events on the current stream and reads
them after one synchronise at the end of a measured window (``resolve_ms``), never inside the step.

Which clock runs is chosen by the device of the tensors being timed (``clock_for``), never by whether the machine
has a GPU: a CPU model on a GPU host is timed on the host, a CUDA model always with events.

Per-node times of a graph on CUDA (``Clock.time_nodes``) come from an event pair around each node's kernels, with
the node's launches queued behind a short device-side sleep: the device then runs the node's kernels back to back,
so the pair measures the kernels and not the host's launch gaps.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Iterable

import torch

#: host-side launch time a device-side sleep before each timed node must cover (seconds of device time)
NODE_SLEEP_S = 100e-6
#: device-side sleep before a timed run of nodes, so the host starts well ahead of the device
RUN_LEAD_S = 5e-3


class Elapsed:
    """A measured span on the host clock: its milliseconds are known at once."""

    __slots__ = ("_ms",)

    def __init__(self, ms: float) -> None:
        self._ms = float(ms)

    @property
    def ms(self) -> float:
        return self._ms

    def plus(self, extra_ms: float) -> "Elapsed":
        """This span with ``extra_ms`` added (an injected cost)."""
        return Elapsed(self._ms + extra_ms) if extra_ms else self

    def __repr__(self) -> str:
        return f"Elapsed({self._ms:.3f} ms)"


class EventElapsed(Elapsed):
    """A measured span between two recorded device events: read (``ms``) only after the end event completed,
    which ``resolve_ms`` waits for once per window."""

    __slots__ = ("start", "end", "extra")

    def __init__(self, start: Any, end: Any, extra: float = 0.0) -> None:  # noqa: D107 - events, not ms
        self.start, self.end, self.extra = start, end, float(extra)
        self._ms = math.nan

    @property
    def ms(self) -> float:
        if math.isnan(self._ms):
            self.end.synchronize()
            self._ms = float(self.start.elapsed_time(self.end))
        return self._ms + self.extra

    def plus(self, extra_ms: float) -> "EventElapsed":
        return EventElapsed(self.start, self.end, self.extra + extra_ms) if extra_ms else self

    def __repr__(self) -> str:
        return "EventElapsed(pending)" if math.isnan(self._ms) else f"EventElapsed({self._ms + self.extra:.3f} ms)"


def resolve_ms(samples: Iterable[float | Elapsed]) -> list[float]:
    """Milliseconds of each sample (plain numbers pass through). Device spans are read after their end events
    completed: the first unread one waits for the device, the rest are then ready (events of one stream complete
    in order)."""
    return [float(s) if not isinstance(s, Elapsed) else s.ms for s in samples]


class HostClock:
    """Times work the calling thread runs itself (CPU tensors)."""

    kind = "host"

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)

    def mark(self) -> Any:
        """A point on this clock, taken now."""
        return time.perf_counter()

    def since(self, mark: Any) -> Elapsed:
        """The span from ``mark`` to now."""
        return Elapsed((time.perf_counter() - mark) * 1e3)

    def synchronize(self) -> None:
        """Wait until the work issued so far has run (nothing to wait for on the host)."""

    def time_call(self, fn: Callable[[], Any]) -> tuple[Any, float]:
        """``(fn(), milliseconds it took)``, outside any step: the work issued before is finished first."""
        self.synchronize()
        started = self.mark()
        result = fn()
        return result, self.since(started).ms

    def time_nodes(self, run: Callable[[Callable[[Callable[[], Any]], Any]], Any]) -> list[Elapsed]:
        """Per-node spans of one run: ``run(timed)`` calls ``timed(thunk)`` around each node's work, in order."""
        spans: list[Elapsed] = []

        def timed(thunk: Callable[[], Any]) -> Any:
            started = time.perf_counter()
            result = thunk()
            spans.append(Elapsed((time.perf_counter() - started) * 1e3))
            return result

        run(timed)
        return spans


class CudaClock(HostClock):
    """Times work a CUDA device runs: events on the current stream, read after a synchronise.

    ``event_factory`` and ``sleep`` are the device's (``torch.cuda.Event(enable_timing=True)`` and
    ``torch.cuda._sleep``) unless given: tests pass host stand-ins to check the bookkeeping on a machine
    without a GPU.
    """

    kind = "cuda"

    def __init__(self, device: torch.device | str = "cuda", *, event_factory: Callable[[], Any] | None = None,
                 sleep: Callable[[float], None] | None = None, synchronize: Callable[[], None] | None = None) -> None:
        super().__init__(device)
        self._event_factory = event_factory
        self._sleep = sleep
        self._synchronize = synchronize
        self._cycles_per_s: float | None = None

    def _event(self) -> Any:
        if self._event_factory is not None:
            return self._event_factory()
        return torch.cuda.Event(enable_timing=True)

    def mark(self) -> Any:
        event = self._event()
        event.record()
        return event

    def since(self, mark: Any) -> EventElapsed:
        return EventElapsed(mark, self.mark())

    def synchronize(self) -> None:
        if self._synchronize is not None:
            self._synchronize()
        else:
            torch.cuda.synchronize(self.device)

    def time_call(self, fn: Callable[[], Any]) -> tuple[Any, float]:
        self.synchronize()
        started = self.mark()
        result = fn()
        span = self.since(started)
        self.synchronize()  # the call's work on other streams (a collective's) is done too
        return result, span.ms

    def device_sleep(self, seconds: float) -> None:
        """Keep the current stream busy for about ``seconds`` of device time (the host returns at once)."""
        if self._sleep is not None:
            self._sleep(seconds)
            return
        torch.cuda._sleep(max(1, int(seconds * self.cycles_per_second())))

    def cycles_per_second(self) -> float:
        """``torch.cuda._sleep``'s cycles per second of device time, measured once with events."""
        if self._cycles_per_s is None:
            cycles = 1_000_000
            torch.cuda._sleep(cycles)  # warm-up
            _, ms = self.time_call(lambda: torch.cuda._sleep(cycles))
            self._cycles_per_s = cycles / max(ms * 1e-3, 1e-9)
        return self._cycles_per_s

    def time_nodes(self, run: Callable[[Callable[[Callable[[], Any]], Any]], Any]) -> list[Elapsed]:
        """Per-node device spans of one run. The run starts behind a device-side sleep (``RUN_LEAD_S``) and each
        node's launches behind a shorter one (``NODE_SLEEP_S``), so the host is ahead of the device and every event
        pair brackets kernels queued back to back; the spans are read after one synchronise at the end."""
        spans: list[EventElapsed] = []
        self.synchronize()
        self.device_sleep(RUN_LEAD_S)

        def timed(thunk: Callable[[], Any]) -> Any:
            self.device_sleep(NODE_SLEEP_S)
            started = self.mark()
            result = thunk()
            spans.append(self.since(started))
            return result

        run(timed)
        self.synchronize()
        return spans


def clock_for(device: torch.device | str | None) -> HostClock:
    """The clock for work on ``device``: CUDA events for a CUDA device, the host clock for any other (CPU,
    meta). Chosen by the device alone, never by ``torch.cuda.is_available()``."""
    device = torch.device(device if device is not None else "cpu")
    if device.type == "cuda":
        return CudaClock(device)
    return HostClock(device)


def device_of(model: torch.nn.Module) -> torch.device:
    """The device of ``model``'s first parameter (or buffer); CPU for a module with neither."""
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device
    return torch.device("cpu")


def comm_device(group: Any) -> torch.device:
    """Where a tensor handed to ``group``'s collectives must live: the host where the group's backend takes host
    tensors (gloo), else the current CUDA device (NCCL, and backends registered for CUDA alone)."""
    import torch.distributed as dist

    backend = str(dist.get_backend(group)).lower()
    devices = dist.Backend.backend_capability.get(backend, ["cpu"])
    if "cpu" in devices:
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())
