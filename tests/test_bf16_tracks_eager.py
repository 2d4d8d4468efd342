"""A synchronous deft step under bf16 autocast trains as the eager loop does, through the closed loop's trial plans.

The CPU reproduction of ``benchmarks/gpu_check.py``'s accuracy part: a char-level GPT (2 blocks of width 32) under
``torch.autocast("cpu", dtype=torch.bfloat16)``, AdamW, behind the emulated link (rank 0 of two mirrored ranks, so
the averaged gradient is the local one and the eager loop is the exact reference). The step is ``deft`` with a
staleness price that keeps every delay out: its closed loop measures DDP's buckets, then trials ByteScheduler's and
US-Byte's plans (their updates run in the next call, before each layer's forward), and the Preserver recomputes
gradients eagerly for its staleness probes, all inside the caller's autocast. Every plan stays synchronous, so each
training loss must match eager's to bf16 round-off: within 2^-7 relative for each of the first 50 steps (the run
measures its own round-off floor, eager from weights one ulp away, and requires it under the bound), and the final
validation loss within 1 % of eager's, on both sides. The same holds with the plans switched by hand. Run on the
aten route and on the default route (regional Inductor).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
STEPS = 50


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("compiler", ["aten", "inductor"])
def test_synchronous_deft_tracks_eager_under_bf16_through_the_trial_plans(tmp_path: Path, compiler: str) -> None:
    completed = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--device", "cpu", "--parts", "accuracy",
         "--compiler", compiler, "--accuracy-steps", str(STEPS), "--part-budget-s", "840", "--budget-s", "860",
         "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=880, cwd=REPO,
    )
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    (part,) = report["parts"]
    assert part["error"] is None, part["error"]
    checks = {row["check"]: row for row in part["checks"]}
    failed = [row for row in part["checks"] if not row["ok"]]
    assert not failed, json.dumps(failed, indent=1)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    data = part["data"]
    assert data["steps"] == STEPS and data["tracked_steps"] == STEPS and data["ran"] == compiler
    tracked = checks[f"synchronous deft: training loss vs eager, each of the first {STEPS} steps"]["value"]
    assert tracked["worst_relative_gap"] <= 2.0 ** -7 and tracked["first_step_over_bound"] is None
    assert {"bytescheduler", "usbyte"} <= {policy for _, policy in data["plans"]}, data["plans"]
    assert data["probes"], "the Preserver measured no staleness"
    ratio = checks["synchronous deft: final validation loss vs eager"]["value"]["ratio"]
    assert abs(ratio - 1.0) <= 0.01
    assert {"bytescheduler", "usbyte", "wfbp"} <= {policy for _, policy in data["forced_plans"]}
    assert len(data["deft_losses"]) == STEPS and len(data["eager_losses"]) == STEPS
    assert (tmp_path / "accuracy.png").exists()
