"""Measures the Preserver's signals around compiled steps and applies its decisions.

Kept apart from :mod:`deft_compile.preserver` (pure decisions) and from the
runtime (graphs): this module knows which tensors to look at. Costs per step
are one ``loss.item()``; at the end of each loss window one all-reduce of one
number. Every ``staleness_every`` steps, when the plan has stale items (or
buckets the Preserver pinned), it copies the parameters before the step and
afterwards recomputes the step's minibatch gradient at both weights (two eager
forward/backward passes, see :mod:`deft_compile.preserver.staleness`), then all-reduces
two numbers per bucket. A measurement whose price could not change the decision (the trade's
``staleness_can_pay``) is not taken; where the running plan sends buckets in 16 bits it becomes
one pass at the weights after the step, which prices the wire's cast error only (from ``staleness_every``
on: the first call priced the wire, ``StepPlanning._measure_wire``, and the early measurements are for
staleness). With
``attribute_loss`` it copies the state before the first stale step after each new best loss
window and keeps the minibatches since; after a finite loss signal it replays them with and
without the staleness that ran (:mod:`deft_compile.preserver.attribution`), then all-reduces
two numbers. Copies and
replays stay within ``attribution_budget`` of the steps' own time
(:mod:`deft_compile.preserver.budget`); the loss window's all-reduce carries the
five numbers that budget is judged by.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist
import torch.nn as nn

from deft_compile.passes.schedule import APPLY_NEXT_UPDATE, ScheduledItem
from deft_compile.planner.plan import Plan, Profile
from deft_compile.preserver.attribution import Schedule, Snapshot, kept_batch, lag_steps, loss_over, replay
from deft_compile.preserver.admission import PlainAdmission
from deft_compile.preserver.budget import AttributionBudget
from deft_compile.preserver.decisions import Preserver, PreserverEvent
from deft_compile.preserver.pricing import noise_ratios
from deft_compile.preserver.staleness import (batch_gradients, predicted_weights, rate_scales,
                                              same_batch_gradient_change, update_metric)
from deft_compile.preserver.trade import Trader
from deft_compile.preserver.wire_error import cast_error_norms, metric_weights
from deft_compile.timing import comm_device


#: gradient elements the noise measurement all-reduces from a large model (``noise_sample``): 1 MiB in float32
NOISE_SAMPLE_ELEMENTS = 2**18
#: elements every tensor keeps in the sample at least (all of a smaller one): each tensor's noise ratio is its own
NOISE_SAMPLE_LEAST = 256
#: minibatches (the last kept ones) over which the paired replay's arms are compared
_REPLAY_EVALUATION_BATCHES = 10


class WatchedStep(Protocol):
    """What the monitor reads from and asks of the step it watches (``step.handle.StepHandle`` provides it)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    loss_fn: Callable[..., torch.Tensor] | None
    config: Any  # DeftConfig: max_grad_norm is replayed by the loss attribution
    last_call_updated: bool
    last_call_moved_weights: bool  # the last call applied an update (a staleness probe needs weights that moved)
    plan: Plan | None
    profile: Profile | None
    step_count: int
    world_size: int
    graph: Any  # the CompiledGraph of the latest step: its captured parameters and names
    items: list[ScheduledItem]
    process_group: dist.ProcessGroup | None
    control_group: dist.ProcessGroup | None  # for the monitor's own all-reduces: beside the gradients in flight
    closed_loop: Any  # the closed loop's measured plan times, or None where it does not run
    last_trace_seconds: float  # the latest step graph's build: part of a switch's cost

    def solve(self, options: dict[str, Any]) -> Plan: ...

    def switch_plan(self, options: dict[str, Any], reason: str) -> None: ...

    def updates_at(self, call_index: int) -> bool: ...


