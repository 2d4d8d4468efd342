"""Preserver: watch what staleness and update periods cost while training, and back off.

DeFT's delays (apply step t's averaged gradient at step t+1) and update periods
(communicate every K steps) buy speed with convergence. DESIGN.md §4 measured
the cost of delaying *everything*: +9 % validation loss after 300 steps. So a
plan is checked while it trains, from two signals that are identical on every
rank (so every rank takes the same decision without extra agreement):

* **gradient drift** of each delayed item: ``‖ḡ_t − ḡ_{t−1}‖ / ‖ḡ_t‖`` of the
  averaged gradients applied in two consecutive steps. A delayed update applies
  ḡ_{t−1} where synchronous training would apply ḡ_t; the drift is the relative
  error of that substitution. Its exponential moving average above
  ``drift_threshold`` means staleness distorts the update.
* **loss** averaged over all ranks and over a window of ``check_every`` steps.
  A window mean more than ``loss_tolerance`` above the best window so far,
  ``patience`` times in a row, means training falls behind; one more than
  ``divergence_factor`` times the best (or not finite) means it diverges, and
  is acted on at once. Optionally
  (``probe_every``), a short synchronous reference window is run and its mean
  loss compared with the delayed window just before it.

When a signal fires, the plan steps down a ladder and is re-solved: halve the
largest update period (down to no period), then price staleness so only
buckets that hide much more communication stay delayed, then fully synchronous
(DDP). Pending gradients are flushed before the switch, so none is lost. Every
decision is logged on the ``deft_compile`` logger and kept in ``history``.

The decision logic here is pure Python; the runtime measures and applies it.
"""

from __future__ import annotations

import logging
import math
import statistics
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("deft_compile")


@dataclass(frozen=True)
class PreserverConfig:
    """Thresholds of the Preserver (on by default for ``policy="deft"``).

    Attributes:
        enabled: turn the Preserver on or off.
        check_every: steps per check window (loss mean and drift sample).
        drift_threshold: EMA of a delayed item's relative gradient drift above
            which delays are reduced.
        drift_ema: smoothing of the drift EMA (weight of the old value).
        loss_tolerance: relative excess of a window's mean loss over the best
            window mean (or over the synchronous probe window) that counts as
            harm.
        patience: consecutive harmful loss windows before acting.
        divergence_factor: a window mean above this multiple of the best (or
            not finite) is acted on at once, before the model is ruined.
        probe_every: if > 0, every ``probe_every`` steps run ``probe_window``
            synchronous steps and compare their mean loss with the preceding
            ``probe_window`` steps of the current plan.
        probe_window: steps in a synchronous probe window.
    """

    enabled: bool = True
    check_every: int = 10
    drift_threshold: float = 1.0
    drift_ema: float = 0.8
    loss_tolerance: float = 0.05
    patience: int = 2
    divergence_factor: float = 2.0
    probe_every: int = 0
    probe_window: int = 5

    def __post_init__(self) -> None:
        if self.divergence_factor <= 1.0:
            raise ValueError("divergence_factor must be above 1")
        if self.check_every < 1 or self.probe_window < 1 or self.patience < 1:
            raise ValueError("check_every, probe_window and patience must be at least 1")
        if not 0.0 <= self.drift_ema < 1.0:
            raise ValueError("drift_ema must be in [0, 1)")


@dataclass
class PreserverEvent:
    """One Preserver decision: when, why, the measurements, and the solver options adopted."""

    step: int
    reason: str
    metrics: dict[str, Any]
    options: dict[str, Any]
    level: int

    def __str__(self) -> str:
        return f"step {self.step}: {self.reason} -> level {self.level} {self.options}"


