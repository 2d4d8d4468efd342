"""Preserver: watch what staleness and update periods cost while training, and back off.

DeFT's delays (apply step t's averaged gradient at step t+1) and update periods
(communicate every K steps) buy speed with convergence. Measured here (docs/
CONVERGENCE.md): on a small transformer under AdamW, one step of staleness on
a single input-side bucket already costs several percent of validation loss,
while on a CNN under SGD the same plans cost nothing measurable. So a plan is
checked while it trains, from signals that are identical on every rank (so
every rank takes the same decision without extra agreement):

* **staleness price** of each parameter (``trade``, the default): the share
  of a step's progress one step of staleness loses, priced in ms per step
  (:mod:`deft_compile.preserver.pricing`). The prices go to the deft solver
  (``staleness_prices``), which keeps a delay or a period only where the
  communication it hides is worth more than its price: partial delays and
  smaller periods before everything is synchronous. What the Preserver does
  with a priced plan follows :mod:`deft_compile.preserver.verdict` (carried
  out by :mod:`deft_compile.preserver.trade`): a proposal must pay for its
  switch; plain (uncompensated) delays must also pass a paired replay; a plan
  with delays is judged on the closed loop's measured times; a decision
  confirmed ``stable_after`` times, or any decision back to synchronous, is
  final (``settled``) and probing stops.
* **staleness error** of each bucket (``trade=False``, the veto mode):
  ``‖g(w_{t+1}; B_t) − g(w_t; B_t)‖ / ‖g(w_t; B_t)‖`` on the *same* minibatch
  (:mod:`deft_compile.preserver.staleness`), summed over ranks, times the bucket's mean
  staleness in steps (``d + (K − 1)/2``, at least 1). It is the relative error
  a one-step-stale update makes beyond ordinary sampling noise. A bucket whose
  median over the last measurements exceeds ``staleness_threshold`` is
  *pinned*: its parameters join the solver's ``keep_synchronous`` list and the
  plan is re-solved, so the knapsack may delay other, less sensitive buckets
  instead. This is DeFT's "move buckets back to synchronous", bucket by
  bucket. The error is measured for synchronous buckets too, so a pinned
  bucket is released when its error falls (the learning rate decays).
* **loss** averaged over all ranks and over a window of ``check_every`` steps.
  A window mean above the best window so far by more than ``loss_tolerance``
  (relative) *and* ``loss_floor`` (absolute), ``patience`` times in a row,
  means training falls behind; one above ``divergence_factor`` times the best
  (or not finite) means it diverges and is acted on at once. Optionally
  (``probe_every``), a short synchronous reference window is run and its mean
  loss compared with the delayed window just before it.

A finite loss signal is only acted on when staleness may have caused it: if no
step since the best window ran a delay or an update period, it is dismissed at
once. With ``attribute_loss`` the monitor also replays the steps since the best
window from a copy taken there, twice on every rank, with the schedules that ran
and synchronous (:mod:`deft_compile.preserver.attribution`), and steps down only
if the stale arm ends with a higher loss, by ``loss_tolerance`` and
``loss_floor``, than the synchronous arm had its lag (d + (K − 1)/2 steps)
earlier (``attribute``). A rise that synchronous training shares (a
learning-rate schedule, a hard stretch of data, a memorising model) is
dismissed: recorded in ``dismissed``, and the best window is measured anew. A
loss that is not finite is acted on at once.

A loss signal steps down a ladder of global options and re-solves: halve the
largest update period (down to no period), then price staleness so only
buckets that hide much more communication stay delayed, then fully synchronous
(DDP); a rung whose plan is the running one, or staler than it, is skipped. Pending
gradients are flushed before every switch, so none is lost.
Every decision is logged on the ``deft_compile`` logger and kept in
``history`` (and in ``CompiledStep.plan_history``).

The decision logic here is pure Python; the runtime measures and applies it.
"""

from __future__ import annotations

