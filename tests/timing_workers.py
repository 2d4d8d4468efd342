"""Workers for tests/test_timing.py: a closed loop timed by a CUDA clock whose events are host stand-ins."""

from __future__ import annotations

import time

import torch

from deft_compile import DeftConfig, deft_compile
from deft_compile.preserver import PreserverConfig
from deft_compile.planner.closed_loop import ClosedLoopConfig
from deft_compile.timing import CudaClock


class HostEvent:
    """A stand-in for ``torch.cuda.Event``: records the host clock; counts the reads of its time."""

    reads: list[int] = []  # the step number at each ``synchronize`` (read) of any event
    step = 0

    def __init__(self) -> None:
        self.at = None

    def record(self) -> None:
        self.at = time.perf_counter()

    def synchronize(self) -> None:
        HostEvent.reads.append(HostEvent.step)

    def elapsed_time(self, end: "HostEvent") -> float:
        return (end.at - self.at) * 1e3


def closed_loop_on_device_clock(rank: int, world_size: int, steps: int) -> dict:
    """A deft step with the closed loop on, its clock a ``CudaClock`` over ``HostEvent``s; which steps read the
    clock, and how many steps the loop measured."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    config = DeftConfig(preserver=PreserverConfig(enabled=False),
                        closed_loop=ClosedLoopConfig(warmup_steps=1, measure_steps=3, min_window_ms=0.0,
                                                     measure_contention=False))
    step = deft_compile(model, optimizer, torch.nn.functional.cross_entropy, policy="deft", config=config)
    step.clock = CudaClock("cuda", event_factory=HostEvent, synchronize=lambda: None)
    HostEvent.reads = []
    g = torch.Generator().manual_seed(rank)
    for t in range(steps):
        HostEvent.step = t
        step(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g))
    measured = sum(step.closed_loop.windows.values())
    return {"reads": list(HostEvent.reads), "windows": dict(step.closed_loop.windows), "measured_steps": measured,
            "state": step.closed_loop.state}
