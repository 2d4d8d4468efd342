"""Every number in the docs names where it came from (benchmarks/results/README.md, "Provenance").

- Every results file under ``benchmarks/results/`` (JSON, gzipped JSON, or text whose first line is
  ``# provenance: <JSON>``) holds the fields of ``deft_compile.tools.provenance.FIELDS``; a file whose provenance
  was reconstructed after the run says how in ``recovered``. Besides results files the folder holds only
  ``README.md`` files and PNGs.
- Every table of measurements in ``docs/*.md`` and ``README.md`` (but the README's summary) has, right above it
  (blank lines between allowed), a paragraph of lines ``Measured: `<command>` at `<commit>` (<tree>), <date>,
  <machine>; results: `<file>`.`` (``Computed:`` for numbers a deterministic program computes, such as the
  simulator's). Each line's results files exist under ``benchmarks/results/`` and record that command and commit.
- A table is a table of measurements when a body cell past its first column, emphasis removed and code spans
  excepted, starts with a number that has a decimal point, a unit (``%``, ``x``, ``×``, ``ms``, ``s``, ``min``,
  ``MiB``, ``GiB``, ``KiB``, ``MB``, ``GB``, ``mbit``, ``gbit``) or a spread in brackets right after it
  (``0.88``, ``45 (44-47)``, ``152 [135-160]``, ``12.8 s``, ``−0.33``); or when a column is headed ``result``,
  ``results``, ``figures`` or ``measured``. Other tables (options and defaults, what a variant runs, targets
  such as ``at least 1.25x sooner``) define rather than measure and need no line.
- Every script that writes a results file records ``provenance(...)`` in it.
- ``README.md``'s "What to expect" is a table of question | measured answer | links, with no ``Measured:`` lines
  above it: each row's last cell links the results files behind it and the doc sections (``docs/<doc>.md#<anchor>``)
  whose ``Measured:`` line names each of those files. Each results file records its command, commit and date, and
  every number in the row's other cells appears in one of its results files' data or in a linked section beside
  the line that names that file (``row_problems``, ``beside_provenance``); a row without links says "not
  measured". The README holds at most
  ``README_MAX_LINES`` lines.
"""

from __future__ import annotations

import functools
import gzip
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
README_MAX_LINES = 160
SUMMARY_HEADING = "## What to expect"
_LINK = re.compile(r"\[([^\]]*)\]\(([^)\s]+)\)")
_DIGITS = re.compile(r"\d+(?:\.\d+)?(?:e[-−+]?\d+)?")


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


def read_provenance(path: Path) -> dict | None:
    """``prov.read(path)``, kept while the file stays as it is (the tests ask for the same files many times)."""
    return _read_provenance(_state(path)) if path.is_file() else None


@functools.lru_cache(maxsize=None)
def _read_provenance(state: tuple[str, int, int]) -> dict | None:
    return prov.read(state[0])


def _state(path: Path) -> tuple[str, int, int]:
    """A file's path, modification time and size: the key its cached readings are kept under."""
    stat = path.stat()
    return str(path), stat.st_mtime_ns, stat.st_size


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
        recorded = read_provenance(path)
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


# -- the README's summary: every number through its links to a results file and a doc section ---------------------


def what_to_expect(readme: Path) -> tuple[list[str], Table | None]:
    """The lines of the README's "What to expect" above its table, and the table (None if it has none)."""
    lines = readme.read_text().split("\n")
    if SUMMARY_HEADING not in lines:
        return [], None
    start = lines.index(SUMMARY_HEADING) + 1
    found = [table for table in tables(readme) if table.line > start]
    if not found or any(line.startswith("#") for line in lines[start:found[0].line - 1]):
        return lines[start:], None
    return lines[start:found[0].line - 1], found[0]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def sections(doc: Path) -> dict[str, str]:
    """Each heading's anchor and its section: the text up to the next heading of any level (code fences
    skipped); a repeated anchor gets GitHub's ``-1``, ``-2``... suffix."""
    found: dict[str, list[str]] = {}
    current, fenced = None, False
    for line in doc.read_text().split("\n"):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        heading = None if fenced else re.match(r"^#{1,6} (.+)$", line)
        if heading:
            base = current = slug(heading.group(1))
            suffix = 0
            while current in found:
                suffix += 1
                current = f"{base}-{suffix}"
            found[current] = []
        elif current is not None:
            found[current].append(line)
    return {anchor: "\n".join(body) for anchor, body in found.items()}


