"""Workers for tests/test_checkpoint_safety.py: checkpoints whose step state (or DCP metadata) would run code, is
truncated, foreign or of the previous format, loaded on 2 gloo processes through both resume paths
(``deft_compile.checkpoint.load`` and ``DeftTrainer.train(resume_from_checkpoint=...)``).

``RunsCode`` and ``RunsSystem`` are what an attacker would put into a checkpoint: unpickling either creates the
marker file (``pathlib.Path.touch``; ``os.system("touch ...")``). A loader that runs no code leaves it absent.
"""

from __future__ import annotations

import io
import os
import pathlib
import pickle
from pathlib import Path

import numpy
import torch

from deft_compile import DeftConfig, deft_compile
from integration_workers import dcp_checkpoint_run
from workers import POLICY_OPTIONS, _named_state, case_setup

CASE = "mlp_dropout_sgd"


class RunsCode:
    """Unpickling it calls ``pathlib.Path.touch(marker)``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return pathlib.Path.touch, (pathlib.Path(self.marker),)


class RunsSystem:
    """Unpickling it calls ``os.system("touch marker")``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def saved_bytes(value) -> bytes:
    """What ``torch.save(value)`` writes."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def refused(fn) -> str | None:
    """``"<error type>: <message>"`` of what ``fn()`` raises, None if it returns."""
    try:
        fn()
    except Exception as error:  # noqa: BLE001 - reported: the test checks type and message
        return f"{type(error).__name__}: {error}"
    return None


# -- deft_compile.checkpoint (DCP) -------------------------------------------------------------------------------
def save_with_step_entry(step, folder: str, entry) -> None:
    """``checkpoint.save`` of the step, with ``entry`` as this rank's step entry in place of its state: bytes (the
    entry's content) or any object (DCP pickles it into the entry)."""
    from torch.distributed.checkpoint import save as dcp_save
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from deft_compile import checkpoint

    model_state, optimizer_state = get_state_dict(step.model, step.optimizer)
    blob = io.BytesIO(entry) if isinstance(entry, bytes) else entry
    state = checkpoint._layout(step, model_state, optimizer_state, blob)
    dcp_save({checkpoint.KEY: state}, storage_writer=checkpoint._MarkingWriter(folder),
             process_group=step.process_group)


