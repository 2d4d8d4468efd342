"""Convert a checkpoint you trust to the step-state format that loads without running code.

::

    deft-compile convert-checkpoint --trust PATH [PATH ...]     (or: python -m deft_compile.tools.convert_checkpoint)

``PATH`` is a ``DeftTrainer`` step-state file (``deft_step_rank<r>.pt``), a Trainer checkpoint folder holding
such files, or a ``deft_compile.checkpoint`` (DCP) folder. Each step state in it is rewritten in place as
``deft_compile.step_state`` writes it (tensors and plain data; numpy scalars become the numbers they hold); a DCP
folder is written anew with the same entries and marked complete. Loading a checkpoint reads every file with
``torch.load(weights_only=True)`` and refuses one that names anything else; this tool is for a checkpoint of the
previous format that it refuses.

This module is the one place deft_compile unpickles with ``torch.load(weights_only=False)`` (and lets DCP do so):
it trusts the file, and unpickling runs whatever the file names. Convert only checkpoints you wrote yourself and
that nobody else could write to since; ``--trust`` is required on the command line to say so.
"""

from __future__ import annotations

import argparse
import glob
import io
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from deft_compile import step_state
from deft_compile.errors import DeftError

#: the step-state files of a DeftTrainer checkpoint folder
TRAINER_FILES = "deft_step_rank*.pt"


def convert_trusted(path: str | os.PathLike) -> list[str]:
    """Rewrite every step state at ``path`` (a step-state file, a Trainer checkpoint folder or a DCP checkpoint
    folder) as ``deft_compile.step_state`` writes it; returns the files or folders rewritten.

    Trusts ``path``: it is unpickled with ``torch.load(weights_only=False)``, which runs whatever the file names.
    Call it only on a checkpoint you wrote yourself."""
    target = Path(os.fspath(path))
    if target.is_file():
        _convert_file(target)
        return [str(target)]
    if (target / ".metadata").is_file():
        _convert_dcp_folder(target)
        return [str(target)]
    files = sorted(glob.glob(str(target / TRAINER_FILES)))
    if not files:
        raise DeftError(f"{target}: neither a step-state file, a folder with {TRAINER_FILES} nor a DCP checkpoint "
                        f"folder (.metadata)")
    for name in files:
        _convert_file(Path(name))
    return files


def _trusted_state(saved: Any, what: str) -> dict[str, Any]:
    """The step state in what ``torch.load(weights_only=False)`` gave, as ``step_state.from_plain`` returns it."""
    if type(saved) is dict and saved.get("format") == step_state.FORMAT:
        return step_state.from_plain(saved.get("state"), what)
    if not step_state.is_previous_format(saved):
        raise DeftError(f"{what} is not a deft_compile step state (a {type(saved).__name__}): nothing to convert")
    return step_state.from_plain(step_state.to_plain(saved, coerce_numpy=True), what)


def _convert_file(path: Path) -> None:
    saved = torch.load(path, weights_only=False)  # trusted: see the module docstring
    state = _trusted_state(saved, str(path))
    partial = path.with_name(path.name + ".converting")
    step_state.write(state, partial)
    os.replace(partial, path)


def _convert_dcp_folder(folder: Path) -> None:
    """Read the whole DCP checkpoint into memory (DCP's own, trusting reader), rewrite its step states, and write it
    anew in its place: every entry under its key, one process's files, marked complete."""
    from torch.distributed.checkpoint import save as dcp_save
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from deft_compile.checkpoint import KEY, _mark_complete

    with tempfile.TemporaryDirectory(dir=folder.parent) as scratch:
        whole = Path(scratch) / "whole.pt"
        dcp_to_torch_save(folder, whole)
        state = torch.load(whole, weights_only=False)  # trusted: see the module docstring
        steps = state.get(KEY, {}).get("step", {}) if isinstance(state.get(KEY), dict) else {}
        if not steps:
            raise DeftError(f"{folder} holds no deft step state ({KEY}.step): not written by deft_compile.checkpoint")
        for key, blob in steps.items():
            what = f"{folder}: {KEY}.step.{key}"
            blob.seek(0)
            converted = io.BytesIO()
            step_state.write(_trusted_state(torch.load(blob, weights_only=False), what), converted)
            converted.seek(0)
            steps[key] = converted
        written = Path(scratch) / "converted"
        dcp_save(state, checkpoint_id=written, no_dist=True)
        _mark_complete(written)
        os.replace(folder, Path(scratch) / "previous")  # removed with the scratch folder
        os.replace(written, folder)


def _arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("paths", nargs="+", help="step-state files, Trainer checkpoint folders, DCP folders")
    parser.add_argument("--trust", action="store_true", required=True,
                        help="required: you wrote these checkpoints and nobody else could change them")
    return parser


_DESCRIPTION = ("Rewrite deft_compile step states you trust in the format that loads without running code. Unpickles "
                "them with torch.load(weights_only=False): whatever a file names runs.")


def add_parser(subparsers: Any) -> None:
    """``deft-compile convert-checkpoint --trust PATH...``."""
    parser = subparsers.add_parser("convert-checkpoint", help="rewrite trusted previous-format checkpoints",
                                   description=_DESCRIPTION)
    _arguments(parser).set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    for path in args.paths:
        for written in convert_trusted(path):
            print(f"converted {written}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deft_compile.tools.convert_checkpoint", description=_DESCRIPTION)
    return run(_arguments(parser).parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
