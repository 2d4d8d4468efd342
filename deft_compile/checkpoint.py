"""Save and load a compiled step's training state with ``torch.distributed.checkpoint`` (DCP).

::

    from deft_compile import checkpoint

    checkpoint.save(step, "ckpt/100", extra={"scheduler": scheduler})     # every rank, at a step boundary
    ...
    step = deft_compile(model, optimizer, ...)                              # a fresh process group
    checkpoint.load(step, "ckpt/100", extra={"scheduler": scheduler})     # before its next call

Under the key ``"deft"`` the checkpoint holds:

- ``model`` and ``optimizer``: ``torch.distributed.checkpoint.state_dict.get_state_dict`` of the
  step's model and optimizer (parameter names as keys, loaded in place by ``set_state_dict``).
  DCP writes a tensor that every rank holds under one key once; where the replicas may differ
  between ``flush()``es (``policy="dssync"``, ``DeftConfig(delayed_update="local")``) both are
  kept per rank instead (``model.rank<r>``, ``optimizer.rank<r>``).
- ``step.rank<r>``: each rank's ``step.state_dict()`` (step counter, plan, profile, pending delayed
  gradients, partial accumulations, the Preserver's and the loss scaler's state) as tensors and plain data
  (``deft_compile.step_state``), ``torch.save``d into one bytes entry, as torchtitan keeps its train state:
  pending gradients and accumulations are per rank, and a bytes entry loads whole, with no tensor of the right
  shape needed to load into.

``extra`` entries (anything DCP saves: tensors, state dicts, ``Stateful`` objects such as an LR
scheduler) go into the same checkpoint under their own keys.

DCP loads tensors in place, so ``load`` needs a tensor for every entry it reads. A fresh optimizer
has no state: DCP gives it some (a zero-learning-rate ``step()`` on zero gradients), and ``load``
keeps only the entries the checkpoint has (parameters without state when it was saved, a delayed
bucket before its first update or an unused parameter, stay without), read from the checkpoint's
metadata; ``save`` writes no state for an optimizer that had none and leaves it without. A model
entry missing from the checkpoint raises DCP's error. Resuming needs the same world size and
policy (``step.load_state_dict`` checks the policy); everything loads bit-identically.

A save is complete when every rank's files and DCP's metadata are written: then rank 0 writes ``COMPLETE_FILE``
beside them, naming every file of the checkpoint with its size (it removes an older one before the save starts).
``load`` refuses a folder without it, or whose files are missing or of another size (a save interrupted by a
failure, a truncated copy), with ``TornCheckpointError`` on every rank, before anything is read.

Loading runs no code from the checkpoint: DCP's metadata is unpickled with its own classes only, every bytes entry
with ``torch.load(weights_only=True)`` and the step state is read as plain data (``deft_compile.dcp_reading``,
``deft_compile.step_state``). The step's entry is read and checked first, so a checkpoint refused for it
(``DeftError``; ``TornCheckpointError`` where it is truncated) leaves the model and optimizer as they were. A
step state of the previous format (``torch.save(step.state_dict())``) is converted as it loads where
``weights_only`` reads it, and refused with the way to convert it otherwise (``deft_compile.tools.convert_checkpoint``).

A rank that dies or hangs during ``save`` or ``load`` makes the others raise ``PeerFailureError`` naming it, after
the process group's timeout at most.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from deft_compile import step_state
from deft_compile.dcp_reading import MetadataReader, PlainLoadPlanner, refusal_in
from deft_compile.errors import DeftError, TornCheckpointError
from deft_compile.step.distributed import lost_peers_named
from deft_compile.step.runtime import CompiledStep
from deft_compile.timing import comm_device

KEY = "deft"

#: written by rank 0 into the checkpoint folder once every file of the save is complete: ``{"files": {name: size}}``
COMPLETE_FILE = "deft_complete.json"


def save(step: CompiledStep, checkpoint_id: str | os.PathLike, *, extra: Mapping[str, Any] | None = None,
         model: nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None) -> None:
    """``dcp.save`` of the step's model, optimizer and ``step.state_dict()`` (plus ``extra``) to ``checkpoint_id``.

    Call on every rank of the step's process group, between steps. ``model`` and ``optimizer`` default to the
    step's own. No step communication runs (``step.state_dict()`` waits for pending all-reduces locally); DCP's own
    collectives run on the step's process group. Rank 0 marks the folder complete at the end (``COMPLETE_FILE``)."""
    model, optimizer = _model_and_optimizer(step, model, optimizer)
    if _rank(step) == 0:  # before DCP's first collective, so before any rank writes into the folder
        (Path(os.fspath(checkpoint_id)) / COMPLETE_FILE).unlink(missing_ok=True)
    had_state = bool(optimizer.state)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    if not had_state:  # DCP stepped it with lr 0 to have tensors to write: not this run's state
        optimizer.state.clear()
        optimizer_state = {**optimizer_state, "state": {}}
    blob = io.BytesIO()
    step_state.write(step.state_dict(), blob)
    blob.seek(0)
    state = _layout(step, model_state, optimizer_state, blob)
    with _peers_named(step):
        dcp.save({KEY: state, **dict(extra or {})}, storage_writer=_MarkingWriter(os.fspath(checkpoint_id)),
                 process_group=step.process_group)


