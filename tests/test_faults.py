"""The fault matrix, with real processes (2 gloo workers): a rank dies (``os._exit``, SIGKILL) or hangs (SIGSTOP)
inside ``deft_compile()``, before its first step completes, between steps while communication is pending across
calls (ByteScheduler's and US-Byte's moved updates, DeFT's delayed buckets, an update period in progress), during
``flush()``, during ``deft_compile.checkpoint.save`` and ``load``, and inside the closed loop's and the Preserver's
all-reduces; rank 0, which hosts the rendezvous store, dies or stops. Every group the step opens times out as the
process group does.

In each case the survivor raises ``PeerFailureError`` naming the lost rank within the process group's timeout plus
``peer_check_timeout_s`` (nothing hangs), and a fresh pair resumes from the last complete checkpoint to the same
numbers as a run without the fault, bit for bit, on the aten route and on the default route (``compiler="inductor"``:
the resumed pair compiles the same regions and runs the same kernels as the run without the fault, as
tests/test_default_route.py's DCP resume checks). A checkpoint the fault tore (a save interrupted, a file
truncated) is refused on load with ``TornCheckpointError`` on every rank.
"""

from __future__ import annotations

import functools
import os
import shutil
import time

import pytest
import torch

from deft_compile.tools.launcher import run_local_workers
from fault_workers import STEPS, fault_run, group_timeouts, load_fault_run, resume_run, straight_run

COLLECTIVE_TIMEOUT_S = 3.0  # the process group's timeout in these tests (aten route)
# Through Inductor a rank may compile regions for longer than 3 s while the other waits in a collective: the
# default-route cases, whose faults are deaths (seen at once, when the connection closes), wait longer.
INDUCTOR_COLLECTIVE_TIMEOUT_S = 120.0
PEER_CHECK_S = 2.0  # DeftConfig.peer_check_timeout_s in fault_workers
SLACK_S = 2.0  # the survivor's own work between the failure and its error (a loaded 2-core host)


def _timeout(compiler: str) -> float:
    return COLLECTIVE_TIMEOUT_S if compiler == "aten" else INDUCTOR_COLLECTIVE_TIMEOUT_S


def _bound(how: str, compiler: str) -> float:
    """How long after the fault the survivor's error may come: a dead peer's connection closes at once, then the
    peer check waits for the victim's key; a stopped peer is seen when the collective times out (and a stopped store
    host when the peer check gives up on it, a second later)."""
    return (_timeout(compiler) + 1.0 if how == "stop" else 0.0) + PEER_CHECK_S + SLACK_S


def _launch(fn, args: tuple, compiler: str = "aten", timeout_s: float = 120) -> list:
    return run_local_workers(fn, 2, args, timeout_s=timeout_s, collective_timeout_s=_timeout(compiler),
                             raise_on_failure=False)


@functools.lru_cache(maxsize=None)
def _straight(policy: str, compiler: str, folder: str) -> tuple:
    results = run_local_workers(straight_run, 2, (policy, folder, compiler), timeout_s=300,
                                collective_timeout_s=_timeout(compiler))
    return tuple(r.value for r in results)


def _faulty(tmp_path, policy: str, fault: str, how: str, victim: int, at: int, compiler: str = "aten") -> dict:
    """Run the fault; check every survivor named the victim in time and the victim died (or was killed, stopped)."""
    started = time.monotonic()
    results = _launch(fault_run, (policy, fault, how, victim, at, str(tmp_path), compiler), compiler, timeout_s=300)
    elapsed = time.monotonic() - started
    survivor = results[1 - victim]
    assert survivor.ok, survivor.error
    message = survivor.value["error"]
    assert message is not None and message.startswith("PeerFailureError"), message
    assert f"rank {victim}" in message, message
    print(f"{policy}/{fault}/{how}/{compiler}: rank {1 - victim} named rank {victim} "
          f"{survivor.value['seconds']:.2f} s after the fault")
    assert survivor.value["seconds"] <= _bound(how, compiler), (survivor.value["seconds"], message)
    assert not results[victim].ok, "the victim must not report a result"
    assert results[victim].exitcode in (17, -9), results[victim].exitcode  # os._exit(17), SIGKILL (a stopped one too)
    # nothing hangs: the launch ends once the survivor named the victim (Inductor's first compiles take longer)
    assert elapsed < (60 if compiler == "aten" else 240), f"the launch took {elapsed:.0f} s"
    return survivor.value


