"""``benchmarks/overhead.py --presets`` runs end to end, also against a fake two-rank group (DDP's hook returns at
once), and reports a graph that communicates (more nodes than the same model's one-process graph)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / f"overhead{len(extra)}.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "overhead.py"), "--presets", "mlp", "--steps", "2",
                    "--json", str(out), *extra], check=True, cwd=ROOT, timeout=300)
    saved = json.loads(out.read_text())
    assert saved["provenance"]["command"].startswith("python ")  # deft_compile.tools.provenance
    (row,) = saved["rows"]
    assert row["model"] == "mlp" and row["eager_ms"] > 0 and row["compiled_ms"] > 0
    return row


def test_presets_alone_and_against_a_fake_world(tmp_path):
    local = _run(tmp_path)
    fake = _run(tmp_path, "--fake-world", "2")
    assert fake["graph_nodes"] > local["graph_nodes"], "the fake world's graph launches and waits for its buckets"