def load(step: CompiledStep, checkpoint_id: str | os.PathLike, *, extra: Mapping[str, Any] | None = None,
         model: nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
         check_complete: bool = True) -> None:
    """Load what ``save`` wrote into the step, its model and optimizer (and ``extra``, in place, as ``dcp.load``
    does). Call on every rank, after ``deft_compile()`` and before the step's next call. ``check_complete``: refuse
    a checkpoint that ``save`` did not finish (``TornCheckpointError``); False reads whatever DCP can read."""
    model, optimizer = _model_and_optimizer(step, model, optimizer)
    if check_complete:
        check_complete_checkpoint(checkpoint_id)
    where = os.fspath(checkpoint_id)
    saved = set(MetadataReader(where).read_metadata().state_dict_metadata)
    key = f"rank{_rank(step)}"
    if f"{KEY}.step.{key}" not in saved:
        raise DeftError(f"{where!r} holds no deft step state for rank {_rank(step)}: not written "
                        f"by deft_compile.checkpoint.save, or with another world size")
    # the step's entry first: a checkpoint refused for it leaves the model and optimizer untouched
    entry = {KEY: {"step": {key: io.BytesIO()}}}
    _dcp_load(step, entry, where)
    blob = entry[KEY]["step"][key]
    resumed = _read_on_every_rank(step, blob, where)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    prefix = f"{KEY}.optimizer" + ("" if _replicated(step) else f".{key}")
    optimizer_state = {**optimizer_state, "state": {
        name: kept for name, entries in optimizer_state["state"].items()
        if (kept := {k: v for k, v in entries.items() if f"{prefix}.state.{name}.{k}" in saved})}}
    state = _layout(step, model_state, optimizer_state, None)
    _dcp_load(step, {KEY: state, **dict(extra or {})}, where)
    if not _replicated(step):
        model_state, optimizer_state = state["model"][key], state["optimizer"][key]
    else:
        model_state, optimizer_state = state["model"], state["optimizer"]
    # not strict: parameters without optimizer state in the checkpoint stay without (every model key was read above)
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state,
                   options=StateDictOptions(strict=False))
    step.load_state_dict(resumed)


def _read_on_every_rank(step: CompiledStep, blob: Any, where: str) -> dict[str, Any]:
    """``step_state.read`` of this rank's step entry; every rank raises if any rank's entry is refused."""
    what = f"the deft step state of rank {_rank(step)} in checkpoint {where!r}"
    refusal: DeftError | None = None
    resumed: dict[str, Any] = {}
    try:
        if not isinstance(blob, io.BytesIO):
            raise DeftError(f"{what} is a {type(blob).__name__}, not the bytes of a step state")
        resumed = step_state.read(blob, what)
    except DeftError as error:
        refusal = error
    if step.process_group is not None:
        with _peers_named(step):
            refuse_together(refusal, step.process_group, f"checkpoint {where!r}")
    elif refusal is not None:
        raise refusal
    return resumed


def refuse_together(refusal: DeftError | None, group: dist.ProcessGroup | None, where: str) -> None:
    """Raise on every rank of ``group`` (None: the default group) when any rank refused what it read from
    ``where`` (its ``refusal``; None where it read it): each rank reads its own step state, and without this the
    ranks that read theirs would wait in the next collective for the one that raised. One all-reduce."""
    refused = torch.tensor([0 if refusal is None else 1], device=comm_device(group))
    dist.all_reduce(refused, group=group)
    if refusal is not None:
        raise refusal
    if int(refused) > 0:
        raise DeftError(f"{where}: {int(refused)} other rank(s) refused their deft step state (their error says why); "
                        f"nothing was loaded")


