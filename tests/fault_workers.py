"""Worker functions of the fault matrix (tests/test_faults.py): a rank dies (``os._exit`` or SIGKILL) or stops
(SIGSTOP) at a chosen point of training, the survivor reports what it raised and how long that took; fresh pairs
then load the checkpoints the run left.

Every run trains ``mlp_dropout_sgd`` (SGD with Nesterov momentum, Dropout) on per-rank batches, saves a complete
checkpoint (``deft_compile.checkpoint``) after step ``SAVE_AT``, and the fault strikes after that. Policies are
named as in ``workers.POLICY_OPTIONS``: ``bytescheduler``/``usbyte`` (updates moved into the next call, their
all-reduces in flight across calls), ``deft`` (delayed buckets: a local gradient carried, its all-reduce launched in
the next call), ``deft-period`` (update periods: accumulations in progress).
"""

from __future__ import annotations

import functools
import os
import signal
import time
import traceback

import torch
import torch.distributed.checkpoint as dcp

from deft_compile import DeftConfig, checkpoint, deft_compile
from deft_compile.planner.closed_loop import ClosedLoopConfig
from deft_compile.preserver import PreserverConfig
from deft_compile.preserver.monitor import PreserverMonitor
from deft_compile.step import groups
from deft_compile.step.closed_loop import ClosedLoop
from models import CASES
from workers import POLICY_OPTIONS, _named_state, case_setup

CASE = "mlp_dropout_sgd"
SAVE_AT = 2  # the last complete checkpoint: after this many steps
STEPS = 8  # the straight run's length; resumed runs train from SAVE_AT up to it


def _die(how: str, folder: str) -> None:
    """End this process now, as a crash would: no exception, no cleanup, no process-group teardown. The time of
    death goes into ``folder/fault_time`` first (the survivor measures how long it took to name this rank)."""
    with open(os.path.join(folder, "fault_time"), "w") as record:
        record.write(repr(time.time()))
    if how == "exit":
        os._exit(17)
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)  # hangs here until the survivor kills it
        return
    raise ValueError(how)


def _build(rank: int, world_size: int, policy: str, compiler: str | None, *, measured: bool = False,
           **config):
    """(model, optimizer, step, batches) of the matrix's run; ``measured``: no profile given (the first call
    profiles with collectives, the closed loop runs); ``config``: more ``DeftConfig`` fields."""
    model, optimizer, loss_fn, batches, profile = case_setup(CASE, rank, world_size, STEPS, profiled=not measured)
    solver_policy = "deft" if policy.startswith("deft") else policy
    if policy == "deft-period":  # the Preserver's prior prices of skipped updates would rule the periods out
        config.setdefault("preserver", PreserverConfig(enabled=False))
    config = DeftConfig(plan_options=POLICY_OPTIONS.get(policy, {}), peer_check_timeout_s=2.0,
                        **({"compiler": compiler} if compiler else {}), **config)
    step = deft_compile(model, optimizer, loss_fn, policy=solver_policy, profile=profile, config=config)
    return model, optimizer, step, batches


def _train(step, batches, rank: int, start: int, stop: int) -> None:
    for t in range(start, stop):
        torch.manual_seed(100 * rank + t)  # Dropout draws the same numbers in every run of step t
        step(*batches[t])


def _victim_pid(folder: str) -> int:
    with open(os.path.join(folder, "victim_pid")) as record:
        return int(record.read())


