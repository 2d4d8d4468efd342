"""The local launcher starts workers both ways: spawned (the benchmarks' and the demo's way) and forked from
a preloaded server (the test suite's way, ``use_forkserver``); both give each worker the launching
process's current environment, one intra-op thread and a working process group. The worker lives in a module that
imports torch only (tests/launch_workers.py), so a spawned launch pays for the interpreter and torch, as the
benchmarks' do."""

from __future__ import annotations

import os

import pytest

from deft_compile.tools import launcher
from launch_workers import launch_facts

VARIABLE = "DEFT_TEST_LAUNCH_VALUE"


@pytest.mark.parametrize("method", launcher.START_METHODS)
def test_workers_see_the_current_environment_and_a_working_group(monkeypatch, method):
    """Workers see the environment of the launch. A fork server outlives a launch, so there a second value is set
    after the server runs and the next launch's workers must see it; spawned workers start from the launcher's
    environment each time, and one launch shows it."""
    values = ("first", "second") if method == "forkserver" else ("first",)
    seen = []
    for value in values:
        monkeypatch.setenv(VARIABLE, value)
        results = launcher.run_local_workers(launch_facts, 2, (VARIABLE,), timeout_s=120, start_method=method)
        seen.append([r.value for r in results])
    for value, per_rank in zip(values, seen):
        assert [facts["value"] for facts in per_rank] == [value, value]
        assert [facts["sum"] for facts in per_rank] == [3.0, 3.0]
        assert [facts["threads"] for facts in per_rank] == [1, 1]
    pids = {facts["pid"] for per_rank in seen for facts in per_rank}
    assert len(pids) == 2 * len(values) and os.getpid() not in pids, "each launch starts its own worker processes"


@pytest.fixture
def own_fork_server(monkeypatch):
    """A fork server of the test's own, started by the next launch through the launcher's usual path
    (``launcher._start_forkserver``) and stopped at the end; the server the other tests fork from keeps running,
    untouched. It preloads torch and the launcher's modules (``launch_workers``), not the suite's helpers."""
    from multiprocessing import forkserver

    server = forkserver.ForkServer()
    monkeypatch.setattr(forkserver, "_forkserver", server)
    for name in ("ensure_running", "get_inherited_fds", "connect_to_new_process", "set_forkserver_preload"):
        monkeypatch.setattr(forkserver, name, getattr(server, name))
    monkeypatch.setattr(launcher, "_preload", ("torch", "torch.distributed", "deft_compile",
                                               "deft_compile.tools.launcher", "launch_workers"))
    yield server
    server._stop()


def test_a_variable_removed_since_the_server_started_is_gone_in_the_worker(monkeypatch, own_fork_server):
    monkeypatch.setenv(VARIABLE, "present")
    first = launcher.run_local_workers(launch_facts, 2, (VARIABLE,), timeout_s=120, start_method="forkserver")
    assert own_fork_server._forkserver_pid is not None, "the launch started the test's own server"
    assert [r.value["value"] for r in first] == ["present", "present"]
    monkeypatch.delenv(VARIABLE)
    results = launcher.run_local_workers(launch_facts, 2, (VARIABLE,), timeout_s=120, start_method="forkserver")
    assert [r.value["value"] for r in results] == [None, None]


def test_unknown_start_method_is_refused():
    with pytest.raises(ValueError, match="start method"):
        launcher.run_local_workers(launch_facts, 2, (VARIABLE,), start_method="fork")
