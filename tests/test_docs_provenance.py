"""Every number in the docs names where it came from (benchmarks/results/README.md, "Provenance").

- Every results file under ``benchmarks/results/`` (JSON, gzipped JSON, or text whose first line is
  ``# provenance: <JSON>``) holds the fields of ``deft_compile.tools.provenance.FIELDS``; a file whose provenance
  was reconstructed after the run says how in ``recovered``. Besides results files the folder holds only
  ``README.md`` files and PNGs.
- Every table of measurements in ``README.md`` and ``docs/*.md`` has, right above it (blank lines between
  allowed), a paragraph of lines ``Measured: `<command>` at `<commit>` (<tree>), <date>, <machine>; results:
  `<file>`.`` (``Computed:`` for numbers a deterministic program computes, such as the simulator's). Each line's
  results files exist under ``benchmarks/results/`` and record that command and commit.
- A table is a table of measurements when a body cell past its first column, emphasis removed and code spans
  excepted, starts with a number that has a decimal point, a unit (``%``, ``x``, ``×``, ``ms``, ``s``, ``min``,
  ``MiB``, ``GiB``, ``KiB``, ``MB``, ``GB``, ``mbit``, ``gbit``) or a spread in brackets right after it
  (``0.88``, ``45 (44-47)``, ``152 [135-160]``, ``12.8 s``, ``−0.33``); or when a column is headed ``result``,
  ``results``, ``figures`` or ``measured``. Other tables (options and defaults, what a variant runs, targets
  such as ``at least 1.25x sooner``) define rather than measure and need no line.
- Every script that writes a results file records ``provenance(...)`` in it.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from deft_compile.tools import provenance as prov

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_LEAD = r"[\s~≈<>≤≥+\-−]*"
_NUMBER = re.compile(_LEAD + r"\d[\d,]*(?P<decimal>\.\d+)?")
_UNIT = re.compile(_LEAD + r"\d[\d,]*(\.\d+)?\s*(%|×|x\b|ms\b|s\b|min\b|MiB\b|GiB\b|KiB\b|MB\b|GB\b|mbit\b|gbit\b)")
_SPREAD = re.compile(_LEAD + r"\d[\d,]*\s*[(\[]\s*[\d.]")
MEASURED_HEADERS = {"result", "results", "figures", "measured"}
LINE = re.compile(r"^(Measured|Computed): `(?P<command>[^`]+)` at `(?P<commit>[0-9a-f]{7,40})` \((?P<tree>[^)]*)\), "
                  r"(?P<rest>.+)$")
RESULT_PATH = re.compile(r"benchmarks/results/[^`\s)\]]+")


# -- the rule, and its parsing -----------------------------------------------------------------------------------


def measured_cell(cell: str) -> bool:
    """Whether a table cell holds a measurement (module docstring): a number with a decimal point, a unit or a
    spread at its start, outside code spans."""
    text = cell.strip().replace("*", "").replace("_", "")
    if text.startswith("`"):
        return False
    number = _NUMBER.match(text)
    return bool(number) and bool(number.group("decimal") or _UNIT.match(text) or _SPREAD.match(text))


@dataclass
class Table:
    doc: Path
    line: int  # 1-based line of the header row
    header: list[str]
    rows: list[list[str]]
    above: list[str]  # the paragraph right above the table (blank lines between skipped)

    @property
    def name(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line} (table headed {' | '.join(self.header)[:70]!r})"

    def measures(self) -> bool:
        return (any(h.strip().strip("*").lower() in MEASURED_HEADERS for h in self.header)
                or any(measured_cell(cell) for row in self.rows for cell in row[1:]))


def _cells(row: str) -> list[str]:
    return [cell.strip() for cell in row.strip().strip("|").split("|")]


def tables(doc: Path) -> list[Table]:
    lines = doc.read_text().split("\n")
    found, fenced, index = [], False, 0
    while index < len(lines):
        line = lines[index]
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif (not fenced and line.startswith("|") and index + 1 < len(lines)
              and re.match(r"^\|\s*:?-{3,}", lines[index + 1])):
            end = index + 2
            while end < len(lines) and lines[end].startswith("|"):
                end += 1
            above, up = [], index - 1
            while up >= 0 and not lines[up].strip():
                up -= 1
            while up >= 0 and lines[up].strip() and not lines[up].startswith("|"):
                above.insert(0, lines[up])
                up -= 1
            found.append(Table(doc, index + 1, _cells(line), [_cells(r) for r in lines[index + 2:end]], above))
            index = end
            continue
        index += 1
    return found


def provenance_lines(table: Table) -> list[str]:
    return [line.strip() for line in table.above if line.startswith(("Measured:", "Computed:"))]


def line_problems(line: str) -> list[str]:
    """What is wrong with one ``Measured:`` line: its form, and its results files against it."""
    match = LINE.match(line)
    if not match:
        return ["not of the form Measured: `<command>` at `<commit>` (<tree>), <date>, <machine>; results: "
                "`<file>`."]
    problems = []
    if not re.search(r"\d{4}-\d{2}-\d{2}", match["rest"]):
        problems.append("names no date (YYYY-MM-DD)")
    if "results:" not in match["rest"]:
        problems.append("names no results file ('results: `benchmarks/results/...`')")
    files = RESULT_PATH.findall(match["rest"].split("results:", 1)[-1])
    if not files:
        problems.append("names no file under benchmarks/results/")
    for name in files:
        path = ROOT / name
        recorded = prov.read(path) if path.is_file() else None
        if recorded is None:
            problems.append(f"{name}: no such results file with provenance")
            continue
        if not str(recorded.get("commit") or "").startswith(match["commit"]):
            problems.append(f"{name} records commit {str(recorded.get('commit'))[:10]}, the line names "
                            f"{match['commit']}")
        if recorded.get("command") != match["command"]:
            problems.append(f"{name} records the command {recorded.get('command')!r}, the line names "
                            f"{match['command']!r}")
    return problems


def provenance_problems(recorded: object) -> list[str]:
    """What a results file's provenance lacks (module docstring)."""
    if not isinstance(recorded, dict):
        return ["no provenance (the key 'provenance', or a first line '# provenance: <JSON>' in a text file)"]
    problems = [f"lacks {field!r}" for field in prov.FIELDS if field not in recorded]
    if not isinstance(recorded.get("command"), str) or not recorded.get("command"):
        problems.append("no command")
    if not re.fullmatch(r"[0-9a-f]{7,40}", str(recorded.get("commit"))):
        problems.append(f"commit {recorded.get('commit')!r} is not a git hash")
    if not re.match(r"\d{4}-\d{2}-\d{2}", str(recorded.get("date"))):
        problems.append(f"date {recorded.get('date')!r} is not YYYY-MM-DD...")
    if not isinstance(recorded.get("emulate_accelerator"), bool):
        problems.append("emulate_accelerator is not true or false")
    if not isinstance(recorded.get("machine"), dict):
        problems.append("machine is not an object")
    if "recovered" in recorded:
        if not isinstance(recorded["recovered"], str) or not recorded["recovered"]:
            problems.append("'recovered' does not say how the fields were found")
    else:  # written by deft_compile.tools.provenance at the run
        if not isinstance(recorded.get("clean"), bool):
            problems.append("clean is not true or false")
        if not isinstance(recorded.get("torch"), str) or not isinstance(recorded.get("python"), str):
            problems.append("torch or python version missing")
        if not (recorded.get("machine") or {}).get("cores"):
            problems.append("machine names no cores")
    return problems


