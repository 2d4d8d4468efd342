"""Closed-loop planning on the running step: time the plan that runs, agree on the times across ranks, and carry
out what ``deft_compile.planner.closed_loop`` decides (observe → trial → duel → settled; the rules, and why, are
that module's docstring).

What is measured here, where it runs:

- a window: ``warmup_steps`` unmeasured steps after a plan change, then ``measure_steps`` steps (whole update
  periods; stretched to ``min_window_ms`` of agreed time), each step's time on the step's device clock
  (``deft_compile.timing``: read once per window), whether it ran a graph cold, and the step thread's CPU and
  run-queue ms (``step.thread_clock``, on a CPU host);
- a duel block: one unmeasured step after the switch, then ``Duel.block_steps`` measured steps;
- a re-check: one window every ``recheck_every`` steps of a settled plan with delays or periods.

Every window and block ends in one all-reduce (MAX) on the step's control group, so every rank decides alike at
the same step. Each decision is appended to the step's ``plan_history`` (key ``closed_loop``) and logged.
Tests and experiments can add time to a plan's measured steps with ``ClosedLoop.inject``.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, Protocol

from deft_compile.planner.closed_loop import (
    REWIRED_DUEL,
    SYNCHRONOUS_DUEL,
    ClosedLoopConfig,
    Duel,
    MeasureAlone,
    Settle,
    StartDuel,
    adjust_options,
    after_replan,
    candidates_record,
    choose_synchronous,
    clocks_measured,
    decide,
    duel_block_steps,
    duel_verdict,
    fastest_synchronous,
    is_synchronous,
    max_period,
    measure_window,
    measured_times,
    plan_step_ms,
    priority_schedule_for,
    refined_plan,
    retire_for_replan,
    settle_between,
    rounds_disagree,
    trial_queue,
    window_steps,
    worst_gap,
)
from deft_compile.planner.refine import Refinement, refine_profile, thread_ms_of
from deft_compile.timing import Elapsed, comm_device, resolve_ms

log = logging.getLogger("deft_compile")


class PlannedStep(Protocol):
    """What the closed loop reads from and asks of the step it plans (``StepPlanning`` provides it)."""

    plan: Any
    profile: Any  # the loop replaces it with the refined profile
    policy: str
    plan_switches: int
    plan_history: list[dict[str, Any]]
    step_count: int
    process_group: Any
    control_group: Any  # for the loop's all-reduces: beside the gradients in flight
    loss_scaler: Any

    def switch_plan(self, options: dict[str, Any], reason: str, plan: Any = None, record: bool = True) -> None: ...

    def solve(self, options: dict[str, Any]) -> Any: ...

    def solver_options(self) -> dict[str, Any]: ...


class Window:
    """The steps of one measurement window: their times on the step's clock, whether each ran a graph cold (left
    out of the plan's time), and the step thread's CPU and run-queue ms per step where read."""

    def __init__(self) -> None:
        self.times: list[Elapsed] = []
        self.cold: list[bool] = []
        self.cpu: list[float] = []
        self.queued: list[float] = []
        self.length: int | None = None  # the window's steps once stretched (``min_window_ms``)

    def add(self, ms: Elapsed, cold: bool, cpu_ms: float | None, queue_ms: float | None) -> None:
        """One step's time and its thread's clocks. A run-queue delay read on the host's clock is at most the
        step's time: the kernel charges a wait when the thread is next scheduled, so a wait that began before the
        step's first clock read would otherwise count in full against this step."""
        if queue_ms is not None and isinstance(ms, (int, float)):
            queue_ms = min(queue_ms, float(ms))
        self.times.append(ms)
        self.cold.append(cold)
        if cpu_ms is not None:
            self.cpu.append(cpu_ms)
        if queue_ms is not None:
            self.queued.append(queue_ms)

    def thread_samples(self) -> dict[str, list[float]]:
        """The step thread's samples that cover every step of the window, by name (``cpu``, ``queue``)."""
        return {name: samples for name, samples in (("cpu", self.cpu), ("queue", self.queued))
                if len(samples) == len(self.times)}


