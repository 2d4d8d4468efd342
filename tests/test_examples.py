"""examples/train_gpt.py under a real `torchrun --standalone --nproc-per-node 2` (gloo on CPU; about 20 s)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_gpt.py"


def test_train_gpt_under_torchrun(tmp_path):
    torchrun = shutil.which("torchrun")
    launcher = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]
    checkpoint = tmp_path / "ckpt.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    completed = subprocess.run(
        [*launcher, "--standalone", "--nproc-per-node", "2", str(EXAMPLE), "--steps", "3", "--tiny",
         "--checkpoint", str(checkpoint)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env,
    )
    output = completed.stdout + completed.stderr
    assert completed.returncode == 0, output[-4000:]
    assert "world size 2 (gloo)" in completed.stdout
    losses = [float(x) for x in re.findall(r"^step \d+ loss ([0-9.]+)", completed.stdout, re.M)]
    assert len(losses) == 3 and all(0 < x < 10 for x in losses), completed.stdout
    assert re.search(r"final eval loss [0-9.]+", completed.stdout)
    assert checkpoint.exists()