def dcp_refusals(rank: int, world_size: int, root: str, marker: str) -> dict:
    """A deft step with pending gradients saves checkpoints whose step entry would run code (inside the step
    state's file, or as DCP's own pickle of the entry), whose metadata would, whose entry is truncated, foreign, of
    the previous format with a numpy scalar, or bad on rank 0 only; each is loaded into the step. Reports each
    load's error, whether the model and optimizer stayed as they were, and whether the marker exists."""
    import torch.distributed as dist

    from deft_compile import checkpoint, step_state

    model, optimizer, loss_fn, batches, profile = case_setup(CASE, rank, world_size, 1)
    step = deft_compile(model, optimizer, loss_fn, policy="deft", profile=profile,
                        config=DeftConfig(plan_options=POLICY_OPTIONS["deft"]))
    torch.manual_seed(100 * rank)
    step(*batches[0])
    good = io.BytesIO()
    step_state.write(step.state_dict(), good)
    good = good.getvalue()
    previous = step.state_dict()
    previous["step_count"] = numpy.int64(previous["step_count"])
    entries = {
        "touch_in_step_state": saved_bytes(RunsCode(marker)),
        "system_inside_plain_wrapper": saved_bytes({"format": step_state.FORMAT, "version": 1,
                                                    "state": {"step_count": RunsSystem(marker)}}),
        "touch_as_dcp_entry": RunsCode(marker),
        "raw_pickle": pickle.dumps(RunsSystem(marker)),
        "truncated": good[: len(good) // 2],
        "empty": b"",
        "foreign_text": b"not a checkpoint\n",
        "foreign_torch_file": saved_bytes(torch.zeros(3)),
        "previous_format_numpy": saved_bytes(previous),
        "rank0_only": saved_bytes(RunsCode(marker)) if rank == 0 else good,
        "metadata": good,
    }
    for name, entry in entries.items():
        folder = str(Path(root) / name)
        save_with_step_entry(step, folder, entry)
        if name == "metadata":
            dist.barrier()
            if rank == 0:  # whoever writes into the folder can rewrite its completeness mark too
                (Path(folder) / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
                checkpoint._mark_complete(Path(folder))
            dist.barrier()
    with torch.no_grad():  # values a refused load must leave alone, none of them the checkpoints'
        for p in model.parameters():
            p.add_(1.0)
    before = {k: v.clone() for k, v in _named_state(model, optimizer).items()}
    report: dict = {}
    for name in entries:
        report[name] = refused(lambda: checkpoint.load(step, str(Path(root) / name)))
        after = _named_state(model, optimizer)
        report[f"{name}:untouched"] = before.keys() == after.keys() and all(
            torch.equal(before[k], after[k]) for k in before)
    report["marker"] = os.path.exists(marker)
    report["step_count"] = step.step_count
    return report


def dcp_previous_format_run(rank: int, world_size: int, case: str, stop: int, save: str, numpy_scalar: bool) -> dict:
    """``integration_workers.dcp_checkpoint_run`` saving its step state the previous way,
    ``torch.save(step.state_dict())`` into the bytes entry (with ``numpy_scalar``: its step count a numpy integer,
    which ``weights_only`` refuses)."""
    from deft_compile import step_state

    def previous_write(state, file) -> None:
        if numpy_scalar:
            state = {**state, "step_count": numpy.int64(state["step_count"])}
        torch.save(state, file)

    step_state.write = previous_write
    return dcp_checkpoint_run(rank, world_size, case, 0, stop, None, save)


# -- DeftTrainer ---------------------------------------------------------------------------------------------------
def trainer_variants(source: str, root: str, marker: str) -> dict[str, str]:
    """Copies of the Trainer checkpoint folder ``source`` whose ``deft_step_rank<r>.pt`` files are replaced (every
    rank's, or rank 0's only for ``rank0_only``); name -> folder. Written in the test's process."""
    import shutil

    from deft_compile import step_state

    files = sorted(Path(source).glob("deft_step_rank*.pt"))
    good = {f.name: f.read_bytes() for f in files}
    states = {f.name: step_state.read(f, str(f)) for f in files}
    contents = {
        "touch_in_step_state": lambda name: saved_bytes(RunsCode(marker)),
        "system_inside_plain_wrapper": lambda name: saved_bytes({"format": step_state.FORMAT, "version": 1,
                                                                 "state": {"step_count": RunsSystem(marker)}}),
        "raw_pickle": lambda name: pickle.dumps(RunsSystem(marker)),
        "truncated": lambda name: good[name][: len(good[name]) // 2],
        "empty": lambda name: b"",
        "foreign_text": lambda name: b"not a checkpoint\n",
        "foreign_torch_file": lambda name: saved_bytes(torch.zeros(3)),
        "previous_format": lambda name: saved_bytes(states[name]),
        "previous_format_numpy": lambda name: saved_bytes(
            {**states[name], "step_count": numpy.int64(states[name]["step_count"])}),
        "rank0_only": lambda name: saved_bytes(RunsCode(marker)) if name == "deft_step_rank0.pt" else good[name],
    }
    folders = {}
    for variant, content in contents.items():
        folder = Path(root) / variant
        shutil.copytree(source, folder)
        for f in files:
            (folder / f.name).write_bytes(content(f.name))
        folders[variant] = str(folder)
    return folders


def trainer_resume_refusals(rank: int, world_size: int, folders: dict[str, str], output_dir: str, marker: str) -> dict:
    """``DeftTrainer.train(resume_from_checkpoint=folder)`` for each folder (``trainer_variants``): the error each
    resume raises (None where it resumed and trained), and whether the marker exists."""
    from trainer_workers import _as_torchrun, gpt2, training_arguments

    _as_torchrun(rank, world_size)
    import transformers

    from deft_compile.integrations.transformers import DeftTrainer

    transformers.logging.set_verbosity_error()
    base, data = gpt2(layers=1)
    report: dict = {}
    for name, folder in folders.items():
        args = training_arguments(f"{output_dir}/{name}", max_steps=4)
        trainer = DeftTrainer(model=base, args=args, train_dataset=data, policy="deft",
                              deft_config=DeftConfig(first_bucket_mb=0.01, bucket_cap_mb=0.05))
        report[name] = refused(lambda: trainer.train(resume_from_checkpoint=folder))
    report["marker"] = os.path.exists(marker)
    return report
