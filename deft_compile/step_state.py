"""The compiled step's state as a checkpoint stores it: tensors and plain data, read without running code.

``CompiledStep.state_dict()`` holds counters, the policy name, the plan and profile as JSON strings, pending and
accumulated gradients as tensors, the Preserver's state and the loss scaler's. A checkpoint holds it as
``to_plain`` gives it, and ``from_plain`` gives back exactly the state that was saved (same keys, types and
values; tensors bit for bit), so a resumed run continues as the one that saved it.

Plain is: ``None``, ``bool``, ``int``, ``float``, ``str``, ``torch.Tensor`` (the class itself, no subclass),
``list``, and ``dict`` with ``str`` or ``int`` keys, each checked by its exact type (no numpy scalar, enum,
dataclass, ``torch.Size``, tuple or subclass of a plain type). The one place the state holds tuples, the (delay,
period) pairs of the Preserver's paired-replay schedule (``TUPLE_PATHS``), is stored as lists and given back as
tuples; a tuple anywhere else, or any other type, makes ``to_plain`` raise ``DeftError``: a value the file could
not give back as it was is refused when saving, not found out when resuming.

A file (``write``) is ``torch.save`` of ``{"format": FORMAT, "version": VERSION, "state": to_plain(state)}``.
``read`` loads it with ``torch.load(weights_only=True)`` (``deft_compile.safe_load``: no code from the file runs)
and refuses whatever is not plain. A file of the previous format, ``torch.save(step.state_dict())`` without the
``format`` key, is converted as it loads when ``weights_only`` reads it; one that it refuses raises ``DeftError``
naming what it holds and how to convert a file one trusts (``deft_compile.tools.convert_checkpoint``).
"""

from __future__ import annotations

import io
import logging
import os
from typing import Any

import torch

from deft_compile.errors import DeftError
from deft_compile.safe_load import CONVERT_HINT, load_weights_only

__all__ = ["FORMAT", "VERSION", "TUPLE_PATHS", "to_plain", "from_plain", "write", "read", "is_previous_format"]

log = logging.getLogger("deft_compile")

#: the ``format`` entry of a step state file
FORMAT = "deft_compile.step_state"
#: the version of that format ``write`` writes and ``read`` reads up to
VERSION = 1

#: paths (keys from the top; ``"*"``: any key) of the tuples the step state holds: the Preserver's paired-replay
#: schedule, parameter name -> (delay, period)
TUPLE_PATHS: tuple[tuple[str, ...], ...] = (("preserver", "admission", "schedule", "*"),)

_SCALARS = (type(None), bool, int, float, str)
#: keys every step state has (and the previous format, ``torch.save(step.state_dict())``, always had)
_KEYS = frozenset({"step_count", "policy", "plan", "profile", "pending"})


def to_plain(state: dict[str, Any], *, coerce_numpy: bool = False) -> dict[str, Any]:
    """The step state as plain data (module docstring): new containers, the same tensors. ``coerce_numpy``:
    numpy scalars become the Python numbers they hold (for ``deft_compile.tools.convert_checkpoint``, which
    converts a previous-format file). Raises ``DeftError`` naming the first value that is not plain."""
    if type(state) is not dict:
        raise DeftError(f"a step state is a dict; got {type(state).__name__}")
    return _plain(state, (), coerce_numpy)


def from_plain(plain: dict[str, Any], what: str = "the step state") -> dict[str, Any]:
    """The step state ``to_plain`` gave: the tuples of ``TUPLE_PATHS`` back as tuples. Raises ``DeftError`` if
    ``plain`` holds anything that is not plain (``what`` names where it came from)."""
    if type(plain) is not dict:
        raise DeftError(f"{what} is not a deft_compile step state: a dict was expected, it holds a "
                        f"{type(plain).__name__}")
    try:
        _check(plain, ())
    except DeftError as error:
        raise DeftError(f"{what} is not a step state deft_compile writes: {error}") from None
    return _restore(plain, ())


def is_previous_format(value: Any) -> bool:
    """Whether ``value`` is what the previous format saved: ``step.state_dict()`` itself, with no ``format``."""
    return type(value) is dict and "format" not in value and _KEYS <= value.keys()


