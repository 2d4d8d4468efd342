"""The README's first command, as a new user runs it: install, then ``deft-compile demo`` with every default
(the default compiler, no ``DEFT_COMPILER``), which must exit 0 and write every file the README promises."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def readme_first_command() -> str:
    """The first shell command of the README's first code block."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text, re.S)
    assert block, "README.md has no bash code block"
    return block.group(1).strip().splitlines()[0]


def test_the_first_command_is_install_then_demo():
    install, _, demo = readme_first_command().partition(" && ")
    assert install.startswith("pip install ") and ".[plot]" in install, install
    assert demo == "deft-compile demo"


@pytest.mark.slow
def test_readme_first_command_runs_the_demo(tmp_path):
    """The install runs in the checkout (as the README's ``-e .`` needs), the demo in a fresh folder; the
    environment is the user's: no ``DEFT_COMPILER`` (the suite's aten default is taken out)."""
    install, _, demo = readme_first_command().partition(" && ")
    env = {k: v for k, v in os.environ.items() if k != "DEFT_COMPILER"}
    bin_dir = str(Path(sys.executable).parent)
    env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")  # this environment's pip and deft-compile
    installed = subprocess.run(install, shell=True, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert installed.returncode == 0, installed.stderr[-3000:]
    ran = subprocess.run(demo, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert ran.returncode == 0, (ran.stdout[-3000:], ran.stderr[-3000:])
    out = tmp_path / "deft-demo"
    for name in ("results.json", "timeline_simulated.png", "timeline_measured.png"):
        assert (out / name).exists(), f"{name} missing; stdout:\n{ran.stdout[-2000:]}"
    results = json.loads((out / "results.json").read_text())
    assert results["wfbp_compiler"] == "inductor"  # the default route ran
    assert "expected within" in ran.stdout and ": ok" in ran.stdout
    rows = results["rows"]
    assert len({row["equal_steps"] for row in rows.values()}) == 1  # the losses compare like with like
