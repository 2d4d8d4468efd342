"""benchmarks/first_steps.py's per-launch figures from one rank's record (pure: no launch)."""

from __future__ import annotations

import pytest


def test_stalls_after_the_first_call_count_what_slow_calls_took_beyond_the_median():
    """``stalls_after_first_s`` sums, over the calls after the first that took over ``LATER_STALL_FACTOR`` median
    steps, their time beyond the median; the first call (compile, profile, plan) is left out, and a call just under
    the factor counts nothing."""
    from first_steps import LATER_STALL_FACTOR, summarise

    median = 0.5
    times = [20.0] + [median] * 20 + [1.3, median * LATER_STALL_FACTOR * 0.99, 2.0]
    record = {"times": times, "construct_s": 0.1, "switched": [False] * len(times), "overheads": {},
              "compiles": 3, "delayed_items": 0, "compiler": "aten"}
    figures = summarise(record)
    assert figures["median_step_ms"] == pytest.approx(median * 1e3)
    assert figures["stalls_after_first_s"] == pytest.approx((1.3 - median) + (2.0 - median))
    assert figures["stalls_after_first"] == [[21, 1300], [23, 2000]]
    assert figures["stall_steps"] == 2, "3x the median: the first call and the 2.0 s one"
