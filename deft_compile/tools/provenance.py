"""Provenance of a results file: what ran, from which code, on what machine, when.

Every script that writes a results file (``benchmarks/*.py``, ``deft-compile bench``, ``deft-compile demo``)
stores ``provenance(command=...)`` under the file's top-level key ``"provenance"``. Its fields (``FIELDS``):

- ``command``: the command line as run;
- ``commit``: the checkout's ``HEAD`` (full hash; None outside a git checkout);
- ``clean``: whether no tracked file differed from that commit (untracked files are not looked at), and
  ``changed``: the tracked files that did (at most ``MAX_CHANGED``), so a run from a dirty tree says from what;
- ``date``: UTC, ISO 8601;
- ``machine``: ``cores`` (``os.cpu_count()``), ``cpu`` (the model name), ``host``, ``platform``, ``accelerator``
  (the GPU's name where one is visible without initialising CUDA, else None);
- ``torch`` and ``python``: their versions;
- ``emulate_accelerator``: whether ``DEFT_EMULATE_ACCELERATOR`` put compute and communication threads on separate
  cores (``deft_compile.tools.emulation``).

A file whose provenance was reconstructed after the run (from git history and the docs that cite it) carries
``recovered``: how each field was found; fields that could not be found are None.

``measured_line`` renders the line a docs table of those numbers carries right above it
(benchmarks/results/README.md, "Provenance"; ``tests/test_docs_provenance.py`` checks both).
Nothing here raises: a field that cannot be read is None.
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

FIELDS = ("command", "commit", "clean", "changed", "date", "machine", "torch", "python", "emulate_accelerator")
MAX_CHANGED = 50
ROOT = Path(__file__).resolve().parents[2]


def command_line(argv: Sequence[str] | None = None) -> str:
    """``argv`` (default ``sys.argv``) as a shell command: a script as ``python <path> ...``, a console script
    (``deft-compile``) by its name."""
    argv = list(sys.argv if argv is None else argv)
    if not argv:
        return "python"
    head = argv[0]
    if head.endswith(".py"):
        return shlex.join(["python", relative_path(head), *argv[1:]])
    return shlex.join([Path(head).name or head, *argv[1:]])


def script_command(script: str | os.PathLike, argv: Sequence[str] | None = None) -> str:
    """The command that runs ``script`` (a path, such as a benchmark's ``__file__``) with ``argv`` (default: this
    process's arguments), as ``command_line`` writes it."""
    return command_line([str(script), *(sys.argv[1:] if argv is None else argv)])


def _git(*args: str, root: Path) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def git_state(root: Path | None = None) -> dict[str, Any]:
    """``commit``, ``clean`` and ``changed`` of the checkout at ``root`` (default: the one this package is in)."""
    root = ROOT if root is None else Path(root)
    head = _git("rev-parse", "HEAD", root=root)
    if head is None:
        return {"commit": None, "clean": None, "changed": None}
    status = _git("status", "--porcelain", "--untracked-files=no", root=root)
    changed = None if status is None else sorted({line[3:].strip() for line in status.splitlines() if line.strip()})
    return {"commit": head.strip(), "clean": None if changed is None else not changed,
            "changed": None if changed is None else changed[:MAX_CHANGED]}


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "hardware", "cpu model")):
                return line.split(":", 1)[1].strip() or None
    except OSError:
        pass
    return platform.processor() or None


def _accelerator() -> str | None:
    """The GPU's name, read without initialising CUDA (a forking benchmark must not): the NVIDIA driver's
    ``/proc`` entry, or the current device where CUDA is already initialised."""
    try:
        for info in sorted(Path("/proc/driver/nvidia/gpus").glob("*/information")):
            for line in info.read_text().splitlines():
                if line.startswith("Model:"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_initialized():
            return torch.cuda.get_device_name()
    except Exception:  # noqa: BLE001 - provenance never fails a run
        pass
    return None


def machine() -> dict[str, Any]:
    return {"cores": os.cpu_count(), "cpu": _cpu_model(), "host": platform.node() or None,
            "platform": platform.platform(), "accelerator": _accelerator()}


def _torch_version() -> str | None:
    try:
        import torch
    except ImportError:
        return None
    return str(torch.__version__)


def provenance(command: str | Sequence[str] | None = None, *, root: Path | None = None) -> dict[str, Any]:
    """The provenance of a results file written now (module docstring): ``command`` as run (a string, or an argv
    list; default ``sys.argv``)."""
    from deft_compile.tools import emulation

    if command is None or not isinstance(command, str):
        command = command_line(command)
    return {"command": command, **git_state(root),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "machine": machine(), "torch": _torch_version(), "python": platform.python_version(),
            "emulate_accelerator": emulation.enabled()}


def describe_machine(prov: dict[str, Any]) -> str:
    """``machine``, ``torch`` and the emulation flag in a few words."""
    box = prov.get("machine") or {}
    parts = []
    if box.get("accelerator"):
        parts.append(str(box["accelerator"]))
    if box.get("cores"):
        parts.append(f"{box['cores']} cores" + (f" ({box['cpu']})" if box.get("cpu") else ""))
    if prov.get("torch"):
        parts.append(f"torch {prov['torch']}")
    if prov.get("emulate_accelerator") is not None:
        parts.append("accelerator emulation " + ("on" if prov["emulate_accelerator"] else "off"))
    return ", ".join(parts) or "machine not recorded"


def measured_line(prov: dict[str, Any], results: Sequence[str] | str, *, verb: str = "Measured") -> str:
    """The line a docs table carries right above it: command, commit (and the tree's state), date, machine and
    the results files (repository-relative paths) its numbers come from."""
    results = [results] if isinstance(results, str) else list(results)
    commit = (prov.get("commit") or "unknown")[:7]
    clean = prov.get("clean")
    tree = {True: "clean tree", False: "uncommitted changes"}.get(clean, "tree state not recorded")
    if prov.get("recovered"):
        tree += ", provenance recovered"
    date = str(prov.get("date") or "date not recorded")
    if len(date) == 20 and date.endswith("Z"):  # what ``provenance`` writes: minutes are enough here
        date = date[:16].replace("T", " ") + " UTC"
    files = ", ".join(f"`{path}`" for path in results)
    return f"{verb}: `{prov.get('command')}` at `{commit}` ({tree}), {date}, {describe_machine(prov)}; results: {files}."


def relative_path(path: str | os.PathLike, root: Path | None = None) -> str:
    """``path`` relative to the repository root when it is inside it (as docs name results files), else as
    given."""
    root = ROOT if root is None else Path(root)
    try:
        return Path(path).resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return str(path)


TEXT_PREFIX = "# provenance: "


def read(path: str | os.PathLike) -> dict[str, Any] | None:
    """The provenance stored in a results file: the ``"provenance"`` key of a JSON object (``.json``,
    ``.json.gz``), or the first line of a text file, ``# provenance: <JSON>``; None when it has none."""
    import gzip
    import json

    path = Path(path)
    try:
        if path.name.endswith(".json.gz"):
            data = json.loads(gzip.decompress(path.read_bytes()))
        elif path.suffix == ".json":
            data = json.loads(path.read_text())
        else:
            first = path.read_text().split("\n", 1)[0]
            data = {"provenance": json.loads(first[len(TEXT_PREFIX):])} if first.startswith(TEXT_PREFIX) else {}
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    prov = data.get("provenance") if isinstance(data, dict) else None
    return prov if isinstance(prov, dict) else None