class PreserverMonitor:
    def __init__(self, step: WatchedStep, preserver: Preserver) -> None:
        self.step = step
        self.preserver = preserver
        self.config = preserver.config
        self._loss_sum = 0.0
        self._loss_count = 0
        self._before: list[torch.Tensor] | None = None
        self._recent_losses: list[float] = []
        self._probe: dict | None = None
        self.probe_seconds = 0.0  # wall-clock time spent measuring staleness (cloning weights, recomputing)
        self._clone_seconds = 0.0  # the weight copy of the measurement under way
        self._measuring = ""  # what it measures (``_measurement``)
        self.measurements = {"staleness": 0, "wire": 0}  # taken so far, by kind
        self._narrowed_of: tuple[Any, bool] = (None, False)  # (plan, whether it narrows any bucket)
        # since the best loss window: whether a step ran stale, and (attribute_loss) a copy of the state there with
        # the minibatches and schedules of the steps since, for a paired replay
        self._stale_since_best = False
        self._since_best: dict | None = None
        self._attribute: bool | None = None  # attribute_loss, resolved at the first best window
        self._copy_wanted = False  # copy the state before the next stale step (a new best window has passed)
        self._schedule_of: tuple[Any, Schedule] = (None, {})  # (step.items, the schedule those items run)
        # copies and replays against the steps' own time (attribution_budget); why the last copy was not taken
        self.budget = AttributionBudget(self.config.attribution_budget)
        self._no_copy_because = ""
        self.wire_sums: tuple[list[str], list[float]] | None = None  # the last measurement's, for the wire's judge
        self.noise: dict[str, float] | None = None  # the last measurement's noise ratios, for the trade's update prices
        # the trade's decisions (preserver.trade); plain delays are admitted by a paired replay (preserver.admission)
        admission = (PlainAdmission(self.budget, self.config.admission_steps, self.config.check_every)
                     if preserver.plain_delays else None)
        self.trader = Trader(step, preserver, admission, agree=self._all_rank_mean)

    @property
    def attribution_seconds(self) -> float:
        """Wall-clock time spent on copies, kept minibatches and paired replays."""
        return self.budget.spent_seconds

    def state_dict(self) -> dict:
        """The Preserver's state plus the open loss window and the attribution budget, so a resumed run decides
        as an unbroken one (the copy for a paired replay is not saved: a signal before the next best window is
        acted on unattributed)."""
        return {**self.preserver.state_dict(), "loss_sum": self._loss_sum, "loss_count": self._loss_count,
                "recent_losses": list(self._recent_losses), "attribution_budget": self.budget.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.preserver.load_state_dict(state)
        self._loss_sum, self._loss_count = float(state["loss_sum"]), int(state["loss_count"])
        self._recent_losses = [float(v) for v in state["recent_losses"]]
        self.budget.load_state_dict(state.get("attribution_budget", {}))

    @staticmethod
    def _staleness(item) -> float:
        """Mean steps by which an item's applied gradient lags: one if delayed, plus (K - 1)/2 with a period K."""
        return (1.0 if item.apply == APPLY_NEXT_UPDATE else 0.0) + (item.period - 1) / 2

    def _buckets(self) -> dict[tuple[str, ...], tuple[list[int], float]]:
        """Parameter names -> (captured parameter indices, mean staleness in steps, at least 1: what a delay
        would cost a synchronous bucket) for every item. Shares of one bucket merge."""
        names = self.step.graph.captured.model_state.param_names  # items hold captured indices
        return {tuple(sorted(names[p] for p in item.params)): (sorted(item.params), max(1.0, self._staleness(item)))
                for item in self.step.items}

    def _narrowed(self) -> bool:
        """Whether the running plan sends any bucket in a 16-bit dtype (asked every step: kept per plan)."""
        plan = self.step.plan
        if plan is not self._narrowed_of[0]:
            self._narrowed_of = (plan, plan is not None and any(item.narrowed for item in plan.items))
        return self._narrowed_of[1]

    def _measurement(self) -> str:
        """What the due measurement measures: ``"staleness"`` (the gradient at the weights before and after the
        step: two eager passes), ``"wire"`` (the running 16-bit wire's cast error on this step's gradient: one
        pass) or ``""`` (nothing worth a pass). Veto mode: staleness while items are stale or buckets pinned.
        Trade mode: staleness while items are stale or a measured price can change the decision
        (``Trader.staleness_can_pay``), else the wire while the running plan narrows buckets."""
        stale = any(self._staleness(item) > 0 for item in self.step.items)
        if not self.config.trade:
            return "staleness" if stale or self.preserver.pinned else ""
        if stale or self.trader.staleness_can_pay():
            return "staleness"
        return "wire" if self._narrowed() else ""

    def before_step(self) -> None:
        """Called before every step: keep the weights if this step's staleness error is measured, and copy the
        state for a paired replay before the first stale step since the best loss window."""
        self._copy_before_first_stale_step()
        self.trader.before_step()
        self._before = None
        self.preserver.watch_wire = self.config.trade and self._narrowed()
        step = self.step.step_count + 1
        if self._probe is None and not self.preserver.exhausted and self.preserver.staleness_due(step):
            if not self.step.updates_at(self.step.step_count):  # a call that only accumulates changes no weight
                self.preserver.probes.postpone(1)
                return
            self._measuring = self._measurement()
            if not self._measuring:
                self.preserver.probes.postpone(self.config.staleness_every)
                return
            if self._measuring == "wire" and step < self.config.staleness_every:  # priced by the first call
                self._measuring = ""
                self.preserver.probes.postpone(self.config.staleness_every - step)
                return
            if self._measuring == "wire":  # the gradient at the weights after the step: nothing to keep
                self._before, self._clone_seconds = [], 0.0
                return
            started = time.perf_counter()
            params = self.step.graph.captured.model_state.params
            if getattr(self.step.config, "delayed_update", None) == "compensated":
                # a compensated delay's gradient comes from the predicted weights: price the error from there
                self._before = predicted_weights(self.step.optimizer, params)
            else:
                self._before = [p.detach().clone() for p in params]
            self._clone_seconds = time.perf_counter() - started
            self.probe_seconds += self._clone_seconds

    def _staleness_errors(self, args: tuple, kwargs: dict) -> dict[tuple[str, ...], tuple[float, float]]:
        """Veto mode, per bucket: (relative gradient change of this step on its own minibatch, over all ranks;
        the bucket's mean staleness in steps under the current plan). Sums of rank means are rank means of
        sums, so the per-parameter measurement of the trade gives it."""
        changes, _ = self._parameter_changes(args, kwargs)
        names = self.step.graph.captured.model_state.param_names
        errors = {}
        for bucket, (params, staleness) in self._buckets().items():
            changed = sum(changes[names[p]][0] for p in params)
            size = sum(changes[names[p]][1] for p in params)
            if size > 0:
                errors[bucket] = (math.sqrt(changed / size), staleness)
        return errors

    def _parameter_changes(self, args: tuple, kwargs: dict) -> tuple[dict[str, tuple[float, float]], float]:
        """Per trained parameter name: (‖Δg‖², ‖g‖²) of this step on its own minibatch, mean over ranks; and
        the measurement's cost in ms (weight copy and recomputation), also the mean over ranks: every rank
        decides from the same numbers."""
        started = time.perf_counter()
        state = self.step.graph.captured.model_state
        watched = sorted({p for item in self.step.items for p in item.params})
        passes = 1 if self._measuring == "wire" else 2
        dtypes = self.trader.wire_dtypes() if self.config.trade and self._narrowed() else None
        noise = passes == 2 and self.config.trade and self.step.world_size > 1 and self.trader.periods_can_run()
        change, wire_row, kept = measure_step(self.step, watched, None if passes == 1 else self._before, args, kwargs,
                                              trade=self.config.trade, wire_dtypes=dtypes, keep=noise)
        self.budget.pass_seconds = (time.perf_counter() - started) / passes  # a paired replay's unit of work
        noise_row = rank_gradient_norms(self.step, watched, kept) if noise else []
        recomputed = time.perf_counter() - started
        self.measurements["wire" if passes == 1 else "staleness"] += 1
        probe_ms = 1e3 * (recomputed + self._clone_seconds)
        means = self._all_rank_mean([change.get(p, (0.0, 0.0))[k] for k in (0, 1) for p in watched] + wire_row
                                    + noise_row + [probe_ms])
        n, names = len(watched), [state.param_names[p] for p in watched]
        # rank sums for the wire's pricing (``wire_pricing.wire_shares``)
        self.wire_sums = (names, [v * self.step.world_size for v in means[2 * n:2 * n + len(wire_row)]]
                          ) if wire_row else None
        at = 2 * n + len(wire_row)
        self.noise = noise_ratios(dict(zip(names, means[at:at + n])), dict(zip(names, means[at + n:at + 2 * n])),
                                  self.step.world_size) if noise_row else None
        return {name: (means[i], means[n + i]) for i, name in enumerate(names)}, means[-1]

    def _trade(self, step_count: int, changes: dict[str, tuple[float, float]], probe_ms: float) -> PreserverEvent | None:
        """Judge the running plan's 16-bit wire on this measurement, then price the measured staleness and decide
        (``deft_compile.preserver.trade``)."""
        wire_sums, self.wire_sums = self.wire_sums, None
        if wire_sums is not None:
            event = self.trader.judge_wire(step_count, *wire_sums)
            if event is not None:
                self.preserver.probes.after_measurement(step_count, changed=True, probe_ms=probe_ms,
                                                        step_ms=self.trader.running_step_ms())
                return event
        if self.preserver.settled or self._measuring == "wire":  # this measurement judged the wire only
            self.preserver.probes.after_measurement(step_count, changed=False, probe_ms=probe_ms,
                                                    step_ms=self.trader.running_step_ms())
            return None
        noise, self.noise = self.noise, None
        return self.trader.measured(step_count, changes, probe_ms, noise)

    def _all_rank_mean(self, values: list[float]) -> list[float]:
        tensor = torch.tensor(values, dtype=torch.float64, device=comm_device(self.step.control_group))
        dist.all_reduce(tensor, group=self.step.control_group)
        return (tensor / self.step.world_size).tolist()

    def after_step(self, loss: torch.Tensor, args: tuple, kwargs: dict,
                   step_seconds: float | None = None) -> PreserverEvent | None:
        """Called after every step with the step's inputs and its own time (None for a step that ran a graph
        cold: not counted in the attribution budget's training time); may re-plan (through
        ``CompiledStep.switch_plan``)."""
        if step_seconds is not None:
            self.budget.count_step(step_seconds)
        value = float(loss)
        step_count = self.step.step_count  # steps done, including this one
        if self._probe is not None:
            return self._during_probe(value, step_count)
        # a window averages its finite losses: one NaN or inf loss (a bad batch, a term without parameters) is not
        # the plan's divergence, a window of nothing else is (its mean is inf: a signal that steps down)
        if math.isfinite(value):
            self._recent_losses = (self._recent_losses + [value])[-self.config.probe_window :]
            self._loss_sum += value
            self._loss_count += 1
        event = None
        self._keep_since_best(args, kwargs)
        if self._before is not None and not self.step.last_call_moved_weights:
            # No weight moved in this call (the first call of a plan that moves its updates into the next call,
            # or a skipped update): the gradient change is zero by construction, not a measured price of zero.
            # The trade's measurement moves to the next call (the veto mode's waits for its next due step); every
            # rank runs the same plan and sees the same inf/NaN flag, so every rank skips alike.
            self._before = None
            self.preserver.probes.postpone(1)
        if self._before is not None and self.config.trade:
            started = time.perf_counter()
            changes, probe_ms = self._parameter_changes(args, kwargs)
            self._before = None
            self.probe_seconds += time.perf_counter() - started
            event = self._trade(step_count, changes, probe_ms)
        elif self._before is not None:
            started = time.perf_counter()
            errors = self._staleness_errors(args, kwargs)
            self._before = None
            self.probe_seconds += time.perf_counter() - started
            event = self.preserver.observe_staleness(step_count, errors)
            if event is not None:
                self._apply(event, step_down=False)
        if event is None and self.config.trade:
            event = self.trader.after_step(args, kwargs)
        if event is None and step_count % self.config.check_every == 0:
            mean = self._loss_sum / self._loss_count if self._loss_count else math.inf
            means = self._all_rank_mean([mean] + self.budget.numbers())
            self._loss_sum, self._loss_count = 0.0, 0
            event = self._on_loss_window(step_count, means[0], self.budget.agreed(means[1:]))
        if (
            event is None
            and self.config.probe_every > 0
            and step_count % self.config.probe_every == 0
            and not self.preserver.exhausted
            and len(self._recent_losses) == self.config.probe_window
        ):
            self._probe = {"plan_losses": list(self._recent_losses), "sync_losses": [], "options": self.preserver.options}
            self.step.switch_plan({**self.preserver.options, "max_staleness": 0, "allow_period": False},
                                  "Preserver probe: synchronous reference window")
        return event

    def _on_loss_window(self, step_count: int, mean_loss: float, agreed: AttributionBudget) -> PreserverEvent | None:
        """A loss window ended: on a signal, step down unless the rise is not staleness's: nothing stale ran
        since the best window, or (``attribute_loss``) the paired replay of those steps says so, if the replay
        fits the attribution budget (``agreed``: every rank's numbers averaged, so all decide alike). A loss
        that is not finite steps down at once."""
        best = self.preserver.best_loss
        signal = self.preserver.loss_signal(step_count, mean_loss)
        if signal is None:
            if self.preserver.best_loss != best:  # a new best window: the replay starts here
                self._restart_since_best(agreed)
            return None
        since = self._since_best
        if signal.finite and not self._stale_since_best:
            self.preserver.dismiss(step_count, signal, "no step since the best window ran a delay or an update period")
            self._restart_since_best(agreed)
            return None
        event = None
        if signal.finite and since is not None and since["batches"]:
            lagged, evaluate_on = replay_shape(since)
            trained, evaluated = len(since["batches"]) + lagged, 2 * evaluate_on  # both arms
            predicted = agreed.replay_seconds(trained, evaluated)
            if agreed.affords(predicted):
                started = time.perf_counter()
                stale, synchronous = self._paired_replay(since, lagged, evaluate_on)
                self.budget.replayed(time.perf_counter() - started, trained, evaluated)
                event = self.preserver.attribute(signal, step_count, stale, synchronous, len(since["batches"]))
                if event is None:
                    self._restart_since_best(agreed)
            else:
                event = self.preserver.act_on(dataclasses.replace(
                    signal, reason=f"{signal.reason}; no paired replay: {self._over_budget(agreed, predicted)}"))
        else:
            why = f"; no paired replay: {self._no_copy_because}" if signal.finite and self._no_copy_because else ""
            event = self.preserver.act_on(dataclasses.replace(signal, reason=signal.reason + why))
        if event is not None:
            self._apply(event)
            self._restart_since_best(agreed)
        return event

    @staticmethod
    def _over_budget(agreed: AttributionBudget, seconds: float) -> str:
        share = (agreed.spent_seconds + seconds) / max(agreed.training_seconds, 1e-9)
        return (f"{seconds:.3g} s more would take the loss attribution to {share:.1%} of the {agreed.training_seconds:.3g} s "
                f"trained, over its budget of {agreed.share:.0%} (attribution_budget)")

    def _restart_since_best(self, agreed: AttributionBudget) -> None:
        """The reference point moves here (a new best window, or a decision that measures the best anew). The
        copy for a paired replay is taken lazily, before the first stale step from here: steps before it are
        synchronous in both arms alike, and a run that stays synchronous never pays for a copy. No copy is
        taken where the last one's time would exceed the attribution budget."""
        self._stale_since_best = False
        self._since_best = None
        self._copy_wanted = self._attributing()
        self._no_copy_because = ""
        if self._copy_wanted and not agreed.affords(agreed.copy_seconds):
            self._copy_wanted = False
            self._no_copy_because = f"no copy of the state was taken at the best window: {self._over_budget(agreed, agreed.copy_seconds)}"

    def _copy_before_first_stale_step(self) -> None:
        if not self._copy_wanted or self._probe is not None or not self.step.updates_at(self.step.step_count):
            return
        if not self._schedule_in_force():
            return
        started = time.perf_counter()
        self._since_best = {"snapshot": Snapshot(self.step.model, self.step.optimizer), "batches": [], "schedules": []}
        self._copy_wanted = False
        self.budget.copy_seconds = time.perf_counter() - started
        self.budget.spend(self.budget.copy_seconds)

    def _schedule_in_force(self) -> Schedule:
        """The schedule of the items the step runs now (cached per item list: it changes only with the plan)."""
        items, schedule = self._schedule_of
        if items is not self.step.items:
            self._schedule_of = (self.step.items, self._running_schedule())
            items, schedule = self._schedule_of
        return schedule

    def _attributing(self) -> bool:
        """``PreserverConfig.attribute_loss``, with None resolved once: on if the copy fits ``attribution_max_bytes``."""
        if self._attribute is None:
            setting = self.config.attribute_loss
            if setting is None:
                model, optimizer = self.step.model, self.step.optimizer
                tensors = [p for p in model.parameters() if p.requires_grad] + list(model.buffers()) + [
                    v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
                setting = sum(t.numel() * t.element_size() for t in tensors) <= self.config.attribution_max_bytes
            self._attribute = bool(setting)
        return self._attribute

    def _keep_since_best(self, args: tuple, kwargs: dict) -> None:
        """After a step: note whether it ran stale, and keep its minibatch and schedule for a paired replay."""
        if not self.step.last_call_updated:
            return
        schedule = self._schedule_in_force()
        self._stale_since_best = self._stale_since_best or bool(schedule)
        since = self._since_best
        if since is None:
            return
        if len(since["batches"]) >= self.config.attribution_max_steps:
            self._since_best = None  # too long since the best: a signal is acted on unattributed
            return
        started = time.perf_counter()
        since["batches"].append(kept_batch(args, kwargs))
        since["schedules"].append(schedule)
        self.budget.spend(time.perf_counter() - started)

    def _running_schedule(self) -> Schedule:
        """Parameter name -> (delay, period) of every parameter the running items make stale (a parameter split
        over items takes the most stale of its shares)."""
        names = self.step.graph.captured.model_state.param_names  # items hold captured indices
        schedule: Schedule = {}
        for item in self.step.items:
            delay = 1 if item.apply == APPLY_NEXT_UPDATE else 0
            if delay or item.period > 1:
                for p in item.params:
                    old_delay, old_period = schedule.get(names[p], (0, 1))
                    schedule[names[p]] = (max(old_delay, delay), max(old_period, item.period))
        return schedule

    def _paired_replay(self, since: dict, lagged: int, evaluate_on: int) -> tuple[float, float]:
        """All-rank means of the stale arm's final loss and of the synchronous arm's loss its lag earlier
        (``lagged`` steps), each over the last ``evaluate_on`` minibatches."""
        batches, schedules, snapshot = since["batches"], since["schedules"], since["snapshot"]
        clip, model, loss_fn = self.step.config.max_grad_norm, self.step.model, self.step.loss_fn
        compensated = self.step.config.delayed_update == "compensated"
        stale = replay(model, snapshot, loss_fn, batches, schedules, clip, evaluate_on=evaluate_on,
                       compensated=compensated)[len(batches)]
        if lagged > 0:
            synchronous = replay(model, snapshot, loss_fn, batches, {}, clip, (lagged,), evaluate_on)[lagged]
        else:
            synchronous = loss_over(model, snapshot, snapshot.params, loss_fn, batches[-evaluate_on:])
        stale, synchronous = self._all_rank_mean([min(stale, 1e300), min(synchronous, 1e300)])
        return stale, synchronous

    def _during_probe(self, value: float, step_count: int) -> PreserverEvent | None:
        probe = self._probe
        probe["sync_losses"].append(value)
        self._since_best, self._copy_wanted = None, False  # the probe's steps are not kept: a replay would skip them
        if len(probe["sync_losses"]) < self.config.probe_window:
            return None
        self._probe = None
        window = self.config.probe_window
        means = self._all_rank_mean(probe["plan_losses"] + probe["sync_losses"])
        event = self.preserver.observe_probe(step_count, means[:window], means[window:])
        if event is not None:
            self._apply(event)
        else:
            self.step.switch_plan(self.preserver.options, "Preserver probe over: back to the plan")
        self._recent_losses = []
        return event

    def _apply(self, event: PreserverEvent, step_down: bool = True) -> None:
        """Switch to the event's plan, past the ladder levels ``step_down_past`` skips (``step_down``); the level
        that switches names the event's cause. A pinning that leaves the plan as it is changes nothing."""
        current = _schedule(self.step.plan)
        if step_down:
            step_down_past(self.step, self.preserver, event)
        if _schedule(self.step.solve(self.preserver.options)) != current:
            self.step.switch_plan(self.preserver.options, self.preserver.history[-1].reason)


def replay_shape(since: dict) -> tuple[int, int]:
    """A paired replay's shape: the synchronous arm's steps (the stale arm's less its lag) and the minibatches each
    arm is evaluated on."""
    batches = since["batches"]
    return max(0, len(batches) - lag_steps(since["schedules"])), min(len(batches), _REPLAY_EVALUATION_BATCHES)


def step_down_past(step: WatchedStep, preserver: Preserver, event: PreserverEvent) -> None:
    """Step down the ladder past every level whose plan is the running one, or staler than it (``staler``: a
    level's cap on the update period can make periods cheaper than the running plan's none)."""
    running, current = step.plan, _schedule(step.plan)
    while not preserver.exhausted:
        plan = step.solve(preserver.options)
        same = _schedule(plan) == current
        if not same and not staler(plan, running):
            return
        why = "did not change" if same else "would delay or skip more updates"
        preserver._step_down(event.step, f"{event.reason}; the plan {why} at that level", event.metrics)


def staler(plan: Plan, than: Plan) -> bool:
    """Whether ``plan`` delays some parameter more, or gives it a longer update period, than ``than`` does: what a
    step down the ladder must never do."""
    before = than.param_schedule()
    return any(delay > before.get(p, (0, 1, 0))[0] or period > before.get(p, (0, 1, 0))[1]
               for p, (delay, period, _offset) in plan.param_schedule().items())


def _schedule(plan: Plan) -> list[dict]:
    """What runs: a plan's items. Options (and so the hash) change with every decision; the items may not."""
    return [item.to_dict() for item in plan.items]


def rank_gradient_norms(step: WatchedStep, watched: list[int], kept: dict[int, torch.Tensor]) -> list[float]:
    """Per watched captured index, this rank's squared gradient norm on its own batch, then the squared norm of the
    ranks' mean gradient (one float32 all-reduce of the kept gradients' sample on the control group): what
    ``pricing.noise_ratios`` compares. A parameter without a gradient on this rank (unused by its batch) sends
    zeros, so every rank all-reduces the same length.

    Both norms are taken over the same elements (``noise_sample``): about ``NOISE_SAMPLE_ELEMENTS`` of a large
    model's, every ``stride``-th element of each tensor. A noise ratio is a ratio of sums over a tensor's
    elements, and a strided sample estimates both sums in one proportion, while the all-reduce sends a fixed
    number of bytes on a slow link, not the model's gradient."""
    params = step.graph.captured.model_state.params
    grads = [kept[p].detach().reshape(-1).float() if kept.get(p) is not None else
             torch.zeros(params[p].numel(), dtype=torch.float32, device=params[p].device) for p in watched]
    grads = noise_sample(grads)
    local = [float(g.double().square().sum()) for g in grads]
    flat = (torch.cat(grads) if grads else torch.zeros(0)).to(comm_device(step.control_group))
    dist.all_reduce(flat, group=step.control_group)
    flat /= step.world_size
    mean = [float(part.double().square().sum()) for part in flat.split([g.numel() for g in grads])]
    return local + mean


def noise_sample(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """The elements of flat gradients the noise measurement compares, the same on every rank: every ``stride``-th
    element of each tensor. ``stride`` is the smallest prime at least total / ``NOISE_SAMPLE_ELEMENTS``, lowered for
    a tensor to keep at least ``NOISE_SAMPLE_LEAST`` of its elements (1: every element). So the sample holds at most
    ``NOISE_SAMPLE_ELEMENTS`` + ``NOISE_SAMPLE_LEAST`` × tensors elements, and a prime stride walks every column of
    a row whose width it does not divide. A gradient that is non-zero on few rows (an embedding's) is sampled on
    about 1 / stride of their elements, as any other."""
    from sympy import nextprime, prevprime  # loaded by torch's shape analysis already

    total = sum(g.numel() for g in grads)
    stride = int(nextprime(-(-total // NOISE_SAMPLE_ELEMENTS) - 1)) if total > NOISE_SAMPLE_ELEMENTS else 1

    def least_kept(numel: int) -> int:  # the largest prime stride that keeps NOISE_SAMPLE_LEAST elements; 1 if none
        most = numel // NOISE_SAMPLE_LEAST
        return int(prevprime(most + 1)) if most >= 2 else 1

    return [g[::min(stride, least_kept(g.numel()))] for g in grads]


def measure_step(step: WatchedStep, watched: list[int], before: list[torch.Tensor] | None, args: tuple, kwargs: dict,
                 *, trade: bool, wire_dtypes: list[str] | None,
                 keep: bool = False) -> tuple[dict[int, tuple[float, float]], list[float], dict[int, torch.Tensor]]:
    """One measurement on this rank: per watched captured index (‖Δg‖², ‖g‖²) between the weights ``before`` and
    the step's (none where ``before`` is None: one pass at the step's weights, for the wire alone), priced in the
    optimizer's metric and at the scheduler's base rate in ``trade`` mode (``staleness.update_metric``,
    ``rate_scales``); with ``wire_dtypes``, the cast error norms of that gradient (``wire_error``); and the
    gradients at the weights the step computed with, by index (kept where ``wire_dtypes`` or ``keep``)."""
    state = step.graph.captured.model_state
    metric, by_tensor = None, None
    if trade:  # prices in the optimizer's own metric (Adam: √P-weighted); the veto thresholds are not
        by_tensor = update_metric(step.optimizer)
        metric = {i: by_tensor[state.params[i]] for i in watched if state.params[i] in by_tensor}
    gradients: dict[int, torch.Tensor] | None = {} if wire_dtypes or keep else None
    buffers = dict(zip(state.buffer_names, state.buffers))
    if before is None:  # the wire only: this step's gradient at the weights it left
        change: dict[int, tuple[float, float]] = {}
        grads = batch_gradients(step.model, state.param_names, state.params, buffers, step.loss_fn, args, kwargs,
                                watched)
        gradients = {p: g for p, g in zip(watched, grads) if g is not None}
    else:
        change = same_batch_gradient_change(step.model, state.param_names, before, state.params, buffers,
                                            step.loss_fn, args, kwargs, watched, metric, keep=gradients)
    if trade and change:  # priced at the scheduler's base rate (``staleness.rate_scales``)
        scales = rate_scales(step.optimizer)
        change = {p: (moved * scales.get(state.params[p], 1.0) ** 2, size) for p, (moved, size) in change.items()}
    wire_row: list[float] = []
    if wire_dtypes:  # the 16-bit wire's error on this gradient (preserver.wire_error)
        chosen = [gradients.get(p) for p in watched]
        weights = metric_weights(step.optimizer, [state.params[p] for p in watched], chosen, by_tensor)
        wire_row = cast_error_norms(chosen, step.world_size, wire_dtypes, weights)
    return change, wire_row, gradients or {}
