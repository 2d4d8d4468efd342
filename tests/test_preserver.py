"""The Preserver's decisions (pure logic, no processes)."""

from __future__ import annotations

import pytest

from deft_compile.preserver import Preserver, PreserverConfig

BASE = {"first_bucket_bytes": 1, "bucket_cap_bytes": 2}


def _preserver(**config) -> Preserver:
    return Preserver(PreserverConfig(**config), base_options=dict(BASE), max_period=4, mean_comm_ms=2.0)


def test_ladder_goes_from_the_plan_to_synchronous():
    preserver = _preserver()
    levels = [preserver.options]
    while not preserver.exhausted:
        assert preserver._step_down(0, "test", {}) is not None
        levels.append(preserver.options)
    assert levels[0] == BASE
    assert levels[1]["max_period"] == 2
    assert levels[2]["allow_period"] is False
    assert levels[3]["staleness_penalty_ms"] == pytest.approx(1.0)
    assert levels[-1]["max_staleness"] == 0
    assert preserver._step_down(0, "again", {}) is None, "no level below synchronous"


def test_high_drift_steps_down_and_is_recorded():
    preserver = _preserver(drift_threshold=0.5, drift_ema=0.0)
    assert preserver.observe_window(10, 1.0, {3: 0.2}) is None
    event = preserver.observe_window(20, 0.9, {3: 0.8})
    assert event is not None and event.level == 1
    assert "item 3 drifts 0.80" in event.reason
    assert preserver.history == [event]


def test_drift_is_smoothed():
    preserver = _preserver(drift_threshold=0.5, drift_ema=0.9)
    assert preserver.observe_window(10, 1.0, {0: 0.1}) is None
    assert preserver.observe_window(20, 1.0, {0: 2.0}) is None  # EMA 0.29: one spike is not enough
    assert preserver.level == 0


def test_rising_loss_needs_patience():
    preserver = _preserver(loss_tolerance=0.05, patience=2)
    assert preserver.observe_window(10, 1.00, {}) is None
    assert preserver.observe_window(20, 0.90, {}) is None
    assert preserver.observe_window(30, 0.97, {}) is None  # 7.8 % above the best, first time
    event = preserver.observe_window(40, 0.99, {})
    assert event is not None and "exceeds the best" in event.reason


def test_noise_within_tolerance_and_recovery_reset_patience():
    preserver = _preserver(loss_tolerance=0.05, patience=2)
    for step, loss in enumerate([1.0, 1.03, 0.98, 1.02, 1.08, 0.97, 1.09]):
        assert preserver.observe_window(step, loss, {}) is None


def test_nan_loss_counts_as_harm():
    preserver = _preserver(patience=1)
    preserver.observe_window(10, 1.0, {})
    assert preserver.observe_window(20, float("nan"), {}) is not None


def test_probe_compares_with_the_synchronous_window():
    preserver = _preserver(loss_tolerance=0.05)
    assert preserver.observe_probe(50, [1.0, 1.0], [0.99, 0.97]) is None
    event = preserver.observe_probe(100, [1.2, 1.1], [1.0, 1.0])
    assert event is not None and "synchronous reference window" in event.reason


def test_config_is_validated():
    with pytest.raises(ValueError):
        PreserverConfig(check_every=0)
    with pytest.raises(ValueError):
        PreserverConfig(drift_ema=1.0)


def test_preserver_rescues_a_run_that_staleness_breaks():
    """2 gloo workers, SGD with momentum at lr 0.02 on a regression MLP whose DeFT plan delays all but one
    bucket. Synchronous training converges; with delays it diverges; with the Preserver (on by default)
    the gradient drift of the delayed buckets triggers a re-plan, recorded in ``plan_history``, and the
    run converges like the synchronous one."""
    import math

    from deft_compile.launcher import run_local_workers
    from workers import preserver_run

    def run(enabled, synchronous):
        return run_local_workers(preserver_run, 2, (0.02, enabled, 60, 5, synchronous), timeout_s=240)[0].value

    synchronous, delayed, preserved = run(False, True), run(False, False), run(True, False)
    assert synchronous["losses"][-1] < 1.0
    assert not math.isfinite(delayed["losses"][-1]) or delayed["losses"][-1] > 100.0
    assert math.isfinite(preserved["losses"][-1]) and preserved["losses"][-1] < 1.0
    assert len(delayed["history"]) == 1, "without the Preserver the plan never changes"
    reasons = [entry["reason"] for entry in preserved["history"][1:]]
    assert reasons and "drifts" in reasons[0]
    assert preserved["history"][-1]["delayed_items"] < preserved["history"][0]["delayed_items"]