def _resume_and_compare(tmp_path, policy: str, compiler: str, torn: list[str] = ()) -> list:
    """A fresh pair refuses each torn checkpoint and resumes from the complete one; the same numbers as a run without
    the fault, bit for bit on either compiler."""
    resumed = _launch(resume_run, (policy, str(tmp_path), list(torn), compiler), compiler, timeout_s=300)
    expected = _straight(policy, compiler, str(tmp_path.parent / f"straight-{policy}-{compiler}"))
    for rank, result in enumerate(resumed):
        assert result.ok, result.error
        actual = result.value
        assert actual["step_count"] == expected[rank]["step_count"] == STEPS
        if compiler == "inductor":
            assert actual["compiler"] == expected[rank]["compiler"] == "inductor"
        for name, want in [*expected[rank]["state"].items(), *(("pending:" + k, v) for k, v in
                                                                expected[rank]["pending"].items())]:
            got = actual["state"][name] if not name.startswith("pending:") else actual["pending"][name[8:]]
            assert torch.equal(got, want), f"rank {rank}: {name} differs after resuming"
        assert actual["state"].keys() == expected[rank]["state"].keys()
        assert actual["pending"].keys() == expected[rank]["pending"].keys()
    return [r.value["refused"] for r in resumed]


@pytest.mark.timeout(120)
def test_rank_dies_inside_deft_compile(tmp_path):
    """In the broadcast of rank 0's parameters that ``deft_compile()`` runs."""
    _faulty(tmp_path, "deft", "construction", "exit", victim=1, at=0)


@pytest.mark.timeout(120)
def test_rank_dies_during_checkpoint_load(tmp_path):
    started = time.monotonic()
    results = _launch(load_fault_run, ("kill", 1, str(tmp_path)))
    message = results[0].value["error"]
    assert message.startswith("PeerFailureError") and "rank 1 did not respond" in message, message
    assert results[0].value["seconds"] <= _bound("kill", "aten") and results[1].exitcode == -9
    assert time.monotonic() - started < 60


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["exit", "kill"])
def test_rank_dies_before_its_first_step_completes(tmp_path, how):
    """Inside the first call, while tracing (no profile given: the survivor profiles with collectives)."""
    report = _faulty(tmp_path, "deft", "first_step", how, victim=1, at=0)
    assert report["pending_at_fault"] is None
    assert not os.path.exists(tmp_path / "complete"), "no checkpoint is written before the first step"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("policy,how,at", [
    ("bytescheduler", "kill", 4),  # updates moved into the next call: its all-reduces in flight across the call
    ("usbyte", "exit", 4),
    ("deft", "exit", 4),  # delayed buckets: the local gradient carried into the next call
    ("deft-period", "kill", 4),  # update periods: an accumulation in progress
])
def test_rank_dies_while_communication_is_pending_across_calls(tmp_path, policy, how, at):
    report = _faulty(tmp_path, policy, "between_steps", how, victim=1, at=at)
    if policy == "deft-period":
        assert any(count for count in report["accumulated_at_fault"].values()), report
    else:
        assert report["pending_at_fault"], report
    _resume_and_compare(tmp_path, policy, "aten")


@pytest.mark.timeout(180)
def test_rank_dies_during_flush(tmp_path):
    report = _faulty(tmp_path, "deft", "flush", "exit", victim=1, at=4)
    assert report["pending_at_fault"], "the flush must have delayed gradients to apply"
    _resume_and_compare(tmp_path, "deft", "aten")


