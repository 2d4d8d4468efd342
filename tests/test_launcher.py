"""The local launcher starts workers both ways: spawned (the benchmarks' and the demo's way) and forked from
a preloaded server (the test suite's way, ``use_forkserver``); both give each worker the launching
process's current environment, one intra-op thread and a working process group."""

from __future__ import annotations

import os

import pytest

from deft_compile.tools import launcher
from workers import launch_facts

VARIABLE = "DEFT_TEST_LAUNCH_VALUE"


@pytest.mark.parametrize("method", launcher.START_METHODS)
def test_workers_see_the_current_environment_and_a_working_group(monkeypatch, method):
    seen = []
    for value in ("first", "second"):  # set after a fork server may already run: workers still see it
        monkeypatch.setenv(VARIABLE, value)
        results = launcher.run_local_workers(launch_facts, 2, (VARIABLE,), timeout_s=120, start_method=method)
        seen.append([r.value for r in results])
    for value, per_rank in zip(("first", "second"), seen):
        assert [facts["value"] for facts in per_rank] == [value, value]
        assert [facts["sum"] for facts in per_rank] == [3.0, 3.0]
        assert [facts["threads"] for facts in per_rank] == [1, 1]
    pids = {facts["pid"] for per_rank in seen for facts in per_rank}
    assert len(pids) == 4 and os.getpid() not in pids, "each launch starts its own worker processes"


def test_a_variable_removed_since_the_server_started_is_gone_in_the_worker(monkeypatch):
    from multiprocessing import forkserver

    monkeypatch.setenv(VARIABLE, "present")
    forkserver._forkserver._stop()  # the next launch starts a server with the variable in its environment
    launcher.run_local_workers(launch_facts, 2, (VARIABLE,), timeout_s=120, start_method="forkserver")
    monkeypatch.delenv(VARIABLE)
    results = launcher.run_local_workers(launch_facts, 2, (VARIABLE,), timeout_s=120, start_method="forkserver")
    assert [r.value["value"] for r in results] == [None, None]


def test_unknown_start_method_is_refused():
    with pytest.raises(ValueError, match="start method"):
        launcher.run_local_workers(launch_facts, 2, (VARIABLE,), start_method="fork")
