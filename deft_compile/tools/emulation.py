"""Accelerator emulation on a CPU host (``benchmarks/suite.py --emulate-accelerator``): where the local
launcher's workers put their threads.

On a GPU the step's kernels run on the device and gloo/NCCL communication on
other hardware, so compute and communication do not compete for one CPU. Here
the worker's communication threads are confined to core 1 and its compute
thread to core 0: the affinity is set to core 1 *before* ``init_process_group``
(gloo's threads, created there, inherit it), then the calling thread alone is
moved to core 0 (``sched_setaffinity(0, ...)`` applies to the calling thread).
Process groups opened later (the buffer broadcast's, a second link's, DS-Sync's
groups) start their gloo threads from the compute thread, so they would inherit
core 0 and compete with compute: ``before_init`` registers ``communication_threads``
as the library's group context (``deft_compile.step.distributed.set_group_context``),
which moves the calling thread to core 1 while such a group is created.
Enabled by the environment variable ``DEFT_EMULATE_ACCELERATOR=1``; Linux only.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

ENV = "DEFT_EMULATE_ACCELERATOR"
COMPUTE_CORE, COMM_CORE = 0, 1


def enabled() -> bool:
    return os.environ.get(ENV, "") not in ("", "0") and hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) >= 2


def before_init() -> None:
    """Threads created from now on (gloo's) run on the communication core, and so do those of every group the
    library opens later."""
    if enabled():
        from deft_compile.step.distributed import set_group_context

        os.sched_setaffinity(0, {COMM_CORE})
        set_group_context(communication_threads)


def after_init() -> None:
    """The calling (compute) thread runs on the compute core."""
    if enabled():
        os.sched_setaffinity(0, {COMPUTE_CORE})


@contextlib.contextmanager
def communication_threads() -> Iterator[None]:
    """Threads created inside (a process group's gloo threads) run on the communication core; the calling
    thread gets its affinity back after. A no-op unless emulation is enabled."""
    if not enabled():
        yield
        return
    previous = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {COMM_CORE})
    try:
        yield
    finally:
        os.sched_setaffinity(0, previous)


def new_group(**kwargs: Any) -> Any:
    """``torch.distributed.new_group(**kwargs)`` (a collective call), with the new group's gloo threads on the
    communication core when emulation is enabled: created from the compute thread they would inherit its core
    and compete with compute, which no accelerator's communication does. The benchmarks open their own groups
    through here; the library's go through the context ``before_init`` registers."""
    import torch.distributed as dist

    with communication_threads():
        return dist.new_group(**kwargs)