@functools.lru_cache(maxsize=None)
def beside_provenance(section: str) -> dict[str, list[str]]:
    """For each results file that a valid ``Measured:`` line of ``section`` names, the text next to that line:
    the paragraph above the line's paragraph, the line's paragraph, the table right below it and the paragraph
    after that table (where the caption and notes of the numbers stand)."""
    paragraphs = [block for block in re.split(r"\n\s*\n", section) if block.strip()]

    def named_by(block: str) -> set[str]:
        return {name for line in block.split("\n") if line.startswith(("Measured:", "Computed:"))
                and not line_problems(line) for name in RESULT_PATH.findall(line.split("results:", 1)[-1])}

    def is_table(block: str) -> bool:
        return block.lstrip().startswith("|")

    found: dict[str, list[str]] = {}
    for index, block in enumerate(paragraphs):
        names = named_by(block)
        if not names:
            continue
        near = [block]
        if index > 0 and not is_table(paragraphs[index - 1]) and not named_by(paragraphs[index - 1]):
            near.insert(0, paragraphs[index - 1])
        if index + 1 < len(paragraphs) and is_table(paragraphs[index + 1]):
            near.append(paragraphs[index + 1])
            after = paragraphs[index + 2] if index + 2 < len(paragraphs) else ""
            if after and not is_table(after) and not named_by(after):
                near.append(after)
        for name in names:
            found.setdefault(name, []).append("\n\n".join(near))
    return found


def numbers(text: str) -> list[str]:
    """The numbers a text states, as written (``1.17``, ``+2.91``, ``2.1e-07``, ``56.4`` of ``48.4-56.4``): a
    sign counts where it follows a space or bracket; digits inside names (``GPT-2``, ``H200``) and link targets
    are not numbers."""
    text = _LINK.sub(lambda link: link.group(1), text)
    found = []
    for match in _DIGITS.finditer(text):
        start = match.start()
        before = text[start - 1] if start else " "
        sign = ""
        if before in "+-−":
            prior = text[start - 2] if start >= 2 else " "
            if prior.isalpha() or prior in "_.":
                continue  # GPT-2: part of a name
            if not prior.isdigit():  # 48.4-56.4: a range, unsigned
                sign = "+" if before == "+" else "-"
        elif before.isalnum() or before in "_.":
            continue
        found.append(sign + match.group().replace("−", "-"))
    return found


def data_numbers(path: Path) -> tuple[frozenset[float], frozenset[str]]:
    """A results file's data (its provenance left out): the numeric values, and the numbers its strings state."""
    return _data_numbers(_state(path))


@functools.lru_cache(maxsize=None)
def _data_numbers(state: tuple[str, int, int]) -> tuple[frozenset[float], frozenset[str]]:
    path = Path(state[0])
    raw = gzip.decompress(path.read_bytes()) if path.name.endswith(".gz") else path.read_bytes()
    try:
        data = json.loads(raw)
    except ValueError:
        return frozenset(), frozenset(numbers(raw.decode(errors="replace")))
    values: set[float] = set()
    stated: set[str] = set()
    stack = [{k: v for k, v in data.items() if k != "provenance"} if isinstance(data, dict) else data]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str):
            stated.update(numbers(item))
        elif isinstance(item, (int, float)) and not isinstance(item, bool):
            values.add(float(item))
    return frozenset(values), frozenset(stated)


