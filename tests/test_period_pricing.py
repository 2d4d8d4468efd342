"""What an update period costs, measured: the Preserver's trade compares the ranks' gradients on their own batches
with their all-reduced mean (``monitor.rank_gradient_norms``) and prices a period by the gradient noise ratio
(``pricing.noise_ratios``, ``skipped_share``). 2 processes, gloo."""

from __future__ import annotations

import math

from deft_compile.preserver.pricing import NOISE_CAP
from deft_compile.tools.launcher import run_local_workers
from preserver_workers import trade_run


def test_the_trade_measures_every_parameters_noise_ratio_alike_on_every_rank():
    """A synchronous start on a profile whose link takes twice the compute (the plan solved without prices gives
    buckets a period), measured at steps 5, 10 and 25: every trained parameter gets a window of noise ratios, the
    same on both ranks, finite and within [0, NOISE_CAP]; where the trade priced a plan, its options carry their
    medians (``update_noise``), which is what the solver prices periods with."""
    results = [r.value for r in run_local_workers(trade_run, 2, (27, "auto", {"switch_horizon": 10 ** 6}, False,
                                                                 None, 8.0), timeout_s=240)]
    states = [r["state"] for r in results]
    assert states[0]["pricer"]["noise"] == states[1]["pricer"]["noise"]
    noise, updates = states[0]["pricer"]["noise"], states[0]["pricer"]["updates"]
    assert noise and set(noise) == set(updates), (sorted(noise), sorted(updates))
    windows = [values for values in noise.values()]
    assert all(len(values) == len(windows[0]) >= 2 for values in windows), noise
    assert all(math.isfinite(v) and 0.0 <= v <= NOISE_CAP for values in windows for v in values), noise
    assert any(0.0 < v < NOISE_CAP for values in windows for v in values), "every ratio at a bound: nothing measured"
    assert results[0]["overheads"]["staleness_probes"] == len(windows[0])
    if states[0]["traded"]:
        assert states[0]["update_noise"] and set(states[0]["update_noise"]) == set(noise)


def test_no_noise_is_measured_where_no_plan_could_have_a_period():
    """The same run on a link under the compute: the plan solved without prices has no period, no price can buy
    one, and the measurements skip the all-reduce of the gradient (``Trader.periods_can_run``)."""
    results = [r.value for r in run_local_workers(trade_run, 2, (27, "auto", {"switch_horizon": 10 ** 6}),
                                                  timeout_s=240)]
    for result in results:
        assert result["overheads"]["staleness_probes"] >= 2, result["overheads"]
        assert result["state"]["pricer"]["noise"] == {} and result["state"]["update_noise"] == {}
