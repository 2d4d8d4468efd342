"""benchmarks/dssync_dlcp.py in quick mode: 4 gloo workers, DDP / deft / DS-Sync / DLCP on digits, and on a shaped link.

The digits test runs without privileges. The shaped-link tests need root with
``ip`` and ``tc`` (like tests/test_netns.py): without them they fail with the
reason instead of skipping.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import dssync_dlcp  # noqa: E402

from deft_compile.tools.netns import NETNS_DIR, NetnsError, check_prerequisites  # noqa: E402


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def test_digits_quick(tmp_path):
    """Every variant trains 20 steps on the same samples; flush() leaves one model; DLCP stays within its bound."""
    code = dssync_dlcp.main(["--parts", "digits", "--quick", "--out", str(tmp_path),
                             "--digits-variants", "ddp", "deft", "dssync", "dlcp", "--dlcp-max-loss", "0.5"])
    assert code == 0
    record = json.loads((tmp_path / "dssync_dlcp.json").read_text())
    assert (tmp_path / "dssync_dlcp.png").stat().st_size > 0
    assert len(record["load_start"]) == 3 and len(record["digits"]["load_after"]) == 3
    digits = record["digits"]
    rows = digits["summary"]
    assert list(rows) == ["ddp", "deft", "dssync", "dlcp-0.5"]
    run = digits["runs"]["0"]["variants"]
    for name, row in rows.items():
        assert _finite(row["test_accuracy"]) and 0 <= row["test_accuracy"] <= 100, (name, row)
        assert _finite(row["time_ratio_to_ddp"]) and row["time_ratio_to_ddp"] > 0, (name, row)
        assert row["replicas_identical_after_flush"] == [True], f"{name}: replicas differ after flush()"
        assert len(run[name]["train_loss"]) == 20 and all(_finite(x) for x in run[name]["train_loss"])
    assert rows["ddp"]["time_ratio_to_ddp"] == 1.0
    # DS-Sync: groups of 2 really made the replicas differ, and flush() made them bit-identical.
    assert rows["dssync"]["before_flush_max_abs_diff"][0] > 0
    assert run["dssync"]["after_flush"]["max_abs_diff"] == 0.0
    # deft's plan really delays (the synthetic slow-link profile).
    assert rows["deft"]["plan"]["delayed_bytes_share"] > 0.5
    # DS-Sync's replica spread and the accuracy of their average were recorded at each evaluation (steps 10, 20).
    track = run["dssync"]["track"]
    assert [p["step"] for p in track] == [10, 20] and all(p["relative_distance_to_mean"] > 0 for p in track)
    # flush() averages the replicas: its model is the average the last probe evaluated.
    assert track[-1]["averaged"]["test_accuracy"] == rows["dssync"]["test_accuracy"]
    # DLCP: a deadline below the full all-reduce; every step within the bound, and it really drops.
    row = rows["dlcp-0.5"]
    assert 0 < row["chunk_budget"] < row["chunks"]
    stats = run["dlcp-0.5"]["stats"]
    assert len(stats) == 20
    for sent, dropped in stats:
        assert row["chunk_budget"] <= sent <= row["chunks"]
        assert dropped <= 0.5 + 1e-6, (sent, dropped)
    assert row["steps_dropping_share"] > 0 and row["dropped_mass_max"] > 0.1


@pytest.fixture
def root_with_iproute2():
    try:
        check_prerequisites()
    except NetnsError as error:
        pytest.fail(f"{error} -- the shaped-link part of benchmarks/dssync_dlcp.py needs root with iproute2")


def test_shaped_quick(tmp_path, root_with_iproute2):
    """4 workers in a shaped namespace: DS-Sync's pairs move fewer bytes than a 4-rank all-reduce; the namespace goes."""
    code = dssync_dlcp.main(["--parts", "shaped", "--quick", "--out", str(tmp_path),
                             "--shaped-variants", "floor", "ddp", "dssync"])
    assert code == 0
    shaped = json.loads((tmp_path / "dssync_dlcp.json").read_text())["shaped"]
    (rate,) = shaped["rates"]
    run = shaped["runs"][rate]
    assert run["namespace_removed"] and not os.path.exists(os.path.join(NETNS_DIR, run["namespace"]))
    rows = run["summary"]
    for name in ("floor", "ddp", "dssync"):
        assert _finite(rows[name]["vs_ddp"]) and rows[name]["blocks"] > 0, (name, rows[name])
    link = run["value"]["link"]
    # On one shared medium a 4-rank ring moves 6 S bytes, two concurrent pairs 4 S (ideal ratio 0.67).
    assert link["pair_allreduce_all_ms"] < 0.9 * link["allreduce_all_ms"], link
    assert rows["ddp"]["vs_floor"] > 1.2, "the shaped link must make communication visible"


def test_sigterm_removes_the_namespace(tmp_path, root_with_iproute2):
    """SIGTERM while the shaped part runs: KeyboardInterrupt, namespace deleted, exit 130, JSON marked interrupted."""
    child = subprocess.Popen(
        [sys.executable, str(REPO / "benchmarks" / "dssync_dlcp.py"), "--parts", "shaped", "--quick",
         "--out", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    name = None
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            line = child.stdout.readline()
            if not line:
                break
            if "namespace deftdd-" in line:
                name = line.split("namespace ", 1)[1].split(":", 1)[0]
                break
        assert name and os.path.exists(os.path.join(NETNS_DIR, name)), "the shaped part did not start"
        time.sleep(2.0)  # workers are starting inside the namespace
        child.send_signal(signal.SIGTERM)
        rest, _ = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 130, rest
    assert "namespaces left by this run: none" in rest, rest
    assert not os.path.exists(os.path.join(NETNS_DIR, name))
    assert json.loads((tmp_path / "dssync_dlcp.json").read_text())["interrupted"] is True