def _dcp_load(step: CompiledStep, state: dict[str, Any], where: str) -> None:
    """``dcp.load`` of ``state`` from the folder ``where``, reading no code (``deft_compile.dcp_reading``); a
    refusal on any rank raises its ``DeftError`` on every rank."""
    with _peers_named(step):
        try:
            dcp.load(state, storage_reader=MetadataReader(where), planner=PlainLoadPlanner(where),
                     process_group=step.process_group)
        except CheckpointException as error:
            refusal = refusal_in(error, _rank(step))
            if refusal is None:
                raise
            raise refusal from None


def _model_and_optimizer(step: CompiledStep, model: nn.Module | None,
                         optimizer: torch.optim.Optimizer | None) -> tuple[nn.Module, torch.optim.Optimizer]:
    return (model if model is not None else step.model), (optimizer if optimizer is not None else step.optimizer)


def _rank(step: CompiledStep) -> int:
    return dist.get_rank(step.process_group) if step.process_group is not None else 0


def _replicated(step: CompiledStep) -> bool:
    """Whether every rank holds the same parameters and optimizer state at every step boundary."""
    return step.policy != "dssync" and step.config.delayed_update != "local"


def _layout(step: CompiledStep, model_state: dict, optimizer_state: dict, blob: io.BytesIO | None) -> dict[str, Any]:
    """The ``"deft"`` entry: model and optimizer (per rank where replicas may differ) and, with ``blob``, the step."""
    key = f"rank{_rank(step)}"
    steps = {} if blob is None else {"step": {key: blob}}
    if _replicated(step):
        return {"model": model_state, "optimizer": optimizer_state, **steps}
    return {"model": {key: model_state}, "optimizer": {key: optimizer_state}, **steps}


def check_complete_checkpoint(checkpoint_id: str | os.PathLike) -> None:
    """Raise ``TornCheckpointError`` unless ``save`` finished writing ``checkpoint_id``: its ``COMPLETE_FILE`` is
    there and every file it names has the size it had then."""
    folder = Path(os.fspath(checkpoint_id))
    if not folder.is_dir():
        raise DeftError(f"no checkpoint at {os.fspath(checkpoint_id)!r}: not a folder")
    try:
        files = json.loads((folder / COMPLETE_FILE).read_text())["files"]
    except FileNotFoundError:
        raise TornCheckpointError(
            f"{os.fspath(checkpoint_id)!r} is not a complete checkpoint: it has no {COMPLETE_FILE}, which "
            f"deft_compile.checkpoint.save writes once every rank's files are written, so the save that wrote it did "
            f"not finish (a rank failed or was stopped during it); resume from an earlier checkpoint") from None
    except (ValueError, KeyError, TypeError) as error:
        raise TornCheckpointError(f"{os.fspath(checkpoint_id)!r}: its {COMPLETE_FILE} is unreadable ({error}); the "
                                  f"checkpoint cannot be trusted") from None
    problems = []
    for name, size in sorted(files.items()):
        path = folder / name
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif path.stat().st_size != size:
            problems.append(f"{name} has {path.stat().st_size} bytes, {size} when saved")
    if problems:
        raise TornCheckpointError(f"{os.fspath(checkpoint_id)!r} is torn: " + "; ".join(problems)
                                  + "; resume from an earlier checkpoint")


class _MarkingWriter(dcp.FileSystemWriter):
    """DCP's file-system writer that marks the checkpoint complete right after the coordinator wrote the metadata
    (``finish``), before DCP tells the other ranks the save succeeded: when ``save`` returns on any rank, the mark
    is there."""

    def finish(self, metadata: Any, results: Any) -> None:
        super().finish(metadata, results)
        _mark_complete(Path(os.fspath(self.path)))


def _mark_complete(folder: Path) -> None:
    """Write ``COMPLETE_FILE`` naming every file of the finished save with its size (atomically: a rename)."""
    files = {path.relative_to(folder).as_posix(): path.stat().st_size
             for path in sorted(folder.rglob("*")) if path.is_file() and path.name != COMPLETE_FILE}
    partial = folder / (COMPLETE_FILE + ".partial")
    partial.write_text(json.dumps({"files": files}, indent=1))
    os.replace(partial, folder / COMPLETE_FILE)


def _peers_named(step: CompiledStep):
    """DCP's collectives failing because a rank is gone raise ``PeerFailureError`` naming it."""
    return lost_peers_named(step.process_group, step.step_count, step.config.peer_check_timeout_s)