# -- the repository's docs and results ---------------------------------------------------------------------------


def _results_files() -> list[Path]:
    return sorted(p for p in RESULTS.rglob("*") if p.is_file())


def test_every_results_file_records_its_provenance() -> None:
    problems = []
    for path in _results_files():
        name = path.relative_to(ROOT)
        if path.name == "README.md" or path.suffix == ".png":
            continue
        if not (path.name.endswith((".json", ".json.gz", ".txt"))):
            problems.append(f"{name}: not a results file (JSON, .json.gz or text with a provenance line), a README "
                            "or a PNG")
            continue
        problems += [f"{name}: {problem}" for problem in provenance_problems(prov.read(path))]
    assert not problems, "results files without their provenance:\n" + "\n".join(problems)


def test_every_table_of_measurements_names_its_command_commit_and_results() -> None:
    problems = []
    for doc in DOCS:
        for table in tables(doc):
            if not table.measures():
                continue
            lines = provenance_lines(table)
            if not lines:
                problems.append(f"{table.name}: no 'Measured: `<command>` at `<commit>` ...; results: `<file>`.' "
                                "line right above it")
            for line in lines:
                problems += [f"{table.name}: {problem}" for problem in line_problems(line)]
    assert not problems, "tables of measurements without their provenance:\n" + "\n".join(problems)