import fnmatch
import logging
import math
import re
import statistics
from dataclasses import dataclass, field
from typing import Any

from deft_compile.preserver.pricing import ProbeSchedule, StalenessPricer, progress_shares
from deft_compile.preserver.verdict import Stability

log = logging.getLogger("deft_compile")


#: the solver options a trade's prices fill, in the order ``StalenessPricer.prices`` gives them
PRICE_KEYS = ("staleness_prices", "update_prices", "update_noise")


@dataclass(frozen=True)
class PreserverConfig:
    """Thresholds of the Preserver (on by default for ``policy="deft"``). The rules at length: docs/POLICIES.md,
    "The Preserver".

    Attributes:
        enabled: turn the Preserver on or off. On because staleness can cost convergence that the speed it buys
            does not repay (docs/CONVERGENCE.md).
        check_every: steps per loss window. 10 averages out single batches while a trend shows within tens of
            steps.
        staleness_every: steps between two staleness measurements (two eager forward/backward passes each; two
            early ones at ``staleness_every // 5`` and twice that); 0 turns the signal off. 25 costs about 8 %
            more compute on average, and the early pair catches harm in the first steps.
        staleness_threshold: veto mode: the median of an item's last ``staleness_window`` staleness errors
            (relative gradient error × mean staleness in steps) above which it is kept synchronous. 0.2 separates
            docs/CONVERGENCE.md's two tasks: medians of 0.02-0.09 where delays cost nothing, 0.25-0.37 where
            they cost 3-15 % of validation loss.
        release_ratio: veto mode: a pinned bucket is released when its median falls below ``staleness_threshold
            × release_ratio``. 0.5 so that a bucket near the threshold does not flip back and forth.
        staleness_window: measurements per decision (their median). 3 so a single spike is ignored (a batch the
            model already fits has a tiny gradient and a large relative error).
        loss_tolerance: relative excess of a window's mean loss over the best window mean (or the synchronous
            probe window) that counts as harm. 5 %, with ``loss_floor``, so window-to-window noise does not count.
        loss_floor: absolute excess that must also be crossed. 0.02 so noise near zero loss is not taken for harm.
        patience: consecutive harmful loss windows before acting. 2 so one hard stretch of data is not enough.
        divergence_factor: a window mean above this multiple of the best (or not finite) is acted on at once.
            2 because a doubled loss is divergence, and waiting would ruin the model.
        probe_every: if > 0, every ``probe_every`` steps run ``probe_window`` synchronous steps and compare their
            mean loss with the preceding ``probe_window`` steps. 0 (off) because probe windows run synchronous
            steps whether or not anything is wrong, while the loss rules and the paired replay act on a signal.
        probe_window: steps in a synchronous probe window. 5 gives a window mean without a long synchronous stretch.
        trade: price staleness per parameter and let the solver trade it against the time it hides, instead of
            pinning buckets whose error crosses ``staleness_threshold`` (the veto mode). On because the veto
            pins buckets where delays cost nothing (a CNN under SGD) and every bucket at once on a transformer
            under AdamW.
        staleness_price: κ of :mod:`deft_compile.preserver.pricing`: one step of staleness costs κ × (share of a
            step's progress lost) × step time. 1, the first-order estimate; above 1 is more careful.
        probe_backoff: trade mode: while trades leave the plan unchanged, the interval between measurements
            doubles up to ``staleness_every × probe_backoff``. 8 so measurements that change nothing stop
            costing time, while prices that move are still seen within 200 steps.
        probe_budget: trade mode: past the early measurements, each is spaced so that it takes at most this share
            of the steps' time until the next one (its measured cost counts), even beyond ``probe_backoff``'s.
            0.5 % because measured overheads of 8-11 % of the training clock left the delays nothing to gain at
            coverage rates 2-3.
        trade_margin: hysteresis: a proposal with delays must gain this share of the compute step per step
            (priced, predicted) over the synchronous plan, and a running plan with delays goes back only when its
            measured step, priced, exceeds the measured synchronous step by this share of it. 5 % because prices
            are medians of noisy measurements and a switch costs a flush, new graphs and a perturbation of
            training.
        price_doubt: trade mode: a proposal must still gain (priced, predicted) with its price multiplied by this:
            the first-order price underestimates large losses (momentum and Adam carry a stale error on). 2 because
            a plan priced at 39.5 % of each step's progress, proposed at κ = 1 (GPT-2 mini, AdamW, CR 2), was
            re-priced at 62.6 % two hundred steps later and ended 3.3 % above DDP's final validation loss; at
            twice its price it would not have run, while compensated delays priced at a few percent still do.
        stable_after: trade mode: consecutive measurements that leave a running plan with delays as it is
            before that decision is final and probing stops (the loss rules and the closed loop's re-check stay
            on). 3, the window a price is a median of.
        switch_horizon: trade mode: the steps over which a proposal's per-step gain must repay its switch (the
            flush, the graphs it builds, the duel's steps on the slower plan). 200, the longest interval between
            two measurements (``staleness_every × probe_backoff``).
        admission_steps: trade mode, plain delays (``delayed_update`` "averaged" or "local"): minibatches the
            paired replay that admits a proposal trains on, twice (with the proposal's delays, and synchronous).
            20 keeps a replay of both arms under twice the steps it covers.
        admission_tolerance: the relative excess of the replay's delayed arm over its synchronous arm (its lag
            earlier) up to which plain delays are admitted. 0: measured, a price of 1-2 ms per step hid a 3-5 %
            final-loss cost, so plain delays must show no cost at all.
        attribute_loss: before stepping down on a finite loss signal after stale steps, replay the steps since
            the best window from a copy of the state taken there, with the schedules that ran and synchronous,
            and step down only if the stale replay ends worse; None: on when that copy takes at most
            ``attribution_max_bytes``. None because a loss also rises on its own (a schedule, hard data, a
            memorising model), and stepping down for that bars later delays for nothing.
        attribution_max_steps: minibatches kept since the best window; past that the copy is dropped and a
            signal is acted on unattributed. 60 bounds the kept batches and a replay's time.
        attribution_max_bytes: the largest copy ``attribute_loss=None`` makes. 1 GiB: larger models keep their
            memory and step down unattributed.
        attribution_budget: the copies and paired replays never take more than this share of the steps' own time
            so far (:mod:`deft_compile.preserver.budget`); a replay that would cross it is not run, and the
            signal is acted on unattributed; None: no limit. 0.05, as ``probe_budget``, because early in a run
            one replay can cost more than every step before it.
        start_synchronous: trade mode: no delays until staleness prices exist (a full window of
            ``staleness_window`` measurements, step 25 by default), update periods priced by the prior; None: on
            when the step measures its own profile, off for a profile the user gives. On because delays in the
            first steps, while the learning rate warms up, do lasting harm (docs/TIME_TO_ACCURACY.md).
    """

    enabled: bool = True
    check_every: int = 10
    staleness_every: int = 25
    staleness_threshold: float = 0.2
    staleness_window: int = 3
    release_ratio: float = 0.5
    loss_tolerance: float = 0.05
    loss_floor: float = 0.02
    patience: int = 2
    divergence_factor: float = 2.0
    probe_every: int = 0
    probe_window: int = 5
    trade: bool = True
    staleness_price: float = 1.0
    probe_backoff: int = 8
    probe_budget: float = 0.005
    trade_margin: float = 0.05
    price_doubt: float = 2.0
    stable_after: int = 3
    switch_horizon: int = 200
    admission_steps: int = 20
    admission_tolerance: float = 0.0
    start_synchronous: bool | None = None
    attribute_loss: bool | None = None
    attribution_max_steps: int = 60
    attribution_max_bytes: int = 1 << 30
    attribution_budget: float | None = 0.05

    def __post_init__(self) -> None:
        if self.divergence_factor <= 1.0:
            raise ValueError("divergence_factor must be above 1")
        if self.check_every < 1 or self.probe_window < 1 or self.patience < 1:
            raise ValueError("check_every, probe_window and patience must be at least 1")
        if self.staleness_every < 0:
            raise ValueError("staleness_every must be >= 0 (0 turns the staleness error off)")
        if not 0.0 <= self.release_ratio <= 1.0:
            raise ValueError("release_ratio must be in [0, 1]")
        if self.attribution_max_steps < 1:
            raise ValueError("attribution_max_steps must be at least 1")
        if self.staleness_window < 1:
            raise ValueError("staleness_window must be at least 1")
        if self.attribution_budget is not None and self.attribution_budget < 0:
            raise ValueError("attribution_budget must be >= 0 (or None: no limit)")
        if self.staleness_price < 0 or self.probe_budget < 0 or self.probe_backoff < 1 or self.trade_margin < 0:
            raise ValueError("staleness_price and probe_budget must be >= 0 and probe_backoff >= 1")
        if self.price_doubt < 1:
            raise ValueError(f"price_doubt must be at least 1 (a proposal's price, multiplied); got {self.price_doubt}")
        if self.stable_after < 1 or self.switch_horizon < 1 or self.admission_steps < 2:
            raise ValueError("stable_after and switch_horizon must be at least 1, admission_steps at least 2")
        if self.admission_tolerance < 0:
            raise ValueError("admission_tolerance must be >= 0")


