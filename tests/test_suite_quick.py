"""``benchmarks/suite.py --quick`` runs end to end (tiny models, unshaped, one launch) and writes its table."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load_suite():
    spec = importlib.util.spec_from_file_location("suite", ROOT / "benchmarks" / "suite.py")
    suite = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(suite)
    return suite


def test_quick_suite_writes_results_and_docs(tmp_path):
    suite = _load_suite()
    docs = tmp_path / "BENCHMARKS.md"
    docs.write_text("# Benchmarks\n")
    out = tmp_path / "suite.json"
    assert suite.main(["--quick", "--models", "vgg16-bn-tiny", "--unshaped", "--out", str(out), "--docs", str(docs)]) == 0
    data = json.loads(out.read_text())
    rows = data["results"][0]["aggregate"]
    assert {"floor", "ddp", "wfbp", "deft"} <= set(rows)
    assert all(rows[name]["step_ms"]["median"] > 0 for name in rows)
    # every launch keeps each rank's step times and each block's wall-clock span; the rows derived from them are
    # times of the same steps: a block's wall time per step is at least its slower rank's own mean step
    for run in data["results"][0]["runs"]:
        assert len(run["samples_by_rank_ms"]["deft"]) == 2 and len(run["block_wall_ms"]["deft"]) == run["steps"]["rounds"]
        for name, row in run["rows"].items():
            if row.get("wall_block_ms") is not None and not row["retraced_steps"]:  # same blocks on both sides
                assert row["wall_block_ms"] >= 0.99 * row["slower_rank_ms"] > 0, (name, row)
    text = docs.read_text()
    assert suite.BEGIN in text and "| vgg16-bn-tiny |" in text
    suite.write_docs(data["results"], data["meta"], docs, None)  # regenerating replaces the section
    assert docs.read_text().count(suite.BEGIN) == 1


def _launch(**ratios: tuple[float, float | None, float | None]) -> dict:
    """One launch's rows: variant -> (paired ratio to DDP, predicted ms, vs floor); step ms 100 for every variant."""
    rows = {"floor": {"step_ms": 60.0, "vs_floor": 1.0}, "ddp": {"step_ms": 100.0, "paired_vs_ddp": 1.0}}
    for name, (paired, predicted, floor) in ratios.items():
        rows[name] = {"step_ms": 100.0, "paired_vs_ddp": paired, "predicted_ms": predicted, "vs_floor": floor}
    return {"rows": rows}


def test_targets_are_checked_from_every_launch_and_never_counted_met_when_not_run():
    suite = _load_suite()
    entry = {"model": "m", "rate": "100mbit", "coverage_target": 1.0, "coverage_measured": 1.05,
             "aggregate": {"floor": {}, "ddp": {}, "wfbp": {}, "deft": {}, "bytescheduler": {}, "usbyte": {}},
             "runs": [_launch(wfbp=(1.01, None, None), deft=(0.80, 85.0, 1.10), bytescheduler=(1.2, 70.0, None),
                              usbyte=(1.1, 95.0, None)),
                      _launch(wfbp=(1.00, None, None), deft=(1.04, 105.0, 1.12), bytescheduler=(1.3, 70.0, None),
                              usbyte=(1.2, 95.0, None)),
                      _launch(wfbp=(1.05, None, None), deft=(0.82, 90.0, 1.30), bytescheduler=(1.25, 70.0, None),
                              usbyte=(1.15, 95.0, None))]}
    (normal,) = suite.check_targets([entry], emulated=False)
    found = {t["target"]: t for t in normal["targets"]}
    assert found["wfbp <= 1.02x DDP"]["met"] and found["wfbp <= 1.02x DDP"]["value"] == "1.010 (worst 1.050)"
    assert found["deft <= 0.85x DDP at CR ~1"]["met"]  # median 0.82
    assert not found["deft never above 1.00x DDP"]["met"]  # one launch at 1.04
    assert found["simulator within 20% (deft)"]["met"]  # median of 0.85, 1.05, 0.90 -> -10 %
    assert not found["simulator within 20% (bytescheduler)"]["met"]  # -30 %
    assert found["usbyte <= bytescheduler (papers)"]["met"]
    assert not any("floor" in name for name in found)  # the floor target is for the emulation mode
    assert not any("reachable" in name for name in found)  # the overlap bound did not run
    (emulated,) = suite.check_targets([entry], emulated=True)
    floor = next(t for t in emulated["targets"] if "floor" in t["target"])
    assert floor["met"] and floor["value"] == "1.120"
    entry["runs"] = [{"rows": {k: v for k, v in run["rows"].items() if k not in ("deft", "usbyte")}}
                     for run in entry["runs"]]
    (partial,) = suite.check_targets([entry], emulated=True)
    assert not any("deft" in t["target"] or "usbyte" in t["target"] for t in partial["targets"])
    assert "| m | 100mbit (1.05) | wfbp <= 1.02x DDP |" in suite.targets_table([partial])