def test_recorded_commits_are_in_the_history() -> None:
    if subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--is-shallow-repository"], capture_output=True,
                      text=True).stdout.strip() != "false":
        pytest.skip("not a full git checkout: recorded commits cannot be looked up")
    missing = []
    for path in _results_files():
        recorded = prov.read(path)
        if recorded and recorded.get("commit"):
            found = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{recorded['commit']}^{{commit}}"],
                                   capture_output=True)
            if found.returncode:
                missing.append(f"{path.relative_to(ROOT)}: {recorded['commit']}")
    assert not missing, "commits not in this repository's history:\n" + "\n".join(missing)


def test_every_script_that_writes_results_records_provenance() -> None:
    writes_json = re.compile(r"json\.dump\(|write_text\(json\.dumps\(|write_json\(")
    scripts = sorted((ROOT / "benchmarks").glob("*.py")) + [ROOT / "deft_compile" / "tools" / f"{name}.py" for name in
                                                             ("bench", "demo", "simulate", "explain")]
    silent = [str(p.relative_to(ROOT)) for p in scripts
              if writes_json.search(p.read_text()) and "provenance(" not in p.read_text()]
    assert not silent, f"scripts that write results files without their provenance: {silent}"


# -- the rule and the helper, on made-up input -------------------------------------------------------------------


def test_which_cells_are_measurements() -> None:
    for cell in ("0.88", "45 (44-47)", "152 [135-160]", "**45 %** [42-48]", "12.8 s", "−0.33", "1.02x",
                 "580mbit (0.89)", "2.6e-3"):
        assert measured_cell(cell), cell
    for cell in ("25", "`0.0`", "True", "at least 1.25x sooner", "2 of 3 (fc1)", "`wfbp`", "bit-identical", ""):
        assert not measured_cell(cell), cell


def test_a_table_needs_a_line_that_matches_its_results_file(tmp_path: Path, monkeypatch) -> None:
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    made = prov.provenance(command="python benchmarks/x.py --fast")
    record = {"provenance": {**made, "commit": "abcdef0" * 5 + "12345"}}
    (results / "x.json").write_text(json.dumps(record))
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    doc = tmp_path / "doc.md"
    line = prov.measured_line(record["provenance"], "benchmarks/results/x.json")
    doc.write_text(f"# t\n\n{line}\n\n| model | step ms |\n| --- | --- |\n| a | 45 (44-47) |\n\n"
                   "| option | default |\n| --- | --- |\n| `x` | 25 |\n")
    measured, options = tables(doc)
    assert measured.measures() and not options.measures()
    assert provenance_lines(measured) == [line] and line_problems(line) == []
    assert any("records commit" in p for p in line_problems(line.replace("abcdef0", "1234567", 1)))
    assert any("records the command" in p for p in line_problems(line.replace("--fast", "--slow")))
    assert any("no such results file" in p for p in line_problems(line.replace("x.json", "y.json")))
    assert line_problems("Measured: 45 ms on my laptop.")


def test_provenance_of_a_run_now() -> None:
    recorded = prov.provenance(command="python benchmarks/x.py")
    assert provenance_problems(recorded) == []
    assert set(prov.FIELDS) <= set(recorded) and "recovered" not in recorded
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:
        assert recorded["commit"] == head.stdout.strip()
        assert recorded["clean"] == (not recorded["changed"])
    assert prov.command_line([str(ROOT / "benchmarks" / "suite.py"), "--quick"]) == "python benchmarks/suite.py --quick"
    assert prov.command_line(["/venv/bin/deft-compile", "demo", "--out", "a b"]) == "deft-compile demo --out 'a b'"
    assert provenance_problems({"command": "x"}) and provenance_problems(None)


def test_text_results_carry_their_provenance_on_the_first_line(tmp_path: Path) -> None:
    recorded = prov.provenance(command="python benchmarks/refit_closed_loop.py r.json")
    path = tmp_path / "fit.txt"
    path.write_text(prov.TEXT_PREFIX + json.dumps(recorded) + "\nPRIOR_WEIGHT = 8e-4\n")
    assert prov.read(path) == recorded
    path.write_text("PRIOR_WEIGHT = 8e-4\n")
    assert prov.read(path) is None