def _in_data(number: str, path: Path) -> bool:
    values, stated = data_numbers(path)
    return number in stated or float(number) in values


def row_problems(row: list[str], root: Path | None = None) -> list[str]:
    """What is wrong with one row of the README's summary (module docstring): its links, the provenance of the
    results files they name, and each number of the row's other cells against those files and sections."""
    root = ROOT if root is None else root
    *cells, sources = row
    stated = [number for cell in cells for number in numbers(cell)]
    links = [target for _, target in _LINK.findall(sources)]
    results = [target for target in links if target.startswith("benchmarks/results/")]
    doc_links = [target for target in links if target.startswith("docs/")]
    problems = [f"link {target!r} is neither a results file (benchmarks/results/...) nor a doc section (docs/...)"
                for target in links if target not in results and target not in doc_links]
    if not links:
        if stated and not cells[-1].strip().lower().startswith("not measured"):
            problems.append(f"states {', '.join(stated)} with no link to a results file and doc section")
        return problems
    if not results or not doc_links:
        problems.append("links no results file or no doc section: a row needs both")
    recorded_ok = []
    for target in results:
        path = root / target
        recorded = read_provenance(path)
        if recorded is None:
            problems.append(f"{target}: no such results file with provenance")
            continue
        missing = [field for field in ("command", "commit", "date") if not recorded.get(field)]
        problems += [f"{target}: records no {field}" for field in missing]
        problems += [f"{target}: {problem}" for problem in provenance_problems(recorded)]
        if not missing:
            recorded_ok.append(target)
    backed: dict[str, list[str]] = {target: [] for target in recorded_ok}  # results file -> sections naming it
    for target in doc_links:
        name, _, anchor = target.partition("#")
        doc = root / name
        if not name.endswith(".md") or not doc.is_file() or not anchor:
            problems.append(f"{target}: not a section of a doc under docs/ (docs/<doc>.md#<anchor>)")
            continue
        section = sections(doc).get(anchor)
        if section is None:
            problems.append(f"{target}: {name} has no heading with the anchor #{anchor}")
            continue
        blocks = beside_provenance(section)
        if not set(blocks) & set(results):
            problems.append(f"{target}: the section has no Measured: line (matching its results file) naming "
                            f"any of {', '.join(results)}")
        for result in set(blocks) & set(backed):
            backed[result] += blocks[result]
    for target, found in backed.items():
        if not found:
            problems.append(f"{target}: no linked doc section has a Measured: line naming it")
    for number in stated:
        if not any(_in_data(number, root / target) or any(number in numbers(section) for section in found)
                   for target, found in backed.items()):
            problems.append(f"{number}: neither in the data of {', '.join(results) or 'a results file'} nor in a "
                            "linked section next to that file's Measured: line")
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
    summary = what_to_expect(ROOT / "README.md")[1]
    for doc in DOCS:
        for table in tables(doc):
            if not table.measures() or (summary and (doc, table.line) == (summary.doc, summary.line)):
                continue  # the README's summary is checked through its links (row_problems)
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


def test_the_readme_is_short_and_its_summary_has_no_provenance_lines_above_it() -> None:
    lines = (ROOT / "README.md").read_text().split("\n")
    length = len(lines) - (lines[-1] == "")
    assert length <= README_MAX_LINES, f"README.md has {length} lines, at most {README_MAX_LINES}"
    above, table = what_to_expect(ROOT / "README.md")
    assert table is not None, f"README.md has no table under {SUMMARY_HEADING!r}"
    assert not [line for line in above if line.startswith(("Measured:", "Computed:"))], (
        "the README's summary names its results through its links; its Measured: lines belong in the linked docs")


def test_every_number_of_the_readme_summary_comes_from_a_results_file() -> None:
    table = what_to_expect(ROOT / "README.md")[1]
    assert table is not None and table.rows
    problems = [f"README.md:{table.line + 2 + index} ({row[0][:50]!r}): {problem}"
                for index, row in enumerate(table.rows) for problem in row_problems(row)]
    assert not problems, "the README's summary against its results files:\n" + "\n".join(problems)