@dataclass
class Preserver:
    """Tracks the signals and walks the ladder of more conservative solver options."""

    config: PreserverConfig
    base_options: dict[str, Any]
    max_period: int = 1
    mean_comm_ms: float = 0.0
    history: list[PreserverEvent] = field(default_factory=list)
    level: int = 0

    def __post_init__(self) -> None:
        self._drift_ema: dict[int, float] = {}
        self._best_loss: float | None = None
        self._harmful_windows = 0
        self._ladder = self._build_ladder()

    # -- the ladder -----------------------------------------------------------
    def _build_ladder(self) -> list[tuple[str, dict[str, Any]]]:
        ladder: list[tuple[str, dict[str, Any]]] = [("as configured", dict(self.base_options))]
        period = self.max_period
        if self.base_options.get("allow_period", True):
            while period > 2:
                period //= 2
                ladder.append((f"update period at most {period}", {**self.base_options, "max_period": period}))
            ladder.append(("no update period", {**self.base_options, "allow_period": False}))
        no_period = ladder[-1][1]
        penalty = max(self.mean_comm_ms, 1e-3) * 0.5
        ladder.append(
            (
                f"delay only buckets hiding > {penalty:.3g} ms more than their staleness price",
                {**no_period, "allow_period": False, "staleness_penalty_ms": penalty},
            )
        )
        ladder.append(("synchronous (no delays, no period)", {**no_period, "max_staleness": 0, "allow_period": False}))
        return ladder

    @property
    def options(self) -> dict[str, Any]:
        return dict(self._ladder[self.level][1])

    @property
    def exhausted(self) -> bool:
        return self.level >= len(self._ladder) - 1

    def _step_down(self, step: int, reason: str, metrics: dict[str, Any]) -> PreserverEvent | None:
        if self.exhausted:
            return None
        self.level += 1
        self._drift_ema.clear()
        self._best_loss = None
        self._harmful_windows = 0
        name, options = self._ladder[self.level]
        event = PreserverEvent(step=step, reason=f"{reason}; re-planning: {name}", metrics=metrics, options=options, level=self.level)
        self.history.append(event)
        log.warning("Preserver at step %d: %s", step, event.reason)
        from deft_compile.artifacts import log_structured

        log_structured("preserver", {"step": step, "reason": event.reason, "level": self.level, "options": options,
                                     "metrics": metrics})
        return event

    # -- signals --------------------------------------------------------------
    def observe_window(self, step: int, mean_loss: float, drifts: dict[int, float]) -> PreserverEvent | None:
        """One check window ended: its all-rank mean loss and per-item drifts. Returns a decision or None."""
        for item, drift in drifts.items():
            previous = self._drift_ema.get(item)
            self._drift_ema[item] = drift if previous is None else self.config.drift_ema * previous + (1 - self.config.drift_ema) * drift
        metrics: dict[str, Any] = {"mean_loss": mean_loss, "drift_ema": dict(self._drift_ema)}
        worst = max(self._drift_ema.items(), key=lambda kv: kv[1], default=None)
        if worst is not None and worst[1] > self.config.drift_threshold:
            return self._step_down(
                step, f"delayed item {worst[0]} drifts {worst[1]:.2f} > {self.config.drift_threshold:g} per step", metrics
            )
        if not math.isfinite(mean_loss) or (
            self._best_loss is not None and mean_loss > self._best_loss * self.config.divergence_factor
        ):
            return self._step_down(step, f"training diverges: window mean loss {mean_loss:.4g} (best {self._best_loss})", metrics)
        if self._best_loss is None or mean_loss < self._best_loss:
            self._best_loss = mean_loss
            self._harmful_windows = 0
        elif mean_loss > self._best_loss * (1 + self.config.loss_tolerance):
            self._harmful_windows += 1
            if self._harmful_windows >= self.config.patience:
                return self._step_down(
                    step,
                    f"window mean loss {mean_loss:.4g} exceeds the best {self._best_loss:.4g} by more than "
                    f"{self.config.loss_tolerance:.0%} for {self._harmful_windows} windows",
                    metrics,
                )
        else:
            self._harmful_windows = 0
        return None

    def observe_probe(self, step: int, plan_losses: list[float], sync_losses: list[float]) -> PreserverEvent | None:
        """Compare a synchronous reference window with the window of the current plan just before it."""
        plan_mean, sync_mean = statistics.fmean(plan_losses), statistics.fmean(sync_losses)
        metrics = {"plan_window_loss": plan_mean, "sync_window_loss": sync_mean}
        if plan_mean > sync_mean * (1 + self.config.loss_tolerance):
            return self._step_down(
                step,
                f"mean loss under the plan {plan_mean:.4g} exceeds the synchronous reference window {sync_mean:.4g} "
                f"by more than {self.config.loss_tolerance:.0%}",
                metrics,
            )
        log.info("Preserver probe at step %d: plan %.4g vs synchronous %.4g: keep the plan", step, plan_mean, sync_mean)
        return None
