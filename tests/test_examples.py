"""The examples under a real `torchrun --standalone --nproc-per-node 2` (gloo on CPU)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
EXAMPLE = EXAMPLES / "train_gpt.py"


def _torchrun(tmp_path, script: Path, *args: str) -> subprocess.CompletedProcess:
    torchrun = shutil.which("torchrun")
    launcher = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([*launcher, "--standalone", "--nproc-per-node", "2", str(script), *args],
                          capture_output=True, text=True, timeout=180, cwd=tmp_path, env=env)


def test_train_gpt_under_torchrun(tmp_path):
    checkpoint = tmp_path / "ckpt.pt"
    completed = _torchrun(tmp_path, EXAMPLE, "--steps", "3", "--tiny", "--checkpoint", str(checkpoint))
    output = completed.stdout + completed.stderr
    assert completed.returncode == 0, output[-4000:]
    assert "world size 2 (gloo)" in completed.stdout
    losses = [float(x) for x in re.findall(r"^step \d+ loss ([0-9.]+)", completed.stdout, re.M)]
    assert len(losses) == 3 and all(0 < x < 10 for x in losses), completed.stdout
    assert re.search(r"final eval loss [0-9.]+", completed.stdout)
    assert checkpoint.exists()


def test_train_gpt2_hf_under_torchrun_with_resume(tmp_path):
    """The transformers GPT-2 loop: AdamW, warm-up + cosine, clipping, bf16 autocast, accumulation, evaluation,
    checkpoint, then a second run resumed from it."""
    checkpoint, resumed = tmp_path / "gpt2.pt", tmp_path / "gpt2-resumed.pt"
    first = _torchrun(tmp_path, EXAMPLES / "train_gpt2_hf.py", "--tiny", "--steps", "4", "--checkpoint", str(checkpoint))
    assert first.returncode == 0, (first.stdout + first.stderr)[-4000:]
    assert "world size 2 (gloo)" in first.stdout and "accumulation 2, bf16 autocast, clip 1.0" in first.stdout
    updates = re.findall(r"^update (\d+) loss ([0-9.]+) grad-norm ([0-9.]+|-) lr ([0-9.e+-]+)", first.stdout, re.M)
    assert [int(u[0]) for u in updates] == [1, 2, 3, 4], first.stdout
    assert all(0 < float(u[1]) < 10 for u in updates)
    assert any(u[2] != "-" for u in updates), "some update must report its clipped gradient norm"
    rates = [float(u[3]) for u in updates]
    assert rates[1] > rates[3], "cosine decay after the warm-up"
    assert len(re.findall(r"^update \d+ eval loss [0-9.]+", first.stdout, re.M)) == 2
    assert checkpoint.exists()
    second = _torchrun(tmp_path, EXAMPLES / "train_gpt2_hf.py", "--tiny", "--steps", "2", "--resume", str(checkpoint),
                       "--checkpoint", str(resumed))
    assert second.returncode == 0, (second.stdout + second.stderr)[-4000:]
    assert "resumed from" in second.stdout and re.search(r"^update 5 loss", second.stdout, re.M)
    assert re.search(r"final eval loss [0-9.]+ after 6 updates", second.stdout)



def test_train_hf_trainer_under_torchrun_with_resume(tmp_path):
    """DeftTrainer under torchrun: 4 updates with a checkpoint after 2 (accumulation 2, bf16, clipping, warm-up then
    cosine), then a second launch resumed from it repeats updates 3 and 4 with the same losses and the same final
    evaluation. Both launches exit with 0: the script tears its process groups down before the interpreter exits."""
    script = EXAMPLES / "train_hf_trainer.py"
    first = _torchrun(tmp_path, script, "--tiny", "--steps", "4", "--save-steps", "2", "--output-dir", "out")
    assert first.returncode == 0, (first.stdout + first.stderr)[-4000:]
    assert "world size 2, policy deft, accumulation 2, bf16, clip 1.0" in first.stdout
    losses = re.findall(r"\{'loss': '([^']+)'", first.stdout)
    assert len(losses) == 4 and all(0 < float(x) < 10 for x in losses), first.stdout
    for rank in range(2):
        assert (tmp_path / "out" / "checkpoint-2" / f"deft_step_rank{rank}.pt").exists()
    final = re.search(r"final eval loss ([0-9.]+) after 4 updates", first.stdout)
    assert final, first.stdout
    second = _torchrun(tmp_path, script, "--tiny", "--steps", "4", "--save-steps", "2", "--output-dir", "out",
                       "--resume", "out/checkpoint-2")
    assert second.returncode == 0, (second.stdout + second.stderr)[-4000:]
    assert re.findall(r"\{'loss': '([^']+)'", second.stdout) == losses[2:], second.stdout
    assert re.search(r"final eval loss ([0-9.]+) after 4 updates", second.stdout).group(1) == final.group(1)
