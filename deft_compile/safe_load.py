"""Read what ``torch.save`` wrote without running code from it: ``torch.load(weights_only=True)``.

A checkpoint is input: whoever can write into its folder chooses its bytes. A pickle names callables that
unpickling calls (``os.system``, ``pathlib.Path.touch``, ...), so ``torch.load(weights_only=False)`` of a
checkpoint runs whatever the file names. ``weights_only=True`` unpickles tensors, plain containers and scalars
only and refuses anything else before calling it. ``load_weights_only`` is that load with its failures told
apart, so a caller never sees a pickle traceback:

- a file that is empty, or a zip archive that cannot be read to its end (a truncated or damaged copy):
  ``TornCheckpointError``;
- a file that is not a ``torch.save`` zip archive (no ``data.pkl``), or whose pickle names something
  ``weights_only`` refuses: ``DeftError`` naming what it is and what it names. Nothing is unpickled in another way.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import zipfile
from pathlib import Path
from typing import Any, Sequence

import torch

from deft_compile.errors import DeftError, TornCheckpointError

#: every ``torch.save`` file deft_compile reads starts as a zip archive does
ZIP_MAGIC = b"PK\x03\x04"

#: words of torch's errors for an archive it cannot read to its end
_DAMAGED = ("PytorchStreamReader", "inline_container", "zip archive", "corrupted")

#: what the user is told about a file ``weights_only`` refuses
CONVERT_HINT = ("if it is a checkpoint you wrote yourself with an earlier deft_compile and you trust it, convert it "
                "once with `deft-compile convert-checkpoint --trust PATH` "
                "(deft_compile.tools.convert_checkpoint.convert_trusted), which unpickles it with "
                "torch.load(weights_only=False) and so runs whatever it names")


def load_weights_only(source: str | os.PathLike | io.BytesIO | bytes, what: str, *,
                      allow: Sequence[type] = (), hint: str = CONVERT_HINT) -> Any:
    """``torch.load(source, weights_only=True)``, with ``allow`` added to the types it builds (harmless ones
    only: their construction must run nothing the file chooses). ``what`` names the source in errors; ``hint``
    ends the error of a pickle ``weights_only`` refuses (what the user can do)."""
    data = _bytes_of(source, what)
    if not data:
        raise TornCheckpointError(f"{what} is empty: a save that did not finish, or a truncated copy; resume from "
                                  f"an earlier checkpoint")
    if not data.startswith(ZIP_MAGIC):
        raise DeftError(f"{what} is not a file torch.save writes (it does not start as a zip archive, "
                        f"{data[:8]!r}...): refused, and nothing in it was unpickled")
    try:
        names = zipfile.ZipFile(io.BytesIO(data)).namelist()
    except (zipfile.BadZipFile, EOFError, ValueError, OSError) as error:  # no central directory: cut short
        raise TornCheckpointError(f"{what} is truncated or damaged: it starts as a zip archive but cannot be read as "
                                  f"one ({error}); resume from an earlier checkpoint") from None
    if not any(name.endswith("data.pkl") for name in names):
        raise DeftError(f"{what} is not a file torch.save writes: a zip archive without data.pkl "
                        f"({', '.join(names[:4])}{', ...' if len(names) > 4 else ''})")
    try:
        with torch.serialization.safe_globals(list(allow)):
            return torch.load(io.BytesIO(data), weights_only=True)
    except pickle.UnpicklingError as error:
        raise DeftError(f"{what} holds a pickle that loading would have to run code for "
                        f"({_refused_part(str(error))}): refused, and nothing it names was called. deft_compile "
                        f"reads checkpoints as tensors and plain data only; {hint}") from None
    except (RuntimeError, EOFError, ValueError, KeyError, IndexError, OSError) as error:
        if isinstance(error, RuntimeError) and not any(sign in str(error) for sign in _DAMAGED):
            # read to its end but not loadable here (a tensor saved on a device this process lacks)
            raise DeftError(f"{what} cannot be loaded here ({_first_line(error)})") from None
        raise TornCheckpointError(f"{what} is truncated or damaged: torch cannot read it "
                                  f"({type(error).__name__}: {_first_line(error)}); resume from an earlier "
                                  f"checkpoint") from None


def _bytes_of(source: str | os.PathLike | io.BytesIO | bytes, what: str) -> bytes:
    if isinstance(source, bytes):
        return source
    if isinstance(source, io.BytesIO):
        return source.getvalue()
    try:
        return Path(os.fspath(source)).read_bytes()
    except FileNotFoundError:
        raise DeftError(f"{what}: no such file") from None


def _first_line(error: BaseException) -> str:
    """The error's message up to torch's advice for its own loader."""
    return (str(error).strip().splitlines() or [""])[0].split(". This is an internal")[0][:300]


def _refused_part(message: str) -> str:
    """The part of torch's ``weights_only`` refusal that says what the pickle named."""
    for pattern in (r"Unsupported global: GLOBAL ([\w.]+)", r"unsupported GLOBAL ([\w.]+)"):
        found = re.search(pattern, message)
        if found:
            return f"it names {found.group(1)}"
    found = re.search(r"Unsupported operand (\d+)", message)
    if found:
        return f"pickle opcode {found.group(1)}, which only a pickle of arbitrary objects uses"
    found = re.search(r"WeightsUnpickler error: *(.+)", message)
    return found.group(1).strip()[:300] if found else "torch.load(weights_only=True) refused it"