@dataclass
class PreserverEvent:
    """One Preserver decision: when, why, the measurements, and the solver options adopted."""

    step: int
    reason: str
    metrics: dict[str, Any]
    options: dict[str, Any]
    level: int

    def __str__(self) -> str:
        options = dict(self.options)
        for key in PRICE_KEYS:  # one number per parameter: summarised
            if key in options:
                options[key] = f"<{len(options[key])} parameters>"
        return f"step {self.step}: {self.reason} -> level {self.level} {options}"


@dataclass
class LossSignal:
    """The loss rules found harm at ``step``: why, the measurements, and whether the loss is still finite."""

    step: int
    reason: str
    metrics: dict[str, Any]
    finite: bool = True


@dataclass
class Preserver:
    """Tracks the signals and walks the ladder of more conservative solver options."""

    config: PreserverConfig
    base_options: dict[str, Any]
    max_period: int = 1
    mean_comm_ms: float = 0.0
    history: list[PreserverEvent] = field(default_factory=list)
    level: int = 0
    prior_update_prices: dict[str, float] = field(default_factory=dict)  # trade mode, before any measurement
    start_synchronous: bool = False  # trade mode: no delays before the first priced trade (resolved config)
    plain_delays: bool = False  # delays apply plain (uncompensated) gradients: proposals need a paired replay

    def __post_init__(self) -> None:
        self._errors: dict[tuple[str, ...], list[float]] = {}
        # pinned bucket (its parameter names) -> its mean staleness when pinned, by which it is judged
        self._pins: dict[tuple[str, ...], float] = {}
        self.staleness_log: list[tuple[int, dict[str, float]]] = []  # every measurement: (step, {names: error})
        self._best_loss: float | None = None
        self._harmful_windows = 0
        self._ladder = self._build_ladder()
        self.pricer = StalenessPricer(self.config.staleness_price, self.config.staleness_window)
        self.probes = ProbeSchedule(self.config.staleness_every, self.config.probe_backoff, self.config.probe_budget)
        self.prices: dict[str, float] = {}  # adopted staleness prices (trade mode), ms per step per step of staleness
        # adopted update prices (trade mode): ms per step that losing all of a parameter's updates costs
        self.update_prices: dict[str, float] = dict(self.prior_update_prices) if self.config.trade else {}
        # adopted gradient noise ratios (trade mode): what share of its updates' progress a period loses
        self.update_noise: dict[str, float] = {}
        self.traded = False  # a staleness measurement has priced the delays (trade mode)
        # trade mode: "" while decisions are open; "synchronous" (final: no delays, no more proposals) or "kept"
        # (final: the running plan with delays stays), with why; probing stops once settled
        self.settled = ""
        self.settled_why = ""
        self.stability = Stability(self.config.stable_after)
        # plain delays waiting for a paired replay (preserver.trade): {"kind": "propose" (with "prices", "reason") or
        # "confirm" (the running plan's), "schedule": {name: (delay, period)}, "metrics": {...}}
        self.admission: dict[str, Any] | None = None
        self.dismissed: list[PreserverEvent] = []  # loss signals staleness did not cause (``attribute_loss``)
        # parameter names whose buckets a measurement priced harmful on a 16-bit wire: float32 from then on
        self.float32: set[str] = set()
        # the running plan sends buckets narrowed: measurements go on after the trade's decision is final, to judge
        # the wire (set by the monitor before each step)
        self.watch_wire = False

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
    def pinned(self) -> set[str]:
        """Parameter names the Preserver keeps synchronous."""
        return {name for names in self._pins for name in names}

    @property
    def options(self) -> dict[str, Any]:
        """Solver options of the current level, with the pinned parameters kept synchronous and the adopted
        staleness prices (trade mode)."""
        if self.settled == "synchronous" or (self.config.trade and self.start_synchronous and not self.traded):
            return {**self.unpriced_options(), "max_staleness": 0}
        return self.priced_options((self.prices, self.update_prices, self.update_noise))

    def unpriced_options(self) -> dict[str, Any]:
        """Solver options of the current level with the pinned parameters kept synchronous, without prices."""
        options = dict(self._ladder[self.level][1])
        if self.pinned:  # names, escaped so the solver's fnmatch matches them literally
            pinned = {re.sub(r"([\[\]*?])", r"[\1]", name) for name in self.pinned}
            options["keep_synchronous"] = sorted(set(options.get("keep_synchronous", ())) | pinned)
        if self.float32:
            kept = {re.sub(r"([\[\]*?])", r"[\1]", name) for name in self.float32}
            options["keep_float32"] = sorted(set(options.get("keep_float32", ())) | kept)
        return options

    def keep_float32(self, step: int, names: set[str], why: str, metrics: dict[str, Any]) -> PreserverEvent:
        """Send these parameters' buckets in float32 for good (a measurement priced their 16-bit wire harmful);
        recorded as an event whose options the caller switches to."""
        self.float32 |= set(names)
        return self._record(step, why, metrics)

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to continue this Preserver's decisions (saved by ``CompiledStep.state_dict``)."""
        return {
            "level": self.level,
            "pins": [[list(names), s] for names, s in sorted(self._pins.items())],
            "errors": [[list(names), list(values)] for names, values in sorted(self._errors.items())],
            "best_loss": self._best_loss,
            "harmful_windows": self._harmful_windows,
            "pricer": self.pricer.state_dict(),
            "probes": self.probes.state_dict(),
            "prices": dict(self.prices),
            "update_prices": dict(self.update_prices),
            "update_noise": dict(self.update_noise),
            "traded": self.traded,
            "settled": self.settled,
            "settled_why": self.settled_why,
            "confirmations": self.stability.confirmations,
            "admission": self.admission,
            "float32": sorted(self.float32),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.level = min(int(state["level"]), len(self._ladder) - 1)
        self._pins = {tuple(names): float(s) for names, s in state["pins"]}
        self._errors = {tuple(names): [float(v) for v in values] for names, values in state["errors"]}
        self._best_loss = state["best_loss"]
        self._harmful_windows = int(state["harmful_windows"])
        if "pricer" in state:
            self.pricer.load_state_dict(state["pricer"])
            self.probes.load_state_dict(state["probes"])
            self.prices = {name: float(v) for name, v in state["prices"].items()}
            self.update_prices = {name: float(v) for name, v in state["update_prices"].items()}
            self.update_noise = {name: float(v) for name, v in state.get("update_noise", {}).items()}
            self.traded = bool(state.get("traded", True))
            self.settled, self.settled_why = str(state.get("settled", "")), str(state.get("settled_why", ""))
            self.stability.confirmations = int(state.get("confirmations", 0))
            self.admission = state.get("admission")
        self.float32 = {str(name) for name in state.get("float32", ())}

    @property
    def exhausted(self) -> bool:
        return self.level >= len(self._ladder) - 1

    def _step_down(self, step: int, reason: str, metrics: dict[str, Any]) -> PreserverEvent | None:
        if self.exhausted:
            return None
        self.level += 1
        name = self._ladder[self.level][0]
        if self.config.trade:  # the ladder only goes down: no proposal reopens what a loss signal closed
            self._settle("kept" if not self.exhausted else "synchronous", f"loss signal at step {step}")
        return self._record(step, f"{reason}; re-planning: {name}", metrics)

    def _settle(self, state: str, why: str) -> None:
        self.settled, self.settled_why = state, why
        self.admission = None
        if not self.watch_wire:
            self.probes.stop()

    def settle(self, step: int, state: str, why: str, metrics: dict[str, Any]) -> PreserverEvent | None:
        """Make the trade's decision final (``"synchronous"`` or ``"kept"``, see ``settled``); probing stops. A
        decision that changes the solver options is recorded as an event (the caller switches plans), one that
        does not is logged."""
        before = self.options
        self._settle(state, why)
        if self.options != before:
            return self._record(step, why, metrics)
        log.info("Preserver at step %d: %s", step, why)
        return None

    def staleness_due(self, step: int) -> bool:
        """Whether the staleness error is measured at (1-based) ``step``."""
        every = self.config.staleness_every
        if not every:
            return False
        if self.config.trade:
            return (not self.settled or self.watch_wire) and self.admission is None and self.probes.due(step)
        early = max(1, every // 5)
        return step % every == 0 or step in (early, 2 * early)

    def _record(self, step: int, reason: str, metrics: dict[str, Any]) -> PreserverEvent:
        self._errors.clear()
        self._best_loss = None
        self._harmful_windows = 0
        options = self.options
        event = PreserverEvent(step=step, reason=reason, metrics=metrics, options=options, level=self.level)
        self.history.append(event)
        log.warning("Preserver at step %d: %s", step, event.reason)
        from deft_compile.debug.artifacts import log_structured

        log_structured("preserver", {"step": step, "reason": event.reason, "level": self.level, "options": options,
                                     "metrics": metrics})
        return event

    def observe_staleness(
        self, step: int, errors: dict[tuple[str, ...], float | tuple[float, float]]
    ) -> PreserverEvent | None:
        """Staleness errors of every bucket, keyed by its parameter names: the relative gradient change of one
        step, with the bucket's mean staleness in steps under the current plan (``(error, staleness)``; a bare
        number means staleness 1). Pins stale buckets whose median error × staleness exceeds
        ``staleness_threshold``, and releases pinned ones whose median falls under ``staleness_threshold ×
        release_ratio``, judged with the staleness they had when pinned (a pinned bucket's own staleness is 1;
        judging it by that would release and re-pin the same bucket over and over)."""
        scaled = {}
        for names, value in errors.items():
            error, staleness = value if isinstance(value, tuple) else (value, 1.0)
            scaled[names] = error * self._pins.get(names, staleness)
        self.staleness_log.append((step, {"+".join(names): error for names, error in scaled.items()}))
        window = self.config.staleness_window
        for names, error in scaled.items():
            self._errors[names] = (self._errors.get(names, []) + [error])[-window:]
        medians = {names: statistics.median(values) for names, values in self._errors.items() if len(values) == window}
        threshold = self.config.staleness_threshold
        patterns = self.base_options.get("keep_synchronous", ())  # the user's: synchronous already, never released

        def user_kept(names: tuple[str, ...]) -> bool:
            return all(any(fnmatch.fnmatchcase(n, p) for p in patterns) for n in names)

        over = {names: e for names, e in medians.items()
                if e > threshold and names not in self._pins and not user_kept(names)}
        under = {names: e for names, e in medians.items()
                 if e < threshold * self.config.release_ratio and names in self._pins}
        if self.exhausted or not (over or under):
            return None
        for names in over:
            value = errors[names]
            self._pins[names] = value[1] if isinstance(value, tuple) else 1.0
        for names in under:
            del self._pins[names]

        def described(group: dict[tuple[str, ...], float]) -> str:
            return ", ".join(f"{'+'.join(names)} ({e:.2f})" for names, e in sorted(group.items(), key=lambda kv: -kv[1]))

        parts = ([f"median staleness error above {threshold:g}: {described(over)}"] if over else []) + (
            [f"below {threshold * self.config.release_ratio:g} again: {described(under)}"] if under else [])
        metrics = {"staleness_error_median": {"+".join(k): v for k, v in medians.items()}}
        return self._record(
            step, f"{'; '.join(parts)}; re-planning with {len(self.pinned)} parameter(s) kept synchronous", metrics
        )

    def trade(self, step: int, changes: dict[str, tuple[float, float]], step_ms: float,
              noise: dict[str, float] | None = None) -> tuple[dict[str, float], ...] | None:
        """Trade mode: one measurement of every parameter's (‖Δg‖², ‖g‖²) on a minibatch, summed over ranks, and
        where the ranks' gradients were compared, their noise ratios (``pricing.noise_ratios``). Returns
        (staleness prices, update prices[, noise ratios]) to plan with once every parameter has a full window,
        else None. The caller (the monitor) solves with them and calls ``adopt`` (``record=True`` if the schedule
        changes)."""
        self.pricer.observe(changes, noise)
        self.staleness_log.append((step, {name: round(share, 6) for name, share in progress_shares(changes).items()}))
        return self.pricer.prices(step_ms) if self.pricer.ready else None

    def priced_options(self, prices: tuple[dict[str, float], ...]) -> dict[str, Any]:
        """The options the current level would have with ``prices`` (staleness prices, update prices and
        optionally noise ratios) adopted (nothing changes)."""
        options = self.unpriced_options()
        if options.get("max_staleness", 1) != 0:  # empty price maps are left out (unpriced plans keep their hash)
            options.update({key: dict(value) for key, value in zip(PRICE_KEYS, prices) if value})
        return options

    def adopt(self, prices: tuple[dict[str, float], ...]) -> None:
        """Take ``prices`` as the current trade (the options the standing decision solves with)."""
        self.prices, self.update_prices = dict(prices[0]), dict(prices[1])
        self.update_noise = dict(prices[2]) if len(prices) > 2 else {}
        self.traded = True

    def record_trade(self, step: int, prices: tuple[dict[str, float], dict[str, float]], metrics: dict[str, Any],
                     reason: str) -> PreserverEvent:
        """``adopt`` and record a decision that changes the plan (a new decision: its confirmations start anew)."""
        self.adopt(prices)
        self.admission = None
        self.stability.reset()
        return self._record(step, reason, metrics)

    # -- signals --------------------------------------------------------------
    @property
    def best_loss(self) -> float | None:
        """The best window mean loss since the last decision (what the loss rules compare with)."""
        return self._best_loss

    def loss_signal(self, step: int, mean_loss: float) -> LossSignal | None:
        """One loss window ended with this all-rank mean loss: a signal of harm, or None. Updates the best
        window and the count of harmful windows; decides nothing (``act_on``, ``attribute`` and ``dismiss`` do)."""
        metrics: dict[str, Any] = {"mean_loss": mean_loss}
        if not math.isfinite(mean_loss):
            return LossSignal(step, f"training diverges: window mean loss {mean_loss:.4g}", metrics, finite=False)
        if (self._best_loss is not None and mean_loss > self._best_loss * self.config.divergence_factor
                and mean_loss - self._best_loss > self.config.loss_floor):
            return LossSignal(step, f"training diverges: window mean loss {mean_loss:.4g} (best {self._best_loss:.4g})",
                              metrics)
        if self._best_loss is None or mean_loss < self._best_loss:
            self._best_loss = mean_loss
            self._harmful_windows = 0
        elif (mean_loss > self._best_loss * (1 + self.config.loss_tolerance)
              and mean_loss - self._best_loss > self.config.loss_floor):
            self._harmful_windows += 1
            if self._harmful_windows >= self.config.patience:
                return LossSignal(
                    step,
                    f"window mean loss {mean_loss:.4g} exceeds the best {self._best_loss:.4g} by more than "
                    f"{self.config.loss_tolerance:.0%} and {self.config.loss_floor:g} for {self._harmful_windows} windows",
                    metrics,
                )
        else:
            self._harmful_windows = 0
        return None

    def act_on(self, signal: LossSignal) -> PreserverEvent | None:
        """Step down for ``signal`` unattributed (a loss that is not finite, or no copy to replay from)."""
        return self._step_down(signal.step, signal.reason, signal.metrics)

    def attribute(self, signal: LossSignal, step: int, stale_loss: float, sync_loss: float,
                  steps: int) -> PreserverEvent | None:
        """The paired replay of the ``steps`` steps since the best window ended: step down if the staleness that
        ran made the loss worse than synchronous updates did from the same state on the same minibatches, else
        dismiss the signal."""
        metrics = {**signal.metrics, "replay_stale_loss": stale_loss, "replay_synchronous_loss": sync_loss,
                   "replay_steps": steps}
        tolerance, floor = self.config.loss_tolerance, self.config.loss_floor
        worse = not math.isfinite(stale_loss) or (stale_loss > sync_loss * (1 + tolerance) and stale_loss - sync_loss > floor)
        comparison = f"paired replay of the {steps} steps since the best window: {stale_loss:.4g} with the " \
                     f"staleness that ran, {sync_loss:.4g} synchronous"
        if worse:
            return self._step_down(step, f"{signal.reason}; {comparison}", metrics)
        self.dismiss(step, signal, f"{comparison}: staleness did not cause it", metrics)
        return None

    def dismiss(self, step: int, signal: LossSignal, why: str, metrics: dict[str, Any] | None = None) -> None:
        """A loss signal that staleness did not cause: keep the plan, record it, and measure the best window anew
        (the rise is the training's own; judging later windows against the old best would signal it again)."""
        self._best_loss = None
        self._harmful_windows = 0
        event = PreserverEvent(step=step, reason=f"{signal.reason}; dismissed: {why}",
                               metrics=metrics or signal.metrics, options=self.options, level=self.level)
        self.dismissed.append(event)
        log.info("Preserver at step %d: %s", step, event.reason)
        from deft_compile.debug.artifacts import log_structured

        log_structured("preserver_dismissed", {"step": step, "reason": event.reason, "metrics": event.metrics})

    def observe_probe(self, step: int, plan_losses: list[float], sync_losses: list[float]) -> PreserverEvent | None:
        """Compare a synchronous reference window with the window of the current plan just before it."""
        plan_mean, sync_mean = statistics.fmean(plan_losses), statistics.fmean(sync_losses)
        metrics = {"plan_window_loss": plan_mean, "sync_window_loss": sync_mean}
        if plan_mean > sync_mean * (1 + self.config.loss_tolerance) and plan_mean - sync_mean > self.config.loss_floor:
            return self._step_down(
                step,
                f"mean loss under the plan {plan_mean:.4g} exceeds the synchronous reference window {sync_mean:.4g} "
                f"by more than {self.config.loss_tolerance:.0%}",
                metrics,
            )
        log.info("Preserver probe at step %d: plan %.4g vs synchronous %.4g: keep the plan", step, plan_mean, sync_mean)
        return None
