"""benchmarks/gpu_check.py --device cpu: the script a lent GPU runs first, kept working on CPU (tiny models).

Every part runs in its own process: the profiler against torch.profiler, one rank through the compilers, two ranks
against DDP and the delayed reference, the emulated link's overlap bookkeeping, and the accuracy run with the
defaults. Each must report its checks, all passing, and no error.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PARTS = {"profiler", "one_rank", "two_ranks", "overlap", "accuracy"}


@pytest.mark.timeout(900)  # five parts, each its own process: about 3 minutes on a quiet 2-core host
def test_gpu_check_runs_on_cpu(tmp_path: Path) -> None:
    completed = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--device", "cpu", "--out", str(tmp_path),
         "--budget-s", "600"],
        capture_output=True, text=True, timeout=900, cwd=REPO,
    )
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert {part["part"] for part in report["parts"]} == PARTS, completed.stdout[-3000:]
    for part in report["parts"]:
        assert part["error"] is None, f"{part['part']}: {part['error']}"
        assert part["checks"], f"{part['part']} reported no checks"
        failed = [row for row in part["checks"] if not row["ok"]]
        assert not failed, f"{part['part']}: {failed}"
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    assert "5 of 5 parts passed" in completed.stdout
    one_rank = next(part for part in report["parts"] if part["part"] == "one_rank")
    assert {"gpt2-tiny", "resnet-tiny"} <= set(one_rank["data"])
    assert (tmp_path / "accuracy.png").exists()