@pytest.mark.timeout(180)
def test_rank_dies_during_checkpoint_save_and_the_torn_checkpoint_is_refused(tmp_path):
    """Rank 1 dies once its files are written, before DCP's metadata: that checkpoint is torn; so is a copy of the
    complete one with a truncated file. Both are refused on every rank; the complete one resumes."""
    _faulty(tmp_path, "deft", "save", "exit", victim=1, at=4)
    truncated = tmp_path / "truncated"
    shutil.copytree(tmp_path / "complete", truncated)
    data = sorted(truncated.glob("*.distcp"))[-1]
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    refused = _resume_and_compare(tmp_path, "deft", "aten", torn=[str(tmp_path / "torn"), str(truncated)])
    for rank_refused in refused:
        torn, cut = rank_refused[str(tmp_path / "torn")], rank_refused[str(truncated)]
        assert torn is not None and torn.startswith("TornCheckpointError") and "not a complete checkpoint" in torn
        assert cut is not None and cut.startswith("TornCheckpointError") and f"{data.name} has" in cut


@pytest.mark.timeout(120)
def test_rank_zero_dies_during_checkpoint_save(tmp_path):
    """Rank 0 hosts the rendezvous store (tcp:// init) and coordinates DCP: the survivor names it all the same."""
    report = _faulty(tmp_path, "deft", "save", "kill", victim=0, at=4)
    assert "rank 0" in report["error"]
    assert not (tmp_path / "torn" / "deft_complete.json").exists()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("victim", [1, 0])
def test_stopped_rank_is_reported_not_waited_on(tmp_path, victim):
    """SIGSTOP after a step with delayed gradients pending: the survivor's next collective times out. Rank 0 also
    hosts the rendezvous store, whose client then waits forever: the survivor stops asking and names rank 0."""
    report = _faulty(tmp_path, "deft", "between_steps", "stop", victim=victim, at=4)
    expected = "did not respond" if victim == 1 else "the rendezvous store did not answer"
    assert expected in report["error"] and report["pending_at_fault"], report["error"]
    _resume_and_compare(tmp_path, "deft", "aten")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fault", ["closed_loop", "preserver"])
def test_rank_stopped_inside_a_controller_all_reduce_is_reported(tmp_path, fault):
    """The closed loop's and the Preserver's all-reduces (on the step's side group) time out as the process group
    does, and the survivor names the stopped rank."""
    report = _faulty(tmp_path, "deft", fault, "stop", victim=1, at=0)
    assert "did not respond" in report["error"]
    where = {"closed_loop": "_agree", "preserver": "_all_rank_mean"}[fault]
    assert where in report["frames"], report["frames"]  # the survivor was waiting in the same all-reduce


@pytest.mark.timeout(120)
def test_every_group_the_step_opens_times_out_as_the_process_group_does():
    """The side group, a second link and DS-Sync's groups get the process group's timeout (3 s here), not torch's
    30-minute default for a new gloo group: a stopped peer is reported, not waited on."""
    for result in run_local_workers(group_timeouts, 2, timeout_s=120, collective_timeout_s=COLLECTIVE_TIMEOUT_S):
        timeouts = result.value
        assert timeouts["default"] == timeouts["side"] == COLLECTIVE_TIMEOUT_S, timeouts
        assert timeouts["links"] == [COLLECTIVE_TIMEOUT_S] * 2, timeouts
        assert timeouts["dssync"] and set(timeouts["dssync"]) == {COLLECTIVE_TIMEOUT_S}, timeouts


@pytest.mark.timeout(420)
@pytest.mark.parametrize("fault,how", [("between_steps", "kill"), ("save", "exit")])
def test_fault_and_resume_on_the_default_route(tmp_path, fault, how):
    """compiler="inductor" (the default route): named in time, the torn checkpoint refused, the complete one
    resumed to the run without the fault's numbers, bit for bit."""
    report = _faulty(tmp_path, "deft", fault, how, victim=1, at=4, compiler="inductor")
    assert report["pending_at_fault"]
    torn = [str(tmp_path / "torn")] if fault == "save" else []
    refused = _resume_and_compare(tmp_path, "deft", "inductor", torn=torn)
    assert all(r[t].startswith("TornCheckpointError") for r in refused for t in torn)
