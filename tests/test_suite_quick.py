"""``benchmarks/suite.py --quick`` runs end to end (tiny models, unshaped, one launch) and writes its table."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_quick_suite_writes_results_and_docs(tmp_path):
    spec = importlib.util.spec_from_file_location("suite", ROOT / "benchmarks" / "suite.py")
    suite = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(suite)
    docs = tmp_path / "BENCHMARKS.md"
    docs.write_text("# Benchmarks\n")
    out = tmp_path / "suite.json"
    assert suite.main(["--quick", "--models", "vgg16-bn-tiny", "--unshaped", "--out", str(out), "--docs", str(docs)]) == 0
    data = json.loads(out.read_text())
    rows = data["results"][0]["aggregate"]
    assert {"floor", "ddp", "wfbp", "deft"} <= set(rows)
    assert all(rows[name]["step_ms"]["median"] > 0 for name in rows)
    text = docs.read_text()
    assert suite.BEGIN in text and "| vgg16-bn-tiny |" in text
    suite.write_docs(data["results"], data["meta"], docs, None)  # regenerating replaces the section
    assert docs.read_text().count(suite.BEGIN) == 1