def fault_run(rank: int, world_size: int, policy: str, fault: str, how: str, victim: int, at: int, folder: str,
              compiler: str | None = None) -> dict:
    """Train, save a complete checkpoint after step ``SAVE_AT`` into ``folder/complete``, then let rank ``victim``
    fail (``how``: ``exit``, ``kill`` or ``stop``) where ``fault`` says:

    - ``construction``: inside ``deft_compile()``, in the broadcast of rank 0's parameters;
    - ``first_step``: inside its first call, while tracing the step (no profile given: the survivor profiles);
    - ``between_steps``: right after step ``at`` returns (what the plan carries is in flight or pending);
    - ``flush``: inside ``flush()`` after step ``at``, before its flush graph's collectives;
    - ``save``: inside ``checkpoint.save`` after step ``at`` (into ``folder/torn``), once its own files are written;
    - ``closed_loop`` / ``preserver``: inside the closed loop's or the Preserver's all-reduce of its measurements.

    The survivor returns what it raised and after how many seconds; a stopped victim is killed by the survivor."""
    if rank == victim:
        with open(os.path.join(folder, "victim_pid"), "w") as record:
            record.write(str(os.getpid()))
    measured = fault in ("first_step", "closed_loop")
    config = {"closed_loop": ClosedLoopConfig(warmup_steps=1, measure_steps=2, min_window_ms=0.0)} if measured else {}
    if fault == "preserver":  # a loss window every 2 steps: its all-reduce early
        config["preserver"] = PreserverConfig(check_every=2)
    failing = rank == victim
    die = functools.partial(_die, how, folder)
    report: dict = {"rank": rank, "pending_at_fault": None, "accumulated_at_fault": None}
    if failing and fault == "construction":
        groups.broadcast_from_rank0 = lambda *args: die()
    try:
        model, optimizer, step, batches = _build(rank, world_size, policy, compiler, measured=measured, **config)
    except Exception as exc:  # noqa: BLE001 - the test reads the type and message
        return _failure(report, exc, how, folder)
    if failing and fault == "first_step":
        model.register_forward_pre_hook(lambda *_: die())
    if failing and fault == "closed_loop":  # this process's class: the victim's closed loop
        agree = ClosedLoop._agree
        ClosedLoop._agree = lambda self, *a: (die(), agree(self, *a))[1]
    if failing and fault == "preserver":
        mean = PreserverMonitor._all_rank_mean
        PreserverMonitor._all_rank_mean = lambda self, values: (die(), mean(self, values))[1]
    if failing and fault == "flush":
        run = step.lowering.run
        step.lowering.run = lambda gm, inputs, flush=False, **kw: (die() if flush else None,
                                                                    run(gm, inputs, flush=flush, **kw))[1]
    try:
        if fault in ("first_step", "closed_loop", "preserver"):
            _train(step, batches, rank, 0, STEPS)
            return {**report, "error": None}
        _train(step, batches, rank, 0, SAVE_AT)
        checkpoint.save(step, os.path.join(folder, "complete"))
        _train(step, batches, rank, SAVE_AT, at)
        report.update(pending_at_fault=list(step.pending), accumulated_at_fault=dict(step.runner.accumulated))
        if failing and fault == "between_steps":
            die()
        if failing and fault == "save":  # the next save: this rank's files written, DCP's metadata not
            write = checkpoint._MarkingWriter.write_data

            def write_then_die(self, plan, planner):
                written = write(self, plan, planner)
                written.wait()
                die()
                return written

            checkpoint._MarkingWriter.write_data = write_then_die
        if fault == "flush":
            step.flush()
        elif fault == "save":
            checkpoint.save(step, os.path.join(folder, "torn"))
        _train(step, batches, rank, at, STEPS)
        return {**report, "error": None}
    except Exception as exc:  # noqa: BLE001 - the test reads the type and message
        return _failure(report, exc, how, folder)


def _failure(report: dict, exc: BaseException, how: str, folder: str) -> dict:
    """The survivor's report: what it raised, how long after the fault, and where its own collective failed; a
    stopped victim is killed here, as it would otherwise outlive the launch."""
    raised = time.time()
    if how == "stop":
        os.kill(_victim_pid(folder), signal.SIGKILL)
    with open(os.path.join(folder, "fault_time")) as record:
        seconds = raised - float(record.read())
    cause = exc.__cause__ if exc.__cause__ is not None else exc
    frames = [frame.name for frame in traceback.extract_tb(cause.__traceback__)]
    return {**report, "error": f"{type(exc).__name__}: {exc}", "seconds": seconds, "frames": frames}


