"""Accelerator emulation (``deft_compile.tools.emulation``): communication threads on their own core."""

from __future__ import annotations

import os

import pytest

from deft_compile.tools import emulation
from deft_compile.tools.launcher import run_local_workers
from workers import group_thread_cores


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or (os.cpu_count() or 1) < 2,
                    reason="accelerator emulation pins threads to two cores: needs Linux and 2 or more cores")
def test_groups_opened_after_init_keep_their_threads_off_the_compute_core():
    """A group opened after ``init_process_group`` starts its gloo threads from the compute thread: with plain
    ``dist.new_group`` they inherit the compute core (what this test shows first, so it can fail), with the
    library's ``new_group`` they run on the communication core and the compute thread keeps its core."""
    env = {emulation.ENV: "1"}
    for report in (r.value for r in run_local_workers(group_thread_cores, 2, env=env, timeout_s=120)):
        assert report["compute"] == [emulation.COMPUTE_CORE], report
        assert report["plain"] and all(cores == [emulation.COMPUTE_CORE] for cores in report["plain"]), report
        assert report["helper"] and all(cores == [emulation.COMM_CORE] for cores in report["helper"]), report