def write(state: dict[str, Any], file: str | os.PathLike | io.BytesIO) -> None:
    """``torch.save`` the step state (``CompiledStep.state_dict()``) as plain data to ``file``."""
    torch.save({"format": FORMAT, "version": VERSION, "state": to_plain(state)}, file)


def read(source: str | os.PathLike | io.BytesIO | bytes, what: str) -> dict[str, Any]:
    """The step state ``write`` wrote to ``source``, for ``CompiledStep.load_state_dict``; no code in the file
    runs. ``what`` names the source in errors: ``DeftError`` for a file that is not a step state or holds
    something not plain, ``TornCheckpointError`` for a truncated one."""
    saved = load_weights_only(source, what)
    if is_previous_format(saved):
        try:
            plain = to_plain(saved)
        except DeftError as error:
            raise DeftError(f"{what} is a step state of the previous format (torch.save(step.state_dict())) that "
                            f"cannot be read as plain data: {error}; {CONVERT_HINT}") from None
        log.info("%s: a step state of the previous format, converted as it loads (write it again to store it "
                 "in format %s version %d)", what, FORMAT, VERSION)
        return from_plain(plain, what)
    if type(saved) is not dict or saved.get("format") != FORMAT:
        kind = f"a dict with keys {sorted(map(str, saved))[:8]}" if type(saved) is dict else type(saved).__name__
        raise DeftError(f"{what} is not a deft_compile step state: a torch.save file of {kind}, without "
                        f"format {FORMAT!r}")
    version = saved.get("version")
    if type(version) is not int or not 1 <= version <= VERSION:
        raise DeftError(f"{what} is a step state of format version {version!r}; this deft_compile reads versions "
                        f"1 to {VERSION}: load it with the deft_compile that wrote it")
    state = from_plain(saved.get("state"), what)
    missing = sorted(_KEYS - state.keys())
    if missing:
        raise DeftError(f"{what} is not a complete step state: it has no {', '.join(missing)}")
    return state


def _matches(path: tuple, patterns: tuple[tuple[str, ...], ...]) -> bool:
    return any(len(path) == len(p) and all(k == "*" or k == key for k, key in zip(p, path)) for p in patterns)


def _where(path: tuple) -> str:
    return "state" + "".join(f"[{key!r}]" for key in path)


def _plain(value: Any, path: tuple, coerce_numpy: bool) -> Any:
    kind = type(value)
    if kind in _SCALARS or kind is torch.Tensor:
        return value
    if kind is dict:
        for key in value:
            if type(key) not in (str, int):
                raise DeftError(f"{_where(path)} has a key of type {type(key).__name__} ({key!r}): a checkpoint "
                                f"stores str and int keys only")
        return {key: _plain(item, path + (key,), coerce_numpy) for key, item in value.items()}
    if kind is list or (kind is tuple and _matches(path, TUPLE_PATHS)):
        return [_plain(item, path + (index,), coerce_numpy) for index, item in enumerate(value)]
    if coerce_numpy and kind.__module__ == "numpy" and hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        return _plain(value.item(), path, coerce_numpy)
    raise DeftError(f"{_where(path)} is a {kind.__module__}.{kind.__qualname__}: a checkpoint stores tensors and "
                    f"plain data only (None, bool, int, float, str, list, dict)")


def _check(value: Any, path: tuple) -> None:
    kind = type(value)
    if kind in _SCALARS or kind is torch.Tensor:
        return
    if kind is dict:
        for key, item in value.items():
            if type(key) not in (str, int):
                raise DeftError(f"{_where(path)} has a key of type {type(key).__name__}")
            _check(item, path + (key,))
        return
    if kind is list:
        for index, item in enumerate(value):
            _check(item, path + (index,))
        return
    raise DeftError(f"{_where(path)} is a {kind.__module__}.{kind.__qualname__}, not plain data")


def _restore(value: Any, path: tuple) -> Any:
    if type(value) is dict:
        return {key: _restore(item, path + (key,)) for key, item in value.items()}
    if type(value) is list:
        items = [_restore(item, path + (index,)) for index, item in enumerate(value)]
        return tuple(items) if _matches(path, TUPLE_PATHS) else items
    return value
