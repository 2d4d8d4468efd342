"""benchmarks/gpu_check.py --device cpu: the script a lent GPU runs first, kept working on CPU (tiny models).

Every part runs in its own process, in the order of what is least known: the accuracy run under bf16 (a
synchronous deft step through the closed loop's trial plans against the eager loop), step time against
torch.compile in interleaved rounds, the profiler against torch.profiler (and the plans either profile gives), two
ranks against DDP and the delayed reference, the emulated link's overlap bookkeeping. Each must report its checks,
all passing, and no error, within its budget; the results file carries the run's provenance and is complete.
The accuracy part runs in tests/test_bf16_tracks_eager.py (on the aten route and the default route, with its
plot); this smoke runs the four parts after it, in the script's order.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ORDER = ["step_time", "profiler", "two_ranks", "overlap"]  # the script's order, after "accuracy"


@pytest.mark.slow
@pytest.mark.timeout(900)  # four parts, each its own process, within the run's 480 s
def test_gpu_check_runs_on_cpu(tmp_path: Path) -> None:
    completed = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--device", "cpu", "--parts", ",".join(ORDER),
         "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=900, cwd=REPO,
    )
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [part["part"] for part in report["parts"]] == ORDER, completed.stdout[-3000:]
    for part in report["parts"]:
        assert part["error"] is None, f"{part['part']}: {part['error']}"
        assert part["checks"], f"{part['part']} reported no checks"
        failed = [row for row in part["checks"] if not row["ok"]]
        assert not failed, f"{part['part']}: {failed}"
        assert part["seconds"] <= part["budget_s"] + 5, (part["part"], part["seconds"], part["budget_s"])
    assert report["seconds"] <= report["budget_s"] + 10 and report["budget_s"] == 480
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    assert "4 of 4 parts passed" in completed.stdout
    provenance = report["provenance"]
    assert {"command", "commit", "clean", "date", "machine", "torch"} <= set(provenance)
    assert "gpu_check.py --device cpu" in provenance["command"]
    parts = {part["part"]: part for part in report["parts"]}
    assert {"gpt2-tiny", "resnet-tiny"} <= set(parts["step_time"]["data"])
    assert set(parts["profiler"]["data"]["plans"]) == {"deft", "bytescheduler", "usbyte"}
