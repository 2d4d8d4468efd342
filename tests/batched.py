"""Many small 2-process cases of one test file in one launch: one process pair runs them in turn, and each test
asserts its own case's result.

A test file lists its cases (``Case``: a key, a worker function with its arguments, and the names of the tests that
read it) and reads them through a module-scoped fixture that calls ``launch_cases``. Only the cases a selected test
reads run (``pytest -k``, a single test id). Each rank writes a case's outcome to a file as soon as the case ends, so
a case that raises, hangs past its collective timeout or kills its worker is reported against that case alone, with
every rank's traceback, and the cases after it run again in a new launch. ``outcome(key)`` gives the per-rank
values of a case that ran, or fails the test with the case's own failure; ``outcome.errors(key)`` gives the per-rank
tracebacks of a case that must fail (a refusal that raises in the worker), and fails the test if it ran through.

Cases run in the order listed, each from a fresh model, optimizer and seed as its worker function makes them;
cases that need a different process environment (``Case.env``) run in a launch of their own.
"""

from __future__ import annotations

import pickle
import shutil
import tempfile
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest


@dataclass(frozen=True)
class Case:
    """One 2-process run: ``fn(rank, world_size, *args)`` in a launch whose workers also get ``env``; ``tests`` are
    the names (``item.name``, with parameters) of the tests that read it."""

    key: Any
    fn: Callable[..., Any]
    args: tuple = ()
    tests: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)


def run_cases(rank: int, world_size: int, calls: list[tuple[Callable[..., Any], tuple]], folder: str) -> int:
    """Worker: run ``calls`` in order, writing each outcome (``(True, value)`` or ``(False, traceback)``) to
    ``folder/<index>.rank<rank>`` as it ends; stop after the first failure (the peer may be left inside a collective of
    that case, so nothing after it would pair up). Returns how many calls ended."""
    for index, (fn, args) in enumerate(calls):
        try:
            outcome = (True, fn(rank, world_size, *args))
        except Exception:  # noqa: BLE001 - reported as this case's failure
            outcome = (False, traceback.format_exc())
        partial = Path(folder) / f"{index}.rank{rank}.tmp"
        partial.write_bytes(pickle.dumps(outcome))
        partial.replace(Path(folder) / f"{index}.rank{rank}")
        if not outcome[0]:
            return index + 1
    return len(calls)


class CaseFailure(AssertionError):
    """A case that did not end with a value on every rank."""


class Outcomes:
    """The outcomes of the cases ``launch_cases`` ran, by key."""

    def __init__(self, values: dict[Any, list[Any]], failures: dict[Any, str],
                 errors: dict[Any, list[str | None]]) -> None:
        self._values, self._failures, self._errors = values, failures, errors

    def __call__(self, key: Any) -> list[Any]:
        """The per-rank values of case ``key``; a case that failed fails the calling test with its tracebacks."""
        if key in self._failures:
            raise CaseFailure(f"case {key!r} failed in its workers:\n{self._failures[key]}")
        if key not in self._values:
            raise KeyError(f"case {key!r} did not run: no selected test names it in Case.tests")
        return self._values[key]

    def errors(self, key: Any) -> list[str | None]:
        """The traceback of case ``key`` on each rank (None where the rank's run ended with a value, or where it
        left no outcome: then its worker's own error is in the message of ``__call__``)."""
        if key in self._values:
            raise CaseFailure(f"case {key!r} ran through on every rank; it was to fail")
        if key not in self._errors:
            raise KeyError(f"case {key!r} did not run: no selected test names it in Case.tests")
        return self._errors[key]


def selected(request: pytest.FixtureRequest, cases: list[Case]) -> list[Case]:
    """The cases that a selected test of the requesting module reads."""
    names = {item.name for item in request.session.items if getattr(item, "module", None) is request.module}
    return [case for case in cases if names & set(case.tests)]


def launch_cases(request: pytest.FixtureRequest, cases: list[Case], *, world_size: int = 2,
                 timeout_s: float = 280.0, collective_timeout_s: float = 60.0) -> Outcomes:
    """Run the selected ``cases`` (``selected``), as few launches as their environments allow."""
    from deft_compile.tools.launcher import run_local_workers

    keys = [case.key for case in cases]
    assert len(set(keys)) == len(keys), f"case keys repeat: {keys}"
    values: dict[Any, list[Any]] = {}
    failures: dict[Any, str] = {}
    errors: dict[Any, list[str | None]] = {}
    by_env: dict[tuple, list[Case]] = {}
    for case in selected(request, cases):
        by_env.setdefault(tuple(sorted(case.env.items())), []).append(case)
    for env, pending in by_env.items():
        while pending:
            folder = tempfile.mkdtemp(prefix="deft-cases-")
            try:
                results = run_local_workers(run_cases, world_size, ([(c.fn, c.args) for c in pending], folder),
                                            timeout_s=timeout_s, collective_timeout_s=collective_timeout_s,
                                            env=dict(env), raise_on_failure=False)
                ended = _collect(pending, results, Path(folder), world_size, values, failures, errors)
            finally:
                shutil.rmtree(folder, ignore_errors=True)
            pending = pending[ended:]
    return Outcomes(values, failures, errors)


def _collect(pending: list[Case], results: list, folder: Path, world_size: int, values: dict,
             failures: dict, errors: dict) -> int:
    """Record the cases of one launch; returns how many of ``pending`` it settled (every case up to and including
    the first that failed on some rank)."""
    for index, case in enumerate(pending):
        outcomes = []
        for rank in range(world_size):
            path = folder / f"{index}.rank{rank}"
            outcomes.append(pickle.loads(path.read_bytes()) if path.exists() else None)
        if all(o is not None and o[0] for o in outcomes):
            values[case.key] = [o[1] for o in outcomes]
            continue
        lines = []
        for rank, o in enumerate(outcomes):
            if o is None:  # the worker died or timed out inside this case
                result = results[rank]
                lines.append(f"--- rank {rank}: no outcome (worker exit code {result.exitcode}) ---\n"
                             f"{result.error or 'the worker ended without reporting this case'}")
            elif not o[0]:
                lines.append(f"--- rank {rank} ---\n{o[1]}")
        failures[case.key] = "\n".join(lines)
        errors[case.key] = [o[1] if o is not None and not o[0] else None for o in outcomes]
        return index + 1
    return len(pending)