def _edited(number: str, step: int) -> str:
    """``number`` with its last digit moved by ``step`` (mod 10), as a hand edit would."""
    return f"{number[:-1]}{(int(number[-1]) + step) % 10}"


def _replace_number(cell: str, number: str, edit: str) -> str:
    bare = number.lstrip("+-")
    copy = re.sub(r"(?<![\d.])" + re.escape(bare) + r"(?![\d])", edit.lstrip("+-"), cell, count=1)
    assert copy != cell, (number, cell)
    return copy


def _row_backing(row: list[str]) -> tuple[set[str], list[Path]]:
    """What the row's links back, gathered apart from ``row_problems``: the numbers beside each linked section's
    Measured: lines, and the linked results files."""
    targets = [target for _, target in _LINK.findall(row[-1])]
    files = [ROOT / target for target in targets if target.startswith("benchmarks/results/")]
    beside: set[str] = set()
    for target in targets:
        if target.startswith("docs/"):
            name, _, anchor = target.partition("#")
            for blocks in beside_provenance(sections(ROOT / name)[anchor]).values():
                beside.update(number for block in blocks for number in numbers(block))
    return beside, files


def test_a_hand_edited_number_or_a_broken_link_fails_the_summary_check() -> None:
    """Each row's copy with a link broken fails; so does each copy with a number's last digit edited to a value
    that neither its results files nor the text beside their Measured: lines hold (numbers of one digit are
    left out: every digit stands somewhere in a results file)."""
    table = what_to_expect(ROOT / "README.md")[1]
    assert table is not None
    caught = 0
    for row in table.rows:
        links = _LINK.findall(row[-1])
        if not links:
            continue
        for _, target in links:
            broken = target.replace("#", "#no-such-") if "#" in target else target.replace(".json", "-missing.json")
            assert row_problems([*row[:-1], row[-1].replace(f"({target})", f"({broken})")]), (row[0], broken)
        beside, files = _row_backing(row)
        for column, cell in enumerate(row[:-1]):
            for number in dict.fromkeys(n for n in numbers(cell) if len(n.lstrip("+-")) > 1):
                absent = [edit for edit in (_edited(number, step) for step in range(1, 10))
                          if edit not in beside and not any(_in_data(edit, path) for path in files)]
                assert absent, f"every edit of {number} ({row[0][:40]!r}) stands beside its provenance"
                for edit in absent:
                    copy = list(row)
                    copy[column] = _replace_number(cell, number, edit)
                    assert any(edit in problem for problem in row_problems(copy)), (row[0][:40], number, edit)
                    caught += 1
    assert caught >= 50, caught


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