class ClosedLoop:
    """Measures one step's plans and carries out the closed loop's decisions (see the module docstring)."""

    def __init__(self, config: ClosedLoopConfig) -> None:
        self.config = config
        self.state = "observe"
        self.inject: Callable[[Any], float] | None = None  # extra ms added to a plan's measured steps
        self.measured: dict[str, tuple[Any, float]] = {}  # plan hash -> (plan, agreed measured ms)
        # plan hash -> agreed CPU ms per step of the step's thread, from its sequential window (``compute_floor``)
        self.compute_cpu: dict[str, float] = {}
        # plan hash -> agreed run-queue ms per step of the step's thread, from the same window (``measured_contention``)
        self.run_queue: dict[str, float] = {}
        self.min_compute = 0.0  # the refinement's least compute factor (``compute_floor``), once refined
        self.refinement: Refinement | None = None  # what the refinement fitted or measured, once it ran
        self.windows: dict[str, int] = {}  # plan hash -> steps its (latest sequential) measurement spanned
        self.synchronous_only = False
        self.duel: Duel | None = None
        self._queue: list[tuple[Any, str]] = []
        self._expect: str | None = None
        self._switches = 0  # the step's ``plan_switches`` as of the loop's own last switch (or its first step)
        self._since_change = 0
        self._window = Window()
        self._kinds: dict[str, bool] = {}  # plan hash -> synchronous (``_synchronous``)
        self._refined = False
        self._sync_pick: str | None = None  # hash of the synchronous plan chosen (``choose_synchronous``)
        self._pending = None  # a re-plan by someone else made during a ``SYNCHRONOUS_DUEL``: dueled after it
        self._initial = None  # the plan measured first: the refined re-plan solves with its options
        self.gap = 0.0
        # the priority schedule (ByteScheduler's, US-Byte's) of the plan settled on (``priority_schedule_for``):
        # later deft re-plans carry their synchronous parameters on it (``adjust_options``)
        self.priority_schedule: str | None = None
        self._kept: tuple[str, ...] = ()  # the running re-plan's ``keep_float32`` as last seen (``_retire_narrowed``)
        self._alone: MeasureAlone | None = None  # a re-plan measured alone (no duels), until decided

    @property
    def scales(self) -> tuple[float, float]:
        """(compute factor, link factor) of the refined profile; (1, 1) before any refinement."""
        return (self.refinement.compute, self.refinement.link) if self.refinement is not None else (1.0, 1.0)

    def measured_times(self):
        """The measured plan times the Preserver judges delays by (``planner.closed_loop.MeasuredTimes``)."""
        return measured_times(self.measured, self._synchronous, self._sync_pick, self.state, self.synchronous_only,
                              self.config)

    # -- hooks called by the step ---------------------------------------------------------
    def adjust_options(self, options: dict[str, Any]) -> dict[str, Any]:
        """Solver options for a re-plan by someone else (``planner.closed_loop.adjust_options``)."""
        return adjust_options(options, self.synchronous_only, self.priority_schedule)

    def after_step(self, step: PlannedStep, elapsed: Elapsed, measurable: bool = True,
                   cpu_seconds: float | None = None, run_queue_seconds: float | None = None) -> None:
        """One step of ``step.plan`` took ``elapsed`` (on the step's device clock, ``deft_compile.timing``: read when
        a window or a duel's block completes, so a GPU is synchronised once per window); ``measurable=False`` if it
        ran a graph cold (its time is the compiler's, not the plan's: counted in the window, left out of the plan's
        time). ``cpu_seconds``: the step thread's CPU time in it (``time.thread_time``), which bounds the refined
        compute (``compute_floor``); ``run_queue_seconds``: the time the step thread was ready to run while another
        thread held its core (``thread_clock``), which measures the contention (``measured_contention``)."""
        if step.plan is None or step.process_group is None:
            return
        if self._expect is None:
            self._expect, self._switches = step.plan.hash(), step.plan_switches
        # someone else (the Preserver) switched: to another plan, or to the one that runs (its decision to step back
        # to the synchronous plan during a duel's synchronous block, which would otherwise go unseen and be undone
        # by the duel's verdict)
        if step.plan.hash() != self._expect or step.plan_switches != self._switches:
            self._someone_switched(step)
            return
        extra = self.inject(step.plan) if self.inject is not None else 0.0
        if self.state == "duel":
            self._duel_step(step, elapsed.plus(extra), not measurable)
            return
        if self.state == "settled":
            self._recheck_step(step, elapsed.plus(extra), not measurable)
            return
        self._since_change += 1
        if self._since_change <= self.config.warmup_steps:
            return
        measured = self._window_step(step, elapsed.plus(extra), not measurable,
                                     None if cpu_seconds is None else cpu_seconds * 1e3,
                                     None if run_queue_seconds is None else run_queue_seconds * 1e3)
        if measured is None:
            return
        self.windows[step.plan.hash()] = len(self._window.times)
        self.measured[step.plan.hash()] = (step.plan, measured)
        if self.state == "observe":
            self._after_observe(step, measured)
        else:
            self._next_trial(step)

    def _someone_switched(self, step: PlannedStep) -> None:
        self._switches = step.plan_switches
        self._new_window(step.plan.hash())
        if self.state == "duel" and self.duel.why == SYNCHRONOUS_DUEL:
            # which synchronous plan a re-plan must beat is being decided: the re-plan waits for the verdict
            self._pending = step.plan
            self.duel.restart_block()
            self._switch(step, self.duel.current, "closed loop duel", record=False)
            return
        if self.state in ("settled", "duel") or self._alone is not None:  # a re-plan measured alone: a new re-plan
            pending = self._alone.then if self._alone is not None else ()  # still to measure: it carries over
            self.duel, self.state, self._alone = None, "settled", None
            self._after_replan(step, pending)

    def _after_replan(self, step: PlannedStep, pending: tuple = ()) -> None:
        stand_in = self._retire_narrowed(step, pending)
        self._apply(step, after_replan(step.plan, self.measured, self._synchronous, self._sync_pick, self.config,
                                       stand_in))

    def _retire_narrowed(self, step: PlannedStep, pending: tuple = ()):
        """Where the re-plan keeps more parameters float32, forget the measured plans that narrow one of them; the
        stand-in of the synchronous plan chosen, if that was one, or of the one ``pending`` (``retire_for_replan``)."""
        kept = tuple(step.plan.options.get("keep_float32", ()))
        if kept == self._kept:
            return pending[0] if pending else None
        self._kept = kept
        self.measured, stand_in = retire_for_replan(self.measured, step.plan, step.profile, kept, step.policy,
                                                    self._synchronous, self._sync_pick, step.solve, pending)
        self._sync_pick = stand_in.hash() if stand_in is not None else self._sync_pick
        return stand_in

    # -- measuring ----------------------------------------------------------------------------
    def _new_window(self, plan_hash: str | None) -> None:
        """Start counting (warm-up, window, re-check interval) afresh for the plan ``plan_hash``."""
        self._expect, self._since_change, self._window = plan_hash, 0, Window()

    def _synchronous(self, plan) -> bool:
        """``is_synchronous`` once per plan: asked on every settled step, over plans of up to hundreds of items."""
        key = plan.hash()
        if key not in self._kinds:
            self._kinds[key] = is_synchronous(plan)
        return self._kinds[key]

    def _window_step(self, step: PlannedStep, ms: Elapsed, cold: bool, cpu_ms: float | None = None,
                     queue_ms: float | None = None) -> float | None:
        """Add one step to the current window; the plan's agreed time once the window is complete, else None.
        With the step thread's CPU ms (run-queue ms) given for every step of the window, their agreed value (the
        same statistic, one all-reduce with the time) becomes the plan's ``compute_cpu`` (``run_queue``) once the
        window is complete."""
        window = self._window
        window.add(ms, cold, cpu_ms, queue_ms)
        planned = window.length or measure_window(step.plan, self.config.measure_steps)
        if len(window.times) < planned:
            return None
        period = max_period(step.plan)
        threads = window.thread_samples()
        agreed = self._agree(step, plan_step_ms(resolve_ms(window.times), period, window.cold),
                             *(plan_step_ms(samples, period, window.cold) for samples in threads.values()))
        measured, thread_ms = agreed[0], dict(zip(threads, agreed[1:]))
        # the agreed time says whether the window spans enough time (the same on every rank); asked again at the
        # stretched length, since the first steps after a switch run slower and stretch it too little
        stretched = window_steps(measured, planned, period, self.config.min_window_ms, self.config.max_window_steps)
        if stretched > planned:
            window.length = stretched
            log.info("closed loop: %.2f ms steps, window stretched from %d to %d steps (min_window_ms %.0f)",
                     measured, planned, stretched, self.config.min_window_ms)
            return None
        if "cpu" in thread_ms:
            self.compute_cpu[step.plan.hash()] = thread_ms["cpu"]
        if "queue" in thread_ms:
            self.run_queue[step.plan.hash()] = thread_ms["queue"]
        return measured

    def _recheck_step(self, step: PlannedStep, ms: Elapsed, cold: bool) -> None:
        """Settled on a plan with delays or periods: every ``recheck_every`` steps, time one window of it; if it
        runs more than ``recheck_margin`` slower than when it was chosen, duel it against the fastest
        synchronous plan again. Why: the choice was made under the load of that moment (another job on the host,
        the other rank's data), and a plan that overlaps more loses more when the cores get busy."""
        plan = step.plan
        if (not self.config.recheck_every or self._synchronous(plan) or plan.hash() not in self.measured
                or not any(self._synchronous(p) for p, _ in self.measured.values())):
            return
        self._since_change += 1
        if self._since_change <= self.config.recheck_every:
            return
        measured = self._window_step(step, ms, cold)
        if measured is None:
            return
        self._new_window(self._expect)
        chosen = self.measured[plan.hash()][1]
        if measured <= chosen * (1.0 + self.config.recheck_margin):
            log.debug("closed loop re-check: %.1f ms, %.1f ms when chosen: kept", measured, chosen)
            return
        self._note(step, f"closed loop re-check: the plan measured {measured:.1f} ms, {chosen:.1f} ms when chosen: "
                   "duel again", plan, measured, float(plan.predicted_iteration_ms or 0.0), chosen_ms=chosen)
        self._start_duel(step, plan, self._fastest_synchronous()[0], "re-check")

    def _agree(self, step: PlannedStep, *values: float) -> list[float]:
        """Every rank's maximum of each value (one all-reduce): the slower rank sets the step."""
        import torch
        import torch.distributed as dist

        tensor = torch.tensor(values, dtype=torch.float64, device=comm_device(step.control_group))
        # on the control group: on the data-parallel group this would wait for the gradients still in flight
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=step.control_group)
        return tensor.tolist()

    # -- trials ---------------------------------------------------------------------------------
    def _after_observe(self, step: PlannedStep, measured: float) -> None:
        plan = step.plan
        predicted = float(plan.predicted_iteration_ms or 0.0)
        self.gap = abs(measured - predicted) / measured if measured > 0 else 0.0
        self._note(step, "closed loop: measured the initial plan", plan, measured, predicted, gap=self.gap,
                   window_steps=self.windows.get(plan.hash()))
        self._initial = plan
        self._queue = trial_queue(step.policy, plan, step.profile, self.measured, self._synchronous, self.config,
                                  step.solve, loss_scaled=step.loss_scaler is not None)
        self.state = "trial"
        self._next_trial(step)

    def _next_trial(self, step: PlannedStep) -> None:
        if not self._queue and not self._refined:  # every candidate measured: refine once, on the worst miss
            self.gap = max(self.gap, worst_gap(step.profile, self.measured))
            thread_ms = thread_ms_of(self.measured, self.compute_cpu, self.run_queue)
            if self.gap > self.config.tolerance or clocks_measured(self.config, thread_ms):
                self._refined = True
                refined = self._refined_plan(step)
                if refined is not None and refined.hash() not in self.measured:
                    self._queue.append((refined, "re-planned on the refined profile"))
        if self._queue:
            plan, why = self._queue.pop(0)
            self._switch(step, plan, f"closed loop trial: {why}")
            return
        self._decide(step)

    def _refined_plan(self, step: PlannedStep):
        """Refine the step's profile from the measured plans (``planner.refine.refine_profile``) and re-solve with
        hysteresis; None when that gives the initial or the running plan."""
        result = refine_profile(step.profile, self.measured, self.compute_cpu, self.run_queue,
                                measure_contention=self.config.measure_contention,
                                fit_contention=self.config.fit_contention)
        fitted = self.refinement = result.refinement
        self.min_compute = result.min_compute
        step.profile = result.profile
        initial = self._initial or step.plan
        refined = refined_plan(step.profile, step.policy, initial, step.solver_options())
        if fitted.run_queue_share is not None:
            log.info("closed loop: refined profile from the step thread's clocks (compute x%.2f, run-queue share "
                     "%.2f, contention %.2f) and the times (link x%.2f per byte, x%.2f per message; fit error "
                     "%.1f%%)", fitted.compute, fitted.run_queue_share, fitted.contention, fitted.link,
                     fitted.latency, 100 * fitted.error)
        else:
            log.info("closed loop: refined profile (compute x%.2f, at least x%.2f by the step thread's CPU time; "
                     "link x%.2f, contention %.2f %s, fit error %.1f%%)", fitted.compute, self.min_compute,
                     fitted.link, fitted.contention, "fitted" if result.fitted_contention else "kept",
                     100 * fitted.error)
        if refined.hash() in (initial.hash(), step.plan.hash()):
            return None
        return refined

    # -- decisions ------------------------------------------------------------------------------
    def _decide(self, step: PlannedStep) -> None:
        """Every candidate measured one after the other: choose the synchronous plan (a duel when that is close),
        then duel the best plan with delays against it, or settle. After a re-plan measured alone, between the plans
        it names (``MeasureAlone.between``)."""
        alone, self._alone = self._alone, None
        if alone is not None and alone.between:
            decision = settle_between(self.measured, alone.between, self._synchronous, self.config)
            self._sync_pick = decision.plan.hash()
            self._apply(step, decision)
            return
        if self._sync_pick is None:
            choice = choose_synchronous(self.measured, self._synchronous, self.config)
            if isinstance(choice, StartDuel):
                self._apply(step, choice)
                return
            self._sync_pick = choice
        self._apply(step, decide(self.measured, self._synchronous, self._sync_pick, self.config))

    def _apply(self, step: PlannedStep, decision: Settle | StartDuel | MeasureAlone | None) -> None:
        if isinstance(decision, Settle):
            self._settle(step, decision.plan, decision.ms, decision.why, **decision.extra)
        elif isinstance(decision, StartDuel):
            self._start_duel(step, decision.challenger, decision.incumbent, decision.why)
        elif isinstance(decision, MeasureAlone):  # no duel configured: measure alone, and refine nothing after
            self.state, self._alone, self._refined = "trial", decision, True
            self._queue = [(plan, "measured alone after a re-plan (no duels)") for plan in decision.then]

    def _fastest_synchronous(self):
        return fastest_synchronous(self.measured, self._synchronous, self._sync_pick)

    def _settle(self, step: PlannedStep, plan, ms: float, why: str, **extra: Any) -> None:
        self.synchronous_only = self._synchronous(plan) and any(not self._synchronous(p)
                                                                for p, _ in self.measured.values())
        self.priority_schedule = priority_schedule_for(plan, step.policy, len(step.profile.links), self.measured,
                                                       self._synchronous, self._sync_pick, self.config)
        self.state = "settled"
        self.duel = None
        self._new_window(self._expect)  # re-checks count from here
        extra = {"candidates": candidates_record(step.profile, self.measured, self._synchronous, self.compute_cpu,
                                                 self.run_queue), **extra}
        if plan.hash() != step.plan.hash():
            self._switch(step, plan, f"closed loop: {why} ({ms:.1f} ms)", **extra)
        else:
            self._note(step, f"closed loop: {why} ({ms:.1f} ms), kept", plan, ms,
                       float(plan.predicted_iteration_ms or 0.0), **extra)

    # -- the duel ---------------------------------------------------------------------------------
    def _start_duel(self, step: PlannedStep, challenger, incumbent, why: str) -> None:
        block = duel_block_steps(self.measured, challenger, incumbent, self.config)
        self.duel = Duel.between(challenger, incumbent, self.config.duel_rounds, why, block_steps=block)
        # the times it was called on, plan hash -> agreed ms (the duel's own times replace them in ``measured``)
        self.duel.sequential = {h[:12]: round(ms, 3) for h, (_plan, ms) in self.measured.items()}
        self.state = "duel"
        log.info("closed loop: duel (%s) of %s against %s, %d interleaved rounds", why, challenger.hash()[:12],
                 incumbent.hash()[:12], self.config.duel_rounds)
        if self.duel.current.hash() != step.plan.hash():
            self._switch(step, self.duel.current, "closed loop duel", record=False)

    def _duel_step(self, step: PlannedStep, ms: Elapsed, cold: bool = False) -> None:
        duel = self.duel
        duel.steps += 1
        if duel.steps == 1:  # the step after a switch: a new graph, delayed items without pending gradients
            return
        duel.times.append(ms)
        duel.cold.append(cold)
        period = max_period(step.plan)
        if len(duel.times) < period * math.ceil(duel.block_steps / period):
            return
        duel.medians.append(self._agree(step, plan_step_ms(resolve_ms(duel.times), period, duel.cold))[0])
        duel.block, duel.steps, duel.times, duel.cold = duel.block + 1, 0, [], []
        if duel.block == len(duel.order):
            ratios = duel.ratios()  # agreed medians: every rank extends alike
            if len(ratios) < self.config.duel_max_rounds and rounds_disagree(ratios, 1.0 - self.config.min_gain):
                duel.extend_to(self.config.duel_max_rounds)
                log.info("closed loop: the duel's rounds disagree (%s): %d rounds in all",
                         [round(r, 3) for r in ratios], self.config.duel_max_rounds)
        if duel.block < len(duel.order):
            if duel.current.hash() != step.plan.hash():
                self._switch(step, duel.current, "closed loop duel", record=False)
            return
        won, verdict, record = duel_verdict(duel, self.config)
        challenger, incumbent = duel.plans
        self.measured[challenger.hash()] = (challenger, duel.plan_ms(0))
        self.measured[incumbent.hash()] = (incumbent, duel.plan_ms(1))
        if duel.why == SYNCHRONOUS_DUEL:
            self._after_synchronous_duel(step, challenger if won else incumbent, won, verdict, record)
        elif duel.why == REWIRED_DUEL:
            winner, ms = (challenger, duel.plan_ms(0)) if won else (incumbent, duel.plan_ms(1))
            self._sync_pick = winner.hash()
            self._settle(step, winner, ms, (f"{winner.policy}'s order rebuilt on the re-plan's wires" if won else
                                            "the re-plan") + f" won the duel of synchronous plans ({verdict})", **record)
        elif won:
            self._settle(step, challenger, duel.plan_ms(0), f"plan with delays won the duel ({verdict})", **record)
        else:
            # The duel's synchronous plan runs: it was measured in the same interleaved rounds as the plan it beat,
            # while another synchronous plan's time (measured alone, earlier) is not comparable with it.
            self._settle(step, incumbent, duel.plan_ms(1), f"synchronous plan won the duel ({verdict})", **record)

    def _after_synchronous_duel(self, step: PlannedStep, winner, priority_won: bool, verdict: str,
                                record: dict) -> None:
        """The synchronous plan is chosen: go on deciding (a plan with delays to duel against it?), or, when a
        re-plan came in the meantime (the Preserver's trade), settle on the winner and treat the re-plan as made
        after settling: a plan with delays then duels the winner."""
        self._sync_pick = winner.hash()
        why = (f"{winner.policy}'s priority plan" if priority_won else "DDP's buckets") + \
            f" won the duel of synchronous plans ({verdict})"
        pending, self._pending = self._pending, None
        if pending is None:
            self._note(step, f"closed loop: {why}", winner, self.measured[winner.hash()][1],
                       float(winner.predicted_iteration_ms or 0.0), **record)
            self._decide(step)
            return
        self._settle(step, winner, self.measured[winner.hash()][1], why, **record)
        if not self._synchronous(pending):
            # no plan with delays has lost a duel yet (``_settle`` assumed so if one was measured in the trials):
            # the re-plan's own duel decides whether later re-plans stay synchronous
            self.synchronous_only = False
        if pending.hash() != step.plan.hash():
            self._switch(step, pending, "closed loop: the re-plan made during the duel of synchronous plans",
                         record=False)
            self._after_replan(step)

    # -- acting on the step -----------------------------------------------------------------------
    def _switch(self, step: PlannedStep, plan, reason: str, record: bool = True, **extra: Any) -> None:
        step.switch_plan(plan.options, reason, plan=plan, record=record)
        self._switches = step.plan_switches
        self._new_window(step.plan.hash())
        if record:
            step.plan_history[-1]["closed_loop"] = {"state": self.state, **self._profile_record(step), **extra}
            log.info("%s; measured so far: %s", reason, {h[:12]: round(ms, 3) for h, (_p, ms) in self.measured.items()})

    def _profile_record(self, step: PlannedStep) -> dict[str, Any]:
        """What the refinement made of the profile, for ``plan_history``."""
        fitted = self.refinement
        record = {"scales": list(self.scales), "min_compute": self.min_compute, "contention": step.profile.contention}
        if fitted is not None and fitted.run_queue_share is not None:
            record.update(run_queue_share=fitted.run_queue_share, latency_scale=fitted.latency)
        return record

    def _note(self, step: PlannedStep, reason: str, plan, measured: float, predicted: float, **extra: Any) -> None:
        entry = {
            "step": step.step_count,
            "plan_hash": plan.hash(),
            "reason": reason,
            "delayed_items": sum(1 for item in plan.items if item.delay),
            "max_period": max((item.period for item in plan.items), default=1),
            "closed_loop": {"measured_ms": measured, "predicted_ms": predicted, **self._profile_record(step), **extra},
        }
        step.plan_history.append(entry)
        log.info("step %d: %s: measured %.2f ms, predicted %.2f ms", step.step_count, reason, measured, predicted)
