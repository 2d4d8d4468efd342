"""A one-process stand-in for a data-parallel job on one device: a process-group backend whose peers mirror rank 0,
behind an emulated link whose all-reduce takes ``alpha_ms + beta_ms_per_byte * bytes``.

Why: one GPU cannot host two NCCL ranks, and gloo between two processes on one GPU measures the host's copies, not
a link. Here the one process is rank 0 of ``world_size`` identical ranks: every peer computed the same gradient, so
an all-reduce (sum) multiplies by ``world_size`` and the averaged gradient equals the local one (training matches a
single process exactly). What the step sees of the link is its time:

* CUDA tensors: the collective runs on a side stream that first waits for the data (the compute stream's work so
  far), sleeps on the device for the link's time (``torch.cuda._sleep``, calibrated once), then writes the result.
  ``wait()`` makes the current stream wait for it, as NCCL's work does. Each collective's start and end are recorded
  as CUDA events (``EmulatedLink.log``), so a timeline shows where communication ran beside compute.
* CPU tensors: a timer thread completes the collective after the link's time (wall clock).

Collectives on one link run one after another (one side stream, or one timer queue), like messages on one wire.
Buffer broadcasts, all-gathers and barriers cost no time (every rank already holds rank 0's values).
Register with ``register(link)``, then ``dist.init_process_group(BACKEND, rank=0, world_size=N, store=...)``.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.futures import Future

BACKEND = "deft_emulated"


@dataclass
class EmulatedLink:
    """The link's cost model and what ran on it. ``device``: where collectives run (``"cuda"``: side stream and
    device sleeps; ``"cpu"``: timer thread)."""

    alpha_ms: float = 0.0
    beta_ms_per_byte: float = 0.0
    device: str = "cuda"
    log: list[tuple[Any, Any, int]] = field(default_factory=list)  # (start, end, bytes): events, or host seconds
    _stream: Any = None
    _cycles_per_ms: float | None = None
    _free_at: float = 0.0  # host clock: when the CPU link is next free
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def cost_ms(self, nbytes: int) -> float:
        return self.alpha_ms + self.beta_ms_per_byte * nbytes

    # -- CUDA -------------------------------------------------------------------------------------------------
    def stream(self) -> Any:
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        return self._stream

    def cycles_per_ms(self) -> float:
        """``torch.cuda._sleep`` cycles per millisecond, measured with events once."""
        if self._cycles_per_ms is None:
            cycles = 2_000_000
            torch.cuda._sleep(cycles)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(cycles)
            end.record()
            end.synchronize()
            self._cycles_per_ms = cycles / max(start.elapsed_time(end), 1e-6)
        return self._cycles_per_ms

    def launch_cuda(self, tensors: list[torch.Tensor], factor: float) -> "_StreamWork":
        side = self.stream()
        side.wait_stream(torch.cuda.current_stream())
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        with torch.cuda.stream(side):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            ms = self.cost_ms(nbytes)
            if ms > 0:
                torch.cuda._sleep(max(1, int(ms * self.cycles_per_ms())))
            if factor != 1.0:
                for t in tensors:
                    t.mul_(factor)
            end.record()
        for t in tensors:
            t.record_stream(side)
        self.log.append((start, end, nbytes))
        return _StreamWork(end, tensors)

    # -- CPU --------------------------------------------------------------------------------------------------
    def launch_cpu(self, tensors: list[torch.Tensor], factor: float) -> "_TimerWork":
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        with self._lock:
            start = max(time.perf_counter(), self._free_at)
            self._free_at = end = start + self.cost_ms(nbytes) * 1e-3
        self.log.append((start, end, nbytes))
        return _TimerWork(tensors, factor, end)


class _StreamWork(dist._Work):
    def __init__(self, end: Any, tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self._end, self._tensors = end, tensors

    def wait(self, timeout: Any = None) -> bool:
        torch.cuda.current_stream().wait_event(self._end)
        return True

    def is_completed(self) -> bool:
        return self._end.query()

    def get_future(self) -> Future:
        future: Future = Future()
        future.set_result(self._tensors)
        return future


class _TimerWork(dist._Work):
    def __init__(self, tensors: list[torch.Tensor], factor: float, done_at: float) -> None:
        super().__init__()
        self._future: Future = Future()
        self._tensors, self._factor = tensors, factor
        delay = max(0.0, done_at - time.perf_counter())
        self._timer = threading.Timer(delay, self._finish)
        self._timer.daemon = True
        self._timer.start()

    def _finish(self) -> None:
        if self._factor != 1.0:
            with torch.no_grad():
                for t in self._tensors:
                    t.mul_(self._factor)
        self._future.set_result(self._tensors)

    def wait(self, timeout: Any = None) -> bool:
        self._future.wait()
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def get_future(self) -> Future:
        return self._future


class _DoneWork(dist._Work):
    def __init__(self, result: Any) -> None:
        super().__init__()
        self._future: Future = Future()
        self._future.set_result(result)

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def get_future(self) -> Future:
        return self._future


_SUMS = (dist.ReduceOp.SUM, dist.ReduceOp.AVG)


class MirrorGroup(dist.ProcessGroup):
    """Rank ``rank`` of ``size`` ranks that all hold this process's tensors, joined by ``link``."""

    def __init__(self, rank: int, size: int, link: EmulatedLink, name: str) -> None:
        super().__init__(rank, size)
        self.link, self._name = link, name

    @property
    def group_name(self) -> str:
        return self._name

    def _set_group_name(self, name: str) -> None:
        self._name = name

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> dist._Work:
        op = opts.reduceOp
        factor = float(self.size()) if op == dist.ReduceOp.SUM else 1.0  # AVG, MAX, MIN of equal values: unchanged
        if tensors and tensors[0].is_cuda:
            return self.link.launch_cuda(tensors, factor)
        return self.link.launch_cpu(tensors, factor)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> dist._Work:
        return _DoneWork(tensors)

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any) -> dist._Work:
        for out, source in zip(outputs, inputs):
            for target in out:
                target.copy_(source)
        return _DoneWork(outputs)

    def _allgather_base(self, output: torch.Tensor, source: torch.Tensor, opts: Any = None) -> dist._Work:
        output.copy_(source.repeat(self.size()))
        return _DoneWork([output])

    def barrier(self, opts: Any = None) -> dist._Work:
        return _DoneWork([])


def register(link: EmulatedLink) -> None:
    """Make ``BACKEND`` create ``MirrorGroup``s over ``link`` (every group of the process shares the one link)."""

    def create(options: Any, _pg_options: Any) -> MirrorGroup:
        return MirrorGroup(options.group_rank, options.group_size, link, options.group_id)

    devices = ["cuda"] if link.device == "cuda" else ["cpu"]
    if BACKEND in dist.Backend.backend_list:  # re-registration in one process: point the factory at this link
        dist.Backend._plugins[BACKEND.upper()] = dist.Backend._BackendPlugin(create, True)
        dist.Backend.backend_capability[BACKEND] = devices
        return
    dist.Backend.register_backend(BACKEND, create, extended_api=True, devices=devices)


def init(link: EmulatedLink, world_size: int = 2) -> None:
    """Register ``link`` and initialise the default process group as rank 0 of ``world_size`` mirrored ranks."""
    register(link)
    dist.init_process_group(BACKEND, rank=0, world_size=world_size, store=dist.HashStore())