def test_the_overlap_bound_says_whether_hiding_communication_can_meet_the_target():
    """``overlap-bound`` (the floor's step with the whole gradient all-reduced beside it) is the best hiding can
    do: above 0.85x DDP the target is out of reach here, and the check says so; at CR 2 there is no target."""
    suite = _load_suite()
    entry = {"model": "m", "rate": "100mbit", "coverage_target": 1.0, "coverage_measured": 1.0,
             "aggregate": {"floor": {}, "ddp": {}, "overlap-bound": {}},
             "runs": [_launch(**{"overlap-bound": (r, None, None)}) for r in (0.88, 0.90, 0.86)]}
    (check,) = suite.check_targets([entry], emulated=False)
    (bound,) = [t for t in check["targets"] if "reachable" in t["target"]]
    assert bound["value"] == "0.880" and not bound["met"]
    entry["runs"] = [_launch(**{"overlap-bound": (r, None, None)}) for r in (0.6, 0.7, 0.65)]
    (check,) = suite.check_targets([entry], emulated=False)
    assert [t["met"] for t in check["targets"] if "reachable" in t["target"]] == [True]
    entry["coverage_target"] = 2.0
    (check,) = suite.check_targets([entry], emulated=False)
    assert not any("reachable" in t["target"] for t in check["targets"])


def test_simulator_error_is_taken_on_the_schedule_and_names_the_preservers_share():
    """The Preserver's probes are not the schedule the simulator predicts: the error is taken without them, and
    the target's value says how large their share was and what the error would be with them."""
    suite = _load_suite()
    rows = {"floor": {"step_ms": 60.0}, "ddp": {"step_ms": 100.0, "paired_vs_ddp": 1.0},
            "deft": {"step_ms": 100.0, "schedule_ms": 80.0, "preserver_ms": 20.0, "predicted_ms": 76.0,
                     "paired_vs_ddp": 0.9}}
    entry = {"model": "m", "rate": "1gbit", "coverage_target": 2.0, "coverage_measured": 2.0,
             "aggregate": {"floor": {}, "ddp": {}, "deft": {}}, "runs": [{"rows": rows}]}
    assert suite.simulator_errors(entry)["deft"] == pytest.approx(76.0 / 80.0 - 1)
    assert suite.simulator_errors(entry, basis="step_ms")["deft"] == pytest.approx(-0.24)
    (check,) = suite.check_targets([entry], emulated=False)
    target = next(t for t in check["targets"] if t["target"] == "simulator within 20% (deft)")
    assert target["met"] and target["value"] == "-5% (Preserver 20% of the step; -24% with it)"
    del rows["deft"]["schedule_ms"], rows["deft"]["preserver_ms"]  # older results: the whole step
    assert suite.simulator_errors(entry)["deft"] == pytest.approx(-0.24)
    # the closed loop's own time of the plan, where the launch has it, is named beside the rounds' error
    assert suite.simulator_errors(entry, basis="closed_loop_ms", fallback=False) == {}
    rows["deft"]["closed_loop_ms"] = 80.0
    (check,) = suite.check_targets([entry], emulated=False)
    target = next(t for t in check["targets"] if t["target"] == "simulator within 20% (deft)")
    assert target["value"] == "-24% (-5% against the closed loop's time of the plan)" and not target["met"]
