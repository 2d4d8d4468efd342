"""Read a ``torch.distributed.checkpoint`` (DCP) folder without running code from it.

DCP's own reader unpickles the folder's ``.metadata`` with ``pickle.load``, and its load planner every bytes entry
(anything not a tensor: hyper-parameters, a scheduler's state, deft's step state) with
``torch.load(weights_only=False)``; either runs whatever a file in the folder names. ``checkpoint.load`` reads
through the two classes here instead:

- ``MetadataReader``: DCP's file-system reader whose ``.metadata`` is unpickled with only the classes DCP's
  metadata consists of (``torch.distributed.checkpoint.metadata``'s dataclasses and enum, the file-system
  reader's storage records, ``torch.Size``, dtypes, layouts, memory formats and paths); a pickle naming anything
  else raises ``DeftError`` before it is called.
- ``PlainLoadPlanner``: DCP's default load planner whose bytes entries load with ``torch.load(weights_only=True)``
  (``deft_compile.safe_load``), ``io.BytesIO`` and ``bytes`` allowed (DCP stores a bytes entry as a pickled
  ``BytesIO``; an empty one pickles as a call of ``bytes``).

A refusal raised inside ``dcp.load`` reaches every rank wrapped in DCP's ``CheckpointException``;
``refusal_in`` finds it there.
"""

from __future__ import annotations

import dataclasses
import enum
import io
import os
import pickle
from pathlib import Path, PurePosixPath, PurePath, PureWindowsPath
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from deft_compile.errors import DeftError
from deft_compile.safe_load import CONVERT_HINT, load_weights_only

#: what the user is told about an entry other than the step's that ``weights_only`` refuses
EXTRA_HINT = ("save entries (extra ones included) as tensors and plain data, such as a state_dict() of numbers, "
              "strings, lists and dicts")

try:  # where DCP's own planner takes it from
    from torch.distributed.checkpoint._traverse import set_element
except ImportError:  # pragma: no cover - a torch that moved it
    set_element = None


def _metadata_classes() -> dict[tuple[str, str], Any]:
    """(module, name) -> object, for everything a DCP ``.metadata`` pickle may name."""
    allowed: dict[tuple[str, str], Any] = {}
    for name, value in vars(dcp_metadata).items():
        if isinstance(value, type) and value.__module__ == dcp_metadata.__name__ and (
                dataclasses.is_dataclass(value) or issubclass(value, enum.Enum)):
            allowed[(value.__module__, name)] = value
    for value in (_StorageInfo, torch.Size, Path, PurePath, PurePosixPath, PureWindowsPath, type(Path())):
        allowed[(value.__module__, value.__qualname__)] = value
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout  # a layout by its name
    for name, value in vars(torch).items():
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            allowed[("torch", name)] = value
    return allowed


_ALLOWED = _metadata_classes()


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata: ``find_class`` gives the allowed classes only (exact names, no attribute paths)."""

    def __init__(self, file: Any, what: str) -> None:
        super().__init__(file)
        self.what = what

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise DeftError(f"{self.what} names {module}.{name}, which is not part of a DCP checkpoint's metadata: "
                            f"refused, and nothing it names was called (a checkpoint loads no code)") from None


def read_metadata_file(path: str | os.PathLike) -> Metadata:
    """The DCP ``Metadata`` in the file at ``path``, unpickled with the metadata classes only."""
    what = f"DCP metadata file {os.fspath(path)!r}"
    try:
        data = Path(os.fspath(path)).read_bytes()
    except FileNotFoundError:
        raise DeftError(f"{what} does not exist: not a DCP checkpoint folder") from None
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data), what).load()
    except DeftError:
        raise
    except Exception as error:  # noqa: BLE001 - a truncated or foreign file: said plainly, no pickle traceback
        raise DeftError(f"{what} cannot be read as DCP metadata ({type(error).__name__}: {error})") from None
    if not isinstance(metadata, Metadata):
        raise DeftError(f"{what} holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


class MetadataReader(dcp.FileSystemReader):
    """DCP's file-system reader, reading ``.metadata`` with ``read_metadata_file`` (module docstring)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        metadata = read_metadata_file(Path(os.fspath(self.path)) / name)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class PlainLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, loading bytes entries with ``torch.load(weights_only=True)``."""

    def __init__(self, where: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.where = where

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        hint = CONVERT_HINT if fqn.startswith("deft.step.") else EXTRA_HINT
        loaded = load_weights_only(value, f"entry {fqn!r} of checkpoint {self.where!r}", allow=(io.BytesIO, bytes),
                                   hint=hint)
        if self.flatten_state_dict:
            if set_element is None:  # pragma: no cover
                raise DeftError("this torch has no torch.distributed.checkpoint._traverse.set_element")
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


def refusal_in(error: CheckpointException, rank: int) -> DeftError | None:
    """The ``DeftError`` a rank raised inside ``dcp.load`` (this ``rank``'s first), if ``error`` carries one."""
    failures = sorted(error.failures.items(), key=lambda item: item[0] != rank)
    for _rank, failure in failures:
        exception = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(exception, DeftError):
            return exception
    return None