def load_fault_run(rank: int, world_size: int, how: str, victim: int, folder: str) -> dict:
    """Save a complete checkpoint after ``SAVE_AT`` steps, then in a new step let rank ``victim`` die inside
    ``checkpoint.load`` (as it reads its data): what the survivor raised."""
    if rank == victim:
        with open(os.path.join(folder, "victim_pid"), "w") as record:
            record.write(str(os.getpid()))
    model, optimizer, step, batches = _build(rank, world_size, "deft", None)
    _train(step, batches, rank, 0, SAVE_AT)
    checkpoint.save(step, os.path.join(folder, "complete"))
    model, optimizer, step, batches = _build(rank, world_size, "deft", None)
    if rank == victim:
        dcp.FileSystemReader.read_data = lambda *args, **kwargs: _die(how, folder)
    try:
        checkpoint.load(step, os.path.join(folder, "complete"))
        return {"rank": rank, "error": None}
    except Exception as exc:  # noqa: BLE001 - the test reads the type and message
        return _failure({"rank": rank}, exc, how, folder)


def straight_run(rank: int, world_size: int, policy: str, folder: str, compiler: str | None = None) -> dict:
    """The run no fault stopped: ``STEPS`` steps, with the save after ``SAVE_AT`` (into ``folder``) as in
    ``fault_run``: a save waits for the pending all-reduces, which must not change the numbers."""
    model, optimizer, step, batches = _build(rank, world_size, policy, compiler)
    _train(step, batches, rank, 0, SAVE_AT)
    checkpoint.save(step, folder)
    _train(step, batches, rank, SAVE_AT, STEPS)
    return _final(step, model, optimizer)


def resume_run(rank: int, world_size: int, policy: str, folder: str, torn: list[str],
               compiler: str | None = None) -> dict:
    """A fresh pair: loading each of ``torn`` must raise; then load ``folder/complete`` and train to ``STEPS``."""
    model, optimizer, step, batches = _build(rank, world_size, policy, compiler)
    refused = {}
    for path in torn:
        try:
            checkpoint.load(step, path)
            refused[path] = None
        except Exception as exc:  # noqa: BLE001 - the test reads the type and message
            refused[path] = f"{type(exc).__name__}: {exc}"
    checkpoint.load(step, os.path.join(folder, "complete"))
    _train(step, batches, rank, SAVE_AT, STEPS)
    return {**_final(step, model, optimizer), "refused": refused}


def _final(step, model, optimizer) -> dict:
    state = step.state_dict()
    return {"state": {k: v.clone() for k, v in _named_state(model, optimizer).items()},
            "pending": {k: v.clone() for k, v in state["pending"].items()}, "step_count": step.step_count,
            "compiler": step.compiler}


def group_timeouts(rank: int, world_size: int) -> dict:
    """The collective timeout of every process group the steps open (in seconds): a deft step's side group (its
    buffer broadcast and the Preserver's and the closed loop's all-reduces) and a second link, DS-Sync's groups."""
    from deft_compile.step.distributed import group_timeout

    model, optimizer, step, batches = _build(rank, world_size, "deft", None, measured=True, links=("gloo",))
    timeouts = {"default": group_timeout(step.process_group).total_seconds(),
                "side": group_timeout(step.groups.side_group).total_seconds(),
                "links": [group_timeout(group).total_seconds() for _, group in step.groups.links]}
    make_model, make_optimizer, _make_batch, loss_fn, _ddp_kwargs, _exact = CASES[CASE]
    torch.manual_seed(0)
    other = make_model()
    dssync = deft_compile(other, make_optimizer(other), loss_fn, policy="dssync",
                          config=DeftConfig(plan_options={"group_size": 1, "seed": 7}))
    dssync(*batches[0])
    timeouts["dssync"] = sorted(group_timeout(group).total_seconds() for group in dssync.policy_runtime.subgroups.values()
                                if isinstance(group, torch.distributed.ProcessGroup))  # the groups this rank is in
    return timeouts
