"""The Preserver's trade: what one step of staleness on each parameter costs, in milliseconds per step.

Delaying a bucket (or giving it an update period) saves communication time per
step and costs convergence. To weigh one against the other both must be in the
same unit. A first-order model gives it: a step's progress on the loss is
``Σ_p g_p · Δw_p``; applying a stale gradient changes parameter p's part by
the relative gradient change ``e_p = ‖Δg_p‖ / ‖g_p‖`` (measured on the same
minibatch, :mod:`deft_compile.preserver.staleness`), and parameter p carries the
share ``‖g_p‖² / Σ_q ‖g_q‖²`` of the progress. So one step of staleness on p
loses about

    s_p = ‖Δg_p‖ · ‖g_p‖ / Σ_q ‖g_q‖²

of a step's progress, and time to a given loss grows by that fraction of the
step time (the compute time, ``compute_ms``): the price of p is
``staleness_price × s_p × step_ms`` ms per step and per step of staleness.
A plan whose prices add up to P loses L = P / compute of each step's progress,
so it needs 1 / (1 − L) times the steps: the solver ranks plans by predicted
step time / (1 − L) (``solvers.deft.priced_step_ms``), not by time + P, which
underestimates large losses (measured: a delay priced at L ≈ 0.6 was kept by
the linear rule and cost 24 % of final validation loss). The shares add up over parameters, so a bucket's
price is the sum over its parameters however the plan buckets them.

An update period K is not just staleness: the bucket's parameters are updated
once every K steps (with the mean of K gradients), and while progress comes per
update (steps, not samples, limit it) that loses (1 − 1/K) of their share of
progress, ``w_p = ‖g_p‖² / Σ_q ‖g_q‖²``. Its price, ``update_prices``, is
``staleness_price × w_p × step_ms`` per step for losing all of p's updates.
Measured on a 6 M-parameter GPT-2 under AdamW (docs/TIME_TO_ACCURACY.md),
pricing periods as (K − 1)/2 steps of staleness kept a period that cost 19 %
of final validation loss; priced by the updates they skip they are dropped.
Before the first measurement the update prices are a prior: each parameter's
share of the parameters (``prior_update_prices``).

That holds where the gradient is exact. A minibatch gradient is noisy, and the
mean of K of them is worth more than one: with the gradient noise scale of the
step's batch, b = tr(Σ) / ‖G‖² (the noise's variance over the true gradient's
squared norm; McCandlish et al., "An Empirical Model of Large-Batch Training",
2018), an update with the mean of K gradients makes (1 + b) / (1 + b / K) times
the progress of one. So a period K loses (K − 1) / (K + b) of p's share, not
(1 − 1/K) (``skipped_share``): nothing where noise dominates (b ≫ K), all of
(1 − 1/K) where it is absent (b = 0, the prior). The ranks' gradients on their
own batches measure b per parameter (``noise_ratios``): with N ranks, the
ranks' mean squared norm S and the squared norm M of their mean give
‖G‖² = (N·M − S) / (N − 1) and the noise of the all-reduced step
tr(Σ) = (S − M) / (N − 1).
``staleness_price`` (κ, default 1) scales the first-order estimate: momentum
and Adam carry a stale error into later steps, which the estimate ignores.

The solver then keeps a delay (or period) only where the time it hides beats
its price (``solve_deft(staleness_prices=...)``): partial delays, smaller
periods, or none, instead of all-or-nothing pins.

Measurements cost two eager forward/backward passes. ``ProbeSchedule`` spaces
them out while decisions are stable (the interval doubles up to a limit, and
never lets probes take more than ``probe_budget`` of the step time), goes
back to the base interval after a decision changes the plan, and stops for
good once the Preserver's decision is final (``Preserver.settled``).

Pure Python, no torch: the monitor measures, this decides.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from deft_compile.planner.solvers.deft import skipped_share


def progress_shares(changes: dict[str, tuple[float, float]]) -> dict[str, float]:
    """Per parameter, the share of a step's progress one step of staleness loses: ‖Δg_p‖·‖g_p‖ / Σ_q ‖g_q‖².

    ``changes`` maps a parameter name to (‖Δg_p‖², ‖g_p‖²) on one minibatch (summed over ranks).
    """
    total = sum(g for _, g in changes.values())
    if total <= 0:
        return {name: 0.0 for name in changes}
    return {name: math.sqrt(max(d, 0.0) * max(g, 0.0)) / total for name, (d, g) in changes.items()}


def update_shares(changes: dict[str, tuple[float, float]]) -> dict[str, float]:
    """Per parameter, its share of a step's progress: ‖g_p‖² / Σ_q ‖g_q‖². An update period K applies p's
    gradient once every K steps, so it loses (1 − 1/K) of this share (first order: progress comes per update)."""
    total = sum(g for _, g in changes.values())
    return {name: (max(g, 0.0) / total if total > 0 else 0.0) for name, (_, g) in changes.items()}


def prior_update_prices(numels: dict[str, int], step_ms: float, price_factor: float = 1.0) -> dict[str, float]:
    """Update prices before anything is measured: each parameter's share of the progress taken as its share of
    the parameters. With it a period is chosen only where it hides more communication than the updates it
    skips are worth (roughly: where communication, not compute, dominates the step, as DeFT intends)."""
    total = sum(numels.values())
    return {name: _rounded(price_factor * step_ms * n / total) for name, n in numels.items()} if total else {}


#: the largest noise ratio a measurement gives a parameter (a noise ratio above it, or a true gradient measured at
#: or below zero, is taken as this): at 100 a period of 2 still loses 1 % of the parameter's share of progress
NOISE_CAP = 100.0


def noise_ratios(rank_mean_sq: dict[str, float], mean_sq: dict[str, float], world_size: int) -> dict[str, float]:
    """Per parameter, the gradient noise scale of the all-reduced step over the step's batch, b = tr(Σ) / ‖G‖²,
    from the ranks' mean squared gradient norm (S) and the squared norm of the ranks' mean gradient (M) on one
    minibatch: b = (S − M) / (N·M − S), in [0, ``NOISE_CAP``]. Empty for one rank (nothing to compare)."""
    if world_size < 2:
        return {}
    ratios = {}
    for name, s in rank_mean_sq.items():
        m = mean_sq.get(name, 0.0)
        signal, noise = world_size * m - s, max(s - m, 0.0)
        if s <= 0.0:
            ratios[name] = 0.0  # no gradient: nothing a period could lose or gain
        elif signal <= 0.0:
            ratios[name] = NOISE_CAP
        else:
            ratios[name] = min(noise / signal, NOISE_CAP)
    return ratios


def compute_ms(profile: Any) -> float:
    """The step time prices are in: forward, backward and update without communication (a ``Profile``'s).
    Time to a loss is steps x step time, so a lost share L of progress costs L x the step time of the plan
    that runs; the plans worth trading for hide their communication, so their step is about the compute."""
    return float(profile.forward_ms + profile.backward_ms + profile.update_ms)


def plan_price_ms(plan: Any, param_names: list[str], staleness_prices: dict[str, float],
                  update_prices: dict[str, float], update_noise: dict[str, float] | None = None) -> float:
    """The price of a plan's staleness and update periods, ms per step: each parameter's staleness price × its
    mean staleness (d + (K − 1)/2) plus its update price × the share a period K skips (``skipped_share`` at the
    parameter's noise ratio in ``update_noise``, 0 where absent). ``plan`` is a ``Plan`` (items with bucket,
    slices, delay, period); each bucket's parameters are counted once, however many link shares carry it."""
    noise = update_noise or {}
    buckets: dict[int, tuple[set[int], int, int]] = {}
    for item in plan.items:
        params, _, _ = buckets.setdefault(item.bucket, (set(), item.delay, item.period))
        params.update(s.param for s in item.slices)
    price = 0.0
    for params, delay, period in buckets.values():
        for p in params:
            name = param_names[p]
            price += (staleness_prices.get(name, 0.0) * (delay + (period - 1) / 2)
                      + update_prices.get(name, 0.0) * skipped_share(period, noise.get(name, 0.0)))
    return price


def priced_cost_ms(plan: Any, param_names: list[str], staleness_prices: dict[str, float],
                   update_prices: dict[str, float], compute: float, step_ms: float | None = None,
                   update_noise: dict[str, float] | None = None) -> float:
    """A plan's step time per step of synchronous progress under the given prices (what the deft solver ranks
    candidates by, ``priced_step_ms``): its predicted step time, or ``step_ms`` (a measured one), with the price
    of its staleness (``plan_price_ms``)."""
    from deft_compile.planner.solvers.deft import priced_step_ms

    iteration = float(plan.predicted_iteration_ms or 0.0) if step_ms is None else step_ms
    price = plan_price_ms(plan, param_names, staleness_prices, update_prices, update_noise)
    return priced_step_ms(iteration, price, compute)


def _rounded(value: float) -> float:
    """4 significant digits, so that a re-measurement of the same dynamics gives the same options."""
    return float(f"{value:.4g}")


@dataclass
class StalenessPricer:
    """Keeps each parameter's last ``window`` shares (staleness and update) and prices their medians."""

    price_factor: float = 1.0
    window: int = 3
    _shares: dict[str, list[float]] = field(default_factory=dict)
    _updates: dict[str, list[float]] = field(default_factory=dict)
    _noise: dict[str, list[float]] = field(default_factory=dict)

    def observe(self, changes: dict[str, tuple[float, float]], noise: dict[str, float] | None = None) -> None:
        """One measurement: per parameter (‖Δg‖², ‖g‖²), and the gradient noise ratios (``noise_ratios``) where the
        measurement compared the ranks' gradients."""
        for name, share in progress_shares(changes).items():
            self._shares[name] = (self._shares.get(name, []) + [share])[-self.window :]
        for name, share in update_shares(changes).items():
            self._updates[name] = (self._updates.get(name, []) + [share])[-self.window :]
        for name, ratio in (noise or {}).items():
            self._noise[name] = (self._noise.get(name, []) + [ratio])[-self.window :]

    @property
    def ready(self) -> bool:
        """Whether every parameter has a full window (the median ignores one spike)."""
        return bool(self._shares) and all(len(values) == self.window for values in self._shares.values())

    def medians(self) -> dict[str, float]:
        return {name: statistics.median(values) for name, values in self._shares.items()}

    def prices(self, step_ms: float) -> tuple[dict[str, float], ...]:
        """(staleness prices: ms per step per step of staleness; update prices: ms per step that losing all
        of a parameter's updates costs), by parameter name; and, where measured, the median noise ratios that
        scale what an update period loses (``skipped_share``)."""
        def priced(shares: dict[str, list[float]]) -> dict[str, float]:
            return {name: _rounded(self.price_factor * statistics.median(v) * step_ms) for name, v in shares.items()}

        noise = {name: _rounded(statistics.median(v)) for name, v in self._noise.items()}
        return (priced(self._shares), priced(self._updates)) + ((noise,) if noise else ())

    def state_dict(self) -> dict[str, Any]:
        return {"shares": {name: list(values) for name, values in sorted(self._shares.items())},
                "updates": {name: list(values) for name, values in sorted(self._updates.items())},
                "noise": {name: list(values) for name, values in sorted(self._noise.items())}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._shares = {name: [float(v) for v in values] for name, values in state["shares"].items()}
        self._updates = {name: [float(v) for v in values] for name, values in state.get("updates", {}).items()}
        self._noise = {name: [float(v) for v in values] for name, values in state.get("noise", {}).items()}


@dataclass
class ProbeSchedule:
    """When the next staleness measurement happens (1-based step numbers, the same on every rank).

    Two early measurements (``every // 5`` and twice that) catch harm in the first steps; then one every
    ``every`` steps. After a measurement that left the plan as it was, the interval doubles, up to
    ``every × backoff``; after one that changed the plan it returns to ``every``. Past the early ones, the
    interval never lets a measurement cost more than ``budget`` of the steps' time until the next one, even where
    that is longer than ``every × backoff``: the budget bounds the probes' cost, the backoff only how long
    unchanged prices go unmeasured.
    """

    every: int
    backoff: int = 8
    budget: float = 0.005
    interval: int = 0
    next_step: int = 0
    stopped: bool = False

    def __post_init__(self) -> None:
        if not self.interval:
            self.interval = self.every
        if not self.next_step and self.every:
            self.next_step = max(1, self.every // 5)

    def due(self, step: int) -> bool:
        return bool(self.every) and not self.stopped and step == self.next_step

    def stop(self) -> None:
        """No more measurements (the decision they would inform is final)."""
        self.stopped = True

    def resume(self, step: int) -> None:
        """Measure again ``interval`` steps after ``step`` (measurements paused while a decision was pending)."""
        self.next_step = step + max(1, self.interval)

    def postpone(self, steps: int) -> None:
        """The measurement due now cannot run (a call that only accumulates, or nothing to price yet)."""
        self.next_step += max(1, steps)

    def after_measurement(self, step: int, *, changed: bool, probe_ms: float, step_ms: float) -> int:
        """Schedule the next measurement after the one at ``step``; returns the interval chosen."""
        early = max(1, self.every // 5)
        if step < 2 * early:
            self.next_step = 2 * early
            return self.next_step - step
        if step < self.every:
            self.next_step = self.every
            return self.next_step - step
        longest = self.every * max(1, self.backoff)
        self.interval = self.every if changed else min(longest, self.interval * 2)
        if step_ms > 0 and self.budget > 0:  # probes at most `budget` of the training time
            self.interval = max(self.interval, math.ceil(probe_ms / (self.budget * step_ms)))
        self.next_step = step + self.interval
        return self.interval

    def state_dict(self) -> dict[str, int]:
        return {"interval": self.interval, "next_step": self.next_step, "stopped": int(self.stopped)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.interval, self.next_step = int(state["interval"]), int(state["next_step"])
        self.stopped = bool(state.get("stopped", 0))