def test_a_summary_row_is_checked_through_its_links(tmp_path: Path, monkeypatch) -> None:
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    (tmp_path / "docs").mkdir()
    # a fixed date and commit: the edited numbers below must not turn up in the Measured: line by the clock's chance
    made = {**prov.provenance(command="python benchmarks/x.py --fast"), "date": "2026-01-01T00:00:00Z",
            "commit": "0" * 40}
    record = {"provenance": made, "rows": {"a": {"step_ms": 45.25, "note": "1.5 s of compile"}}}
    (results / "x.json").write_text(json.dumps(record))
    undated = {"provenance": {**made, "date": None}, "rows": {}}
    (results / "undated.json").write_text(json.dumps(undated))
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    line = prov.measured_line(made, "benchmarks/results/x.json")
    (tmp_path / "docs" / "D.md").write_text(
        f"# D\n\n## Step times\n\nModel `a`, 120 steps.\n\n{line}\n\n| model | step ms |\n| --- | --- |\n"
        f"| a | 45 (44-47) |\n\nAgainst DDP: 1.05x.\n\nLater prose, 77.7.\n\n## Other\n\n99.9 %\n")
    source = "[x](benchmarks/results/x.json); [table](docs/D.md#step-times)"
    good = ["How fast is a step? (120 steps)", "45 ms [44-47], 1.05x; 1.5 s compiling; 45.25 in the data", source]
    assert row_problems(good, tmp_path) == []

    def fails(row: list[str], words: str) -> bool:
        return any(words in problem for problem in row_problems(row, tmp_path))

    assert fails([good[0], good[1].replace("1.05x", "1.06x"), source], "1.06: neither")
    assert fails([good[0], good[1].replace("45 ms", "46 ms"), source], "46: neither")
    assert fails([good[0], good[1] + "; 77.7", source], "77.7: neither")  # not beside the Measured: line
    assert fails([good[0], good[1] + "; 99.9 %", source], "99.9: neither")  # another section
    assert fails([good[0], good[1], source.replace("#step-times", "#step-time")], "no heading with the anchor")
    assert fails([good[0], good[1], source.replace("x.json", "y.json")], "no such results file")
    assert fails([good[0], good[1], source.split(";")[0]], "no doc section")
    assert fails([good[0], good[1], source.split(";")[1]], "no results file")
    assert fails([good[0], good[1], source.replace("x.json", "undated.json")], "records no date")
    assert fails([good[0], good[1], "[elsewhere](https://example.com/x)"], "neither a results file")
    (tmp_path / "docs" / "E.md").write_text(f"## Step times\n\n{line.replace('--fast', '--slow')}\n\n| a | 45 |\n")
    assert fails([good[0], good[1], source.replace("D.md", "E.md")], "no Measured: line")
    assert row_problems(["At a coverage rate of 3?", "not measured", "-"], tmp_path) == []
    assert fails(["At a coverage rate of 3?", "1.4x", "-"], "with no link")

    readme = tmp_path / "README.md"
    readme.write_text(f"# r\n\n{SUMMARY_HEADING}\n\n{line}\n\n| question | answer | source |\n| --- | --- | --- |\n"
                      f"| {' | '.join(good)} |\n")
    above, table = what_to_expect(readme)
    assert table is not None and table.rows == [good] and line in above


def test_numbers_as_the_rows_state_them() -> None:
    assert numbers("GPT-2 `tiny`: 1.17x, +2.91% and −3.28%, 54.0 s [48.4-56.4], 2.1e-07 on one H200") == [
        "1.17", "+2.91", "-3.28", "54.0", "48.4", "56.4", "2.1e-07"]
    assert numbers("[all parts](benchmarks/results/gpu/h200-all-parts.json), **45 %**") == ["45"]
    assert slug("gpt2 tiny, DDP's coverage rate 2.86 (calibrated to 2)") == (
        "gpt2-tiny-ddps-coverage-rate-286-calibrated-to-2")
    assert slug("The last GPU runs: H200, aten and whole-graph Inductor") == (
        "the-last-gpu-runs-h200-aten-and-whole-graph-inductor")


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
    script = ROOT / "benchmarks" / "time_to_accuracy.py"
    assert prov.script_command(script, ["--docs", ""]) == "python benchmarks/time_to_accuracy.py --docs ''"
    assert prov.script_command(script, []) == "python benchmarks/time_to_accuracy.py"
    assert provenance_problems({"command": "x"}) and provenance_problems(None)


def test_text_results_carry_their_provenance_on_the_first_line(tmp_path: Path) -> None:
    recorded = prov.provenance(command="python benchmarks/refit_closed_loop.py r.json")
    path = tmp_path / "fit.txt"
    path.write_text(prov.TEXT_PREFIX + json.dumps(recorded) + "\nPRIOR_WEIGHT = 8e-4\n")
    assert prov.read(path) == recorded
    path.write_text("PRIOR_WEIGHT = 8e-4\n")
    assert prov.read(path) is None
