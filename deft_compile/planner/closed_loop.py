"""Closed-loop planning's rules: which plans to measure, how long, and which measured plan runs. Pure: plans
and measured numbers in, decisions out; ``deft_compile.step.closed_loop`` measures the running step and
carries the decisions out.

The plan is solved from a profile taken once, on a few node-by-node runs and a
few timed all-reduces. When the running step differs from the simulator's
prediction by more than ``tolerance`` (allocator effects, a busy machine,
overlap the model does not capture), the plan may be wrong. The loop:

1. ``observe``: after ``warmup_steps`` (new graphs compile), time
   ``measure_steps`` steps of the current plan, or more when they span less than
   ``min_window_ms`` (short steps: the window is stretched in steps, from the
   agreed time of the first ones, so every rank stretches it alike). A step that ran a graph cold
   (Inductor compiling it, or the graph's first run before that) counts in the
   window but not in the plan's time; neither do the Preserver's measurements. Each rank takes the median of
   its step times; ranks agree on the maximum (an all-reduce MAX), so every rank
   takes the same decision at the same step.
2. ``trial``: run each candidate plan the same way: always the synchronous one
   (DDP's buckets, ``max_staleness=0``), for ``policy="deft"`` the priority plans
   (ByteScheduler's, US-Byte's: also synchronous), and, when the measurement missed the
   prediction by more than ``tolerance``, the plan re-solved on a refined
   profile. The refined profile scales compute and link costs by the two
   factors, and sets the contention (``Profile.contention``: what overlapped
   communication costs the compute beside it; opt-in, ``fit_contention``), that
   make the simulator best reproduce the measured times of the plans measured
   so far (a log-grid least squares on relative errors; the contention in
   closed form, from three plans on). The link factor is never below
   ``MIN_LINK_FACTOR``, and the compute factor never below what the step's own
   thread was measured busy (``compute_floor``: its CPU time per step, which
   leaves out the time it waits for communication). Refining is decided once
   every candidate is measured, from the worst gap among them (the priority
   plans are the ones the simulator misses most). Where the runtime reads the step
   thread's clocks (``step.thread_clock``: its CPU time and its run-queue delay, the time it
   was ready while another thread held its core), the compute and the contention are measured
   instead and only the link is fitted, per byte and per message apart (``planner.refine``,
   ``ClosedLoopConfig.measure_contention``).
   A ByteScheduler or US-Byte step (on by default for them too) has one candidate:
   its own plan, searched again (partition size and credit; split layer and scale)
   on the refined profile.
3. ``duel``: the sequential measurements above are taken minutes apart on a
   machine whose load changes (a shared host, the other rank's process), so they
   only pick the best plan with delays or periods. That plan and the fastest
   measured synchronous one then run in ``duel_rounds`` interleaved rounds, the order alternating
   (P S, S P, P S, ...): each block runs one step after the switch, unmeasured
   (its graph and a first step of delayed items differ), then ``duel_steps``
   measured steps (whole update periods; more when they would span less than
   ``min_window_ms`` by the plans' agreed sequential times). Each round gives the ratio of the two
   blocks' medians (agreed across ranks); the plan with delays is kept only if
   the median ratio is below ``1 - min_gain``. A load trend then falls on both
   plans alike, as in the benchmarks' paired rounds. Skipped when the sequential
   numbers already put the plan with delays ``duel_margin`` or more above the
   synchronous one. When the rounds disagree (some favour each plan), the duel
   runs on to ``duel_max_rounds`` rounds before the median decides.
   Which synchronous plan that is gets the same treatment: a priority plan
   (ByteScheduler's, US-Byte's) that the sequential measurements put ahead of
   DDP's buckets by ``min_gain`` or more must first win a duel against them
   (``SYNCHRONOUS_DUEL``), however far ahead it measured. Why: DDP's buckets, the initial plan, are measured
   first, while the host still settles, so a priority plan measured after them
   leads by a few percent on the order alone (on the suite's transformers in
   normal mode, priority plans that measured 0.4-16 % faster one after the other
   ran at 0.94-1.06x ``wfbp`` in interleaved rounds). A re-plan made during
   that duel (the Preserver's trade) waits for its verdict, then duels the winner.
4. ``settled``: the winner runs from then on. If the synchronous plan won,
   later re-plans (the Preserver's) keep ``max_staleness=0``. A plan with delays
   or periods is timed again every ``recheck_every`` steps and, if it runs more
   than ``recheck_margin`` slower than when it was chosen, duels again.

5. A plan someone else adopts after settling (the Preserver's trade re-plans from
   prices and the simulator) goes through the same duel against the synchronous
   plan; if it does not win, the loop switches to the synchronous plan (and later
   re-plans stay synchronous). A re-plan to a plan measured before is decided
   from that measurement at once (the Preserver's probe windows switch back and
   forth). So no plan runs for long slower than its measured synchronous
   alternative, whoever chose it. A re-plan that keeps parameters float32 (the
   Preserver priced their 16-bit wire harmful) retires every measured plan that
   sends one of them narrowed (``narrows_kept``): running it would undo that
   decision. If the synchronous plan chosen is among them, its schedule is rebuilt
   on the re-plan's wires (``synchronous_stand_in``) and measured: in a duel
   against a synchronous re-plan (``REWIRED_DUEL``; a priority order measured
   faster is not dropped for DDP's buckets because a bucket's wire changed), or as
   the plan a re-plan with delays must beat. With no duels configured
   (``duel_rounds=0``) it is measured alone after the re-plan (``MeasureAlone``):
   beside a synchronous re-plan the faster of the two runs (``settle_between``),
   and a re-plan with delays must beat it.

A plan with update periods has steps of different lengths (communication every
K-th step): its time is the median over whole K-step cycles of the cycle's mean
step, measured over at least three cycles, never the median step (which would
count only the cheap steps).

Every decision is appended to ``CompiledStep.plan_history`` (key
``closed_loop`` with the measured and predicted times) and logged.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from deft_compile.planner.simulator import coverage_rate
from deft_compile.planner.solvers import solve
from deft_compile.planner.solvers.hybrid import PRIORITY_SOLVERS, priority_plan_with_wire, wire_by_param
from deft_compile.planner.stability import predicted_ms, solve_stable
from deft_compile.planner.wire import named

log = logging.getLogger("deft_compile")


#: Plans with DDP's numbers whose waits and updates move to the next forward, input side first (docs/POLICIES.md).
PRIORITY_POLICIES = tuple(PRIORITY_SOLVERS)  # ("bytescheduler", "usbyte")
#: Policies whose steps run the closed loop by default (with a profile they measured themselves).
CLOSED_LOOP_POLICIES = ("deft",) + PRIORITY_POLICIES


@dataclass(frozen=True)
class ClosedLoopConfig:
    """Knobs of closed-loop planning (``DeftConfig.closed_loop``). Why each default is what it is, at length:
    docs/PLANNER.md, "Closed-loop planning".

    Attributes:
        enabled: run the closed loop; None: on for ``deft``, ``bytescheduler`` and ``usbyte`` when the step
            measures its own profile. None because a profile the user gives is the user's decision, not refined.
        warmup_steps: steps after a plan change that are not measured. 3 covers a new plan's graph captures
            and first runs; a later step that still runs a graph cold is left out of the plan's time anyway.
        measure_steps: the fewest steps timed per plan (their median counts; see ``min_window_ms``). 5 lets
            the median ignore one or two outliers while a trial of three plans stays short.
        min_window_ms: a window, and a duel's block, is stretched until it spans this much measured time, at
            most ``max_window_steps`` steps; 0 turns it off. 200 ms because five 4 ms steps span 20 ms, where
            one scheduler hiccup decides the median, while five of the suite's 100-500 ms steps need no stretch.
        max_window_steps: the most steps ``min_window_ms`` may stretch a window or a duel block to. 50 reaches
            200 ms with 4 ms steps and bounds the window for faster ones.
        tolerance: relative gap between a measured plan's time and its prediction above which the profile is
            refined from step times alone (a refinement from the step thread's clocks runs whatever the gap).
            0.2 because at 0.1 that fit shrinks the compute on the suite's BERT and the trades it then prices
            lose their duels.
        min_gain: the fraction of the step time by which a plan with delays must beat the synchronous plan to
            be kept. 1 % because a plan with delays costs staleness, so a tie goes to the synchronous plan. The
            priority candidates are tried only where the plan's communication could gain that much
            (``can_gain``).
        duel_rounds: interleaved rounds of the duel between the best plan with delays or periods and the
            synchronous plan (0: decide from the sequential measurements alone). 4 rounds in alternating order
            let a load trend fall on both plans alike.
        duel_steps: measured steps per plan and round (at least one whole update period), after one unmeasured
            step following the switch. 3 keeps a four-round duel to 32 steps.
        duel_margin: no duel when the sequential measurements put the plan with delays this fraction or more
            above the synchronous one. 0.25 because plans of equal speed measured one after the other on a busy
            host differ by up to about 20 %.
        duel_max_rounds: a duel whose ``duel_rounds`` rounds disagree runs on to this many rounds, and the
            median of all of them decides (at most ``duel_rounds``: never extended). 8 because four rounds of a
            few steps do not resolve a few percent on a shared host, where one duel's rounds span 0.85-1.18.
        recheck_every: settled on a plan with delays or update periods, time one window of it every this many
            steps (0: never), and duel it again against the fastest synchronous plan when it runs
            ``recheck_margin`` slower than when chosen. 200 steps because the choice was made under one
            moment's load, and one agreed all-reduce per re-check is cheap at that interval.
        recheck_margin: see ``recheck_every``. 0.15 so that only a real slowdown, not a window's noise, reopens
            the duel.
        priority_candidate: for ``policy="deft"``, also measure ByteScheduler's and US-Byte's plans as
            synchronous candidates (``PRIORITY_POLICIES``; not with loss scaling). On because they give DDP's
            numbers and hide part of the communication behind the next forward.
        fit_contention: refine ``Profile.contention`` too, fitted to the measured plans' step times (from three
            plans on); not used where ``measure_contention`` measures it. Off because three synchronous plans'
            times do not pin the contention down, and where the fit came out high the Preserver declined
            trades that pay.
        measure_contention: refine from the step thread's own clocks where it has them (``step.thread_clock``;
            ``refine_from_threads``): compute from its CPU time, contention from its run-queue delay, the link
            fitted per byte and per message; False: the fit from step times. On because measured, each plan's
            time is reproduced within a few percent where the fits from step times miss by up to 20 %.
        priority_schedule: once a priority plan is the synchronous plan settled on, ``deft``'s later re-plans
            with delays carry what they leave synchronous on its schedule (``synchronous_schedule``) instead of
            DDP's buckets. Off because it measured no faster on the suite's CNNs and slower on its transformers
            under Inductor.
    """

    enabled: bool | None = None
    warmup_steps: int = 3
    measure_steps: int = 5
    min_window_ms: float = 200.0
    max_window_steps: int = 50
    tolerance: float = 0.2
    min_gain: float = 0.01
    duel_rounds: int = 4
    duel_steps: int = 3
    duel_margin: float = 0.25
    duel_max_rounds: int = 8
    recheck_every: int = 200
    recheck_margin: float = 0.15
    priority_candidate: bool = True
    fit_contention: bool = False
    measure_contention: bool = True
    priority_schedule: bool = False

    def active_for(self, policy: str, profile_given: bool = False) -> bool:
        return self.enabled if self.enabled is not None else (policy in CLOSED_LOOP_POLICIES and not profile_given)



def max_period(plan) -> int:
    return max((item.period for item in plan.items), default=1)


def measure_window(plan, measure_steps: int) -> int:
    """Steps to time ``plan``: ``measure_steps``, or at least three whole update periods, in whole periods."""
    period = max_period(plan)
    if period == 1:
        return measure_steps
    cycles = max(3, math.ceil(measure_steps / period))
    return cycles * period


def window_steps(step_ms: float, steps: int, period: int, min_window_ms: float, max_steps: int) -> int:
    """Steps a window (or a duel block) of ``steps`` steps of ``step_ms`` each must span to cover
    ``min_window_ms`` of measured time: ``steps`` when they already do (or ``step_ms`` is no time, as an injected
    test time can be), else ``ceil(min_window_ms / step_ms)`` up to ``max_steps`` (never fewer than ``steps``),
    in whole update periods of ``period`` steps."""
    if step_ms <= 0 or step_ms * steps >= min_window_ms:
        return steps
    wanted = max(steps, min(max_steps, math.ceil(min_window_ms / step_ms)))
    return period * math.ceil(wanted / period)


def plan_step_ms(times_ms: list[float], period: int, cold: list[bool] | None = None) -> float:
    """A plan's step time from consecutive step times: the median step, or with update periods the median over
    whole ``period``-step cycles of the cycle's mean (every K-th step communicates; the median step would not).

    ``cold`` marks steps that ran a graph cold (an Inductor compile, or a graph's first run before it): they
    and their cycles are left out, unless nothing would be left. Every step still counts towards the window,
    so all ranks end a window at the same step."""
    cold = cold or [False] * len(times_ms)
    if period <= 1:
        warm = [ms for ms, c in zip(times_ms, cold) if not c]
        return statistics.median(warm or times_ms)
    starts = range(0, len(times_ms) - period + 1, period)
    cycles = [times_ms[i:i + period] for i in starts]
    warm = [cycle for i, cycle in zip(starts, cycles) if not any(cold[i:i + period])]
    return statistics.median(sum(cycle) / period for cycle in (warm or cycles))


def rounds_disagree(ratios: list[float], threshold: float) -> bool:
    """Whether a duel's rounds point both ways: some ratios below ``threshold`` (the challenger wins that round),
    some at or above it. Such a duel runs on to ``duel_max_rounds``; a unanimous one is decided."""
    return any(r < threshold for r in ratios) and any(r >= threshold for r in ratios)


def is_synchronous(plan) -> bool:
    """No delays, no update periods, one link: DDP's numbers for the plan's wire (``wires``), whatever the schedule
    (wfbp, ByteScheduler, US-Byte)."""
    return all(item.delay == 0 and item.period == 1 and item.link == 0 for item in plan.items)


def wires(plan) -> dict[int, frozenset[str]]:
    """Each parameter's wire dtypes in ``plan`` (its items' ``wire_dtype``, float32 where an item has none): two
    synchronous plans give the same numbers exactly when these are equal."""
    found: dict[int, set[str]] = {}
    for item in plan.items:
        for piece in getattr(item, "slices", ()):
            found.setdefault(int(piece.param), set()).add(getattr(item, "wire_dtype", "float32"))
    return {param: frozenset(dtypes) for param, dtypes in found.items()}


#: ``Duel.why`` of the duel between a priority plan and DDP's buckets, both synchronous (which one runs as "the
#: synchronous plan"); every other duel is between a plan with delays and the synchronous plan.
SYNCHRONOUS_DUEL = "synchronous"
#: ``Duel.why`` of the duel between the synchronous plan chosen, rebuilt on a synchronous re-plan's wires
#: (``synchronous_stand_in``), and that re-plan: both synchronous, the winner becomes the synchronous plan.
REWIRED_DUEL = "rewired"
SYNCHRONOUS_DUELS = (SYNCHRONOUS_DUEL, REWIRED_DUEL)


def narrows_kept(profile, plan, kept: Sequence[str]) -> bool:
    """Whether ``plan`` sends a parameter that ``kept`` names (``fnmatch`` patterns: a re-plan's
    ``keep_float32``) in a 16-bit dtype."""
    if not kept:
        return False
    held = set(named(profile, range(len(profile.params)), kept))
    return any(dtypes != {"float32"} for param, dtypes in wires(plan).items() if param in held)


def retired_by_wire(measured: Measured, profile, kept: Sequence[str], synchronous: IsSynchronous,
                    pick: str | None) -> tuple[list[str], Any]:
    """(the hashes of the measured plans that narrow a parameter ``kept`` names (``narrows_kept``), the synchronous
    plan chosen (``fastest_synchronous``) when it is one of them, else None). Running such a plan would undo the
    re-plan's float32 decision, so none of them stays a candidate."""
    retired = [h for h, (plan, _) in measured.items() if narrows_kept(profile, plan, kept)]
    if not any(synchronous(plan) for plan, _ in measured.values()):
        return retired, None
    chosen = fastest_synchronous(measured, synchronous, pick)[0]
    return retired, chosen if chosen.hash() in retired else None


def synchronous_stand_in(chosen, replan, profile, policy: str, synchronous: IsSynchronous,
                         solve_own: Callable[[dict], Any]):
    """The synchronous plan ``chosen``'s schedule with ``replan``'s wires: a priority plan rebuilt with each
    parameter in the wire dtype the re-plan gives it (``priority_plan_with_wire``); DDP's buckets are the re-plan
    itself when it is synchronous, else its synchronous candidate (``synchronous_candidate``)."""
    if chosen.policy in PRIORITY_POLICIES:
        return priority_plan_with_wire(profile, chosen.policy, wire_by_param(replan))
    return replan if synchronous(replan) else synchronous_candidate(policy, replan, profile, solve_own)


def retire_for_replan(measured: Measured, replan, profile, kept: Sequence[str], policy: str,
                      synchronous: IsSynchronous, pick: str | None, solve_own: Callable[[dict], Any],
                      pending: tuple = ()):
    """After a re-plan that keeps the parameters ``kept`` float32: (the measured plans without those that narrow
    one of them (``retired_by_wire``), the stand-in of the synchronous plan chosen if it was among them
    (``synchronous_stand_in``, measured next), else None). ``pending``: the stand-in an earlier re-plan queued and
    nobody measured yet; it stays the plan to measure, rebuilt where it narrows a parameter now kept."""
    retired, chosen = retired_by_wire(measured, profile, kept, synchronous, pick)
    kept_plans = {h: entry for h, entry in measured.items() if h not in retired}
    if chosen is None and pending:
        chosen = pending[0]
        if not narrows_kept(profile, chosen, kept):
            return kept_plans, chosen
    if chosen is None:
        return kept_plans, None
    log.info("closed loop: %d measured plan(s) narrow parameters the re-plan keeps float32 (%s): retired; %s's "
             "order measured again on the re-plan's wires", len(retired), ", ".join(kept), chosen.policy)
    return kept_plans, synchronous_stand_in(chosen, replan, profile, policy, synchronous, solve_own)


@dataclass
class Duel:
    """Interleaved rounds of a challenger (``plans[0]``: a plan with delays or periods; in a ``SYNCHRONOUS_DUEL`` a
    priority plan) against the incumbent (``plans[1]``: the synchronous plan; DDP's buckets)."""

    plans: tuple[Any, Any]
    why: str
    order: list[int]  # which plan each block runs: 0 1 1 0 0 1 ...
    block: int = 0
    steps: int = 0  # steps run in the current block, the unmeasured first one included
    times: list[Any] = field(default_factory=list)  # measured step times of the current block (the step's clock)
    cold: list[bool] = field(default_factory=list)  # per measured step: it ran a graph cold (left out)
    medians: list[float] = field(default_factory=list)  # agreed block medians, in block order
    block_steps: int = 1  # measured steps per block (``duel_steps``, or more for short steps: ``min_window_ms``)
    sequential: dict = field(default_factory=dict)  # plan hash[:12] -> ms measured one after the other, before it

    @classmethod
    def between(cls, challenger, incumbent, rounds: int, why: str, block_steps: int = 1) -> "Duel":
        duel = cls((challenger, incumbent), why, [], block_steps=block_steps)
        duel.extend_to(rounds)
        return duel

    @property
    def current(self):
        return self.plans[self.order[self.block]]

    def extend_to(self, rounds: int) -> None:
        """Add rounds up to ``rounds``, the order still alternating."""
        done = len(self.order) // 2
        self.order += [i for r in range(done, rounds) for i in ((0, 1) if r % 2 == 0 else (1, 0))]

    def restart_block(self) -> None:
        """Run the current block again from its unmeasured first step (someone else switched plans in it)."""
        self.steps, self.times, self.cold = 0, [], []

    def ratios(self) -> list[float]:
        """Per round: the challenger's block median over the incumbent's."""
        out = []
        for r in range(len(self.medians) // 2):
            pair = {self.order[2 * r]: self.medians[2 * r], self.order[2 * r + 1]: self.medians[2 * r + 1]}
            out.append(pair[0] / pair[1] if pair[1] > 0 else math.inf)
        return out

    def plan_ms(self, which: int) -> float:
        return statistics.median(m for m, i in zip(self.medians, self.order) if i == which)



# --------------------------------------------------------------------------------------------- decisions
#: a plan hash -> (plan, agreed measured ms) record of every plan measured so far
Measured = dict
#: whether a plan is synchronous (``is_synchronous``, usually cached per plan hash)
IsSynchronous = Callable[[Any], bool]


@dataclass(frozen=True)
class MeasuredTimes:
    """What the closed loop has measured, for the Preserver to judge delays by (``ClosedLoop.measured_times``).

    Attributes:
        plan_ms: plan hash -> agreed measured ms (a duel's interleaved times replace sequential ones).
        synchronous_ms: the synchronous plan's (``fastest_synchronous``), None before one is measured.
        settled: the loop has settled (no trial or duel under way): ``plan_ms`` of the running plan is its verdict.
        synchronous_only: a plan with delays lost to the synchronous plan on measured time.
        duel_steps: the steps of one duel (both plans, every round, the unmeasured first steps included): what a
            proposal that must win one runs on the slower plan, half of them.
    """

    plan_ms: dict[str, float]
    synchronous_ms: float | None
    settled: bool
    synchronous_only: bool
    duel_steps: int


def measured_times(measured: Measured, synchronous: IsSynchronous, pick: str | None, state: str,
                   synchronous_only: bool, config: ClosedLoopConfig) -> MeasuredTimes:
    """The closed loop's measurements as the Preserver reads them (``MeasuredTimes``)."""
    has_synchronous = any(synchronous(p) for p, _ in measured.values())
    return MeasuredTimes(
        plan_ms={h: ms for h, (_p, ms) in measured.items()},
        synchronous_ms=fastest_synchronous(measured, synchronous, pick)[1] if has_synchronous else None,
        settled=state == "settled", synchronous_only=synchronous_only,
        duel_steps=2 * config.duel_rounds * (config.duel_steps + 1))


@dataclass(frozen=True)
class Settle:
    """Run ``plan`` from now on (measured ``ms``), because ``why``; ``extra`` goes into ``plan_history``."""

    plan: Any
    ms: float
    why: str
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class StartDuel:
    """Interleaved rounds of ``challenger`` against ``incumbent`` decide (``Duel.why`` = ``why``)."""

    challenger: Any
    incumbent: Any
    why: str


@dataclass(frozen=True)
class MeasureAlone:
    """Measure the running plan on its own (no duel configured), then each plan of ``then`` in turn, then decide
    from the measurements; ``between``: the hashes of the synchronous plans the decision is between
    (``settle_between``, as a duel of synchronous plans would decide), or empty for the usual decision. No
    refinement follows these measurements: its re-plan would solve without the re-plan's kept float32 wires."""

    then: tuple = ()
    between: tuple[str, ...] = ()


def settle_between(measured: Measured, between: Sequence[str], synchronous: IsSynchronous,
                   config: ClosedLoopConfig) -> Settle:
    """The synchronous plan to run among the measured plans ``between`` (hashes; each measured): the priority plan
    where it measured ``min_gain`` faster than DDP's buckets (``choose_synchronous`` without a duel), else the
    fastest. Only these: another measured plan would undo the re-plan's wire or bring back delays it did not
    choose."""
    chosen = {h: measured[h] for h in between}
    pick = choose_synchronous(chosen, synchronous, dataclasses.replace(config, duel_rounds=0))
    plan, ms = chosen[pick] if isinstance(pick, str) else min(chosen.values(), key=lambda entry: entry[1])
    others = ", ".join(f"{p.policy} {t:.1f} ms" for h, (p, t) in chosen.items() if h != plan.hash())
    return Settle(plan, ms, f"measured alone after the re-plan, {plan.policy}'s synchronous plan runs ({ms:.1f} "
                  f"ms; {others})")


def fastest_synchronous(measured: Measured, synchronous: IsSynchronous, pick: str | None) -> tuple[Any, float]:
    """(plan, ms) of the synchronous plan to run whenever the plan is synchronous, and the one a plan with delays
    must beat (it is what runs instead, with no staleness): ``pick`` (the one ``choose_synchronous`` chose) once
    measured, else the fastest measured. A priority plan (ByteScheduler's, US-Byte's) qualifies: its measured
    time is its real one, since no collective after a step waits for the gradients it leaves in flight
    (``CompiledStep.control_group``)."""
    if pick in measured:
        return measured[pick]
    return min(((p, ms) for p, ms in measured.values() if synchronous(p)), key=lambda e: e[1])


def choose_synchronous(measured: Measured, synchronous: IsSynchronous,
                       config: ClosedLoopConfig) -> str | StartDuel | None:
    """Choose between DDP's buckets and the fastest priority plan, both measured one after the other: the chosen
    plan's hash, a ``SYNCHRONOUS_DUEL`` to run first, or None while one of the two kinds is unmeasured. DDP's
    buckets when the priority plan was not ``min_gain`` faster; otherwise the priority plan must win a duel,
    however far ahead it measured: a change of load between the windows can fake a 25 % lead on a shared host
    (GPT-2 ``mini`` at coverage rate 1: a priority plan measured at 160 ms, over 25 % ahead of DDP's buckets, then
    ran at 195 ms a step where DDP's buckets ran at 170 ms), while a duel costs a few steps of the slower plan (see
    the module docstring)."""
    synchronous_plans = [(p, ms) for p, ms in measured.values() if synchronous(p)]
    buckets = [(p, ms) for p, ms in synchronous_plans if p.policy not in PRIORITY_POLICIES]
    priority = [(p, ms) for p, ms in synchronous_plans if p.policy in PRIORITY_POLICIES]
    if not buckets or not priority:
        return None
    (base, base_ms), (challenger, challenger_ms) = (min(group, key=lambda e: e[1]) for group in (buckets, priority))
    if challenger_ms >= base_ms * (1.0 - config.min_gain):
        return base.hash()
    if config.duel_rounds <= 0:
        return challenger.hash()
    return StartDuel(challenger, base, SYNCHRONOUS_DUEL)


def decide(measured: Measured, synchronous: IsSynchronous, pick: str | None,
           config: ClosedLoopConfig) -> Settle | StartDuel:
    """Every candidate measured one after the other, the synchronous plan chosen (``pick``): duel the best plan
    with delays against the synchronous plan when the sequential numbers put them within ``duel_margin``, else
    settle on the fastest measured plan (a plan with delays only when ``min_gain`` faster)."""
    entries = list(measured.values())
    stale = [(p, ms) for p, ms in entries if not synchronous(p)]
    if len(stale) in (0, len(entries)):  # only one kind measured: nothing to duel
        best_plan, best_ms = fastest_synchronous(measured, synchronous, pick) if not stale else min(
            entries, key=lambda e: e[1])
        return Settle(best_plan, best_ms, "fastest measured plan")
    sync_plan, sync_ms = fastest_synchronous(measured, synchronous, pick)
    stale_plan, stale_ms = min(stale, key=lambda e: e[1])
    if config.duel_rounds > 0 and stale_ms < sync_ms * (1.0 + config.duel_margin):
        return StartDuel(stale_plan, sync_plan, "settle")
    best_plan, best_ms = (stale_plan, stale_ms) if stale_ms <= sync_ms * (1.0 - config.min_gain) else (sync_plan,
                                                                                                      sync_ms)
    return Settle(best_plan, best_ms, "fastest measured plan")


def after_replan(plan, measured: Measured, synchronous: IsSynchronous, pick: str | None,
                 config: ClosedLoopConfig, stand_in=None) -> Settle | StartDuel | MeasureAlone | None:
    """Someone else (the Preserver) switched to ``plan`` after the loop settled: a plan measured before is decided
    from that measurement at once, an unmeasured plan with delays duels the synchronous plan. None: ``plan``
    runs on. ``stand_in``: the synchronous plan chosen, rebuilt on the re-plan's wires (``synchronous_stand_in``)
    where the re-plan keeps float32 what that plan narrowed; unmeasured, it is measured in a duel: against a
    synchronous re-plan (``REWIRED_DUEL``) or as the synchronous plan a re-plan with delays must beat. With no
    duels configured (``duel_rounds=0``) it is measured alone after the re-plan (``MeasureAlone``)."""
    fresh = stand_in is not None and stand_in.hash() not in measured and stand_in.hash() != plan.hash()
    known = measured.get(plan.hash())
    if synchronous(plan):
        # Synchronous plans that send every parameter in the same wire dtype give the same numbers: run the
        # fastest one measured (a priority plan, say, when the Preserver steps back to synchronous and the solver
        # answers with DDP's buckets). One with another wire would undo the re-plan's wire (the Preserver sending a
        # bucket back to float32), so it is not a stand-in.
        same = {key: entry for key, entry in measured.items() if synchronous(entry[0]) and wires(entry[0]) == wires(plan)}
        if same:
            sync_plan, sync_ms = fastest_synchronous(same, synchronous, pick)
            if sync_plan.hash() != plan.hash() and (known is None or sync_ms < known[1] * (1.0 - config.min_gain)):
                return Settle(sync_plan, sync_ms, "synchronous re-plan: the fastest measured synchronous plan with "
                              "its wire runs instead (same numbers)",
                              {"replaced": {"plan_hash": plan.hash(), "measured_ms": known[1] if known else None}})
        if fresh:
            return (StartDuel(stand_in, plan, REWIRED_DUEL) if config.duel_rounds > 0
                    else MeasureAlone(then=(stand_in,), between=(plan.hash(), stand_in.hash())))
        return None
    if fresh:
        return StartDuel(plan, stand_in, "re-plan") if config.duel_rounds > 0 else MeasureAlone(then=(stand_in,))
    if not any(synchronous(p) for p, _ in measured.values()):
        return None
    sync_plan, sync_ms = fastest_synchronous(measured, synchronous, pick)
    if known is None:
        return StartDuel(plan, sync_plan, "re-plan") if config.duel_rounds > 0 else MeasureAlone()
    if known[1] > sync_ms * (1.0 - config.min_gain):
        return Settle(sync_plan, sync_ms, f"the re-plan measured {known[1]:.1f} ms, not faster than the synchronous "
                      f"plan's {sync_ms:.1f} ms: back to synchronous",
                      {"rejected": {"plan_hash": plan.hash(), "measured_ms": known[1]}})
    return None


def duel_verdict(duel: Duel, config: ClosedLoopConfig) -> tuple[bool, str, dict]:
    """(whether the challenger won, the verdict in words, the record for ``plan_history``) of a finished duel: the
    challenger wins when the median of its rounds' ratios is below ``1 - min_gain``."""
    ratios = duel.ratios()
    ratio = statistics.median(ratios)
    challenger, incumbent = duel.plans
    won = ratio < 1.0 - config.min_gain
    verdict = f"median ratio {ratio:.3f} over {len(ratios)} interleaved rounds"
    challenger_key = "priority_plan" if duel.why in SYNCHRONOUS_DUELS else "stale_plan"
    record = {"duel": {"why": duel.why, "ratios": [round(r, 4) for r in ratios], "median_ratio": round(ratio, 4),
                       challenger_key: challenger.hash(), "synchronous_plan": incumbent.hash(),
                       "block_steps": duel.block_steps, "sequential": duel.sequential}}
    return won, verdict, record


def duel_block_steps(measured: Measured, challenger, incumbent, config: ClosedLoopConfig) -> int:
    """Measured steps per duel block: ``duel_steps``, stretched to ``min_window_ms`` by the faster of the two
    plans' agreed sequential times (the same on every rank; a plan with update periods rounds its blocks up to
    whole periods as it runs)."""
    known = [measured[p.hash()][1] for p in (challenger, incumbent) if p.hash() in measured]
    return window_steps(min(known, default=0.0), config.duel_steps, 1, config.min_window_ms, config.max_window_steps)


# --------------------------------------------------------------------------------------------- candidates
def synchronous_candidate(policy: str, plan, profile, solve_own: Callable[[dict], Any]):
    """DDP's buckets, no delays or periods: the synchronous candidate every step measures (``deft``'s own solver
    with ``max_staleness=0`` through ``solve_own``; otherwise ``wfbp`` with the plan's bucket sizes and wire
    dtype)."""
    if policy == "deft":
        return solve_own({**plan.options, "max_staleness": 0, "allow_period": False})
    options = {k: v for k, v in plan.options.items() if k in ("first_bucket_bytes", "bucket_cap_bytes", "wire_dtype")}
    return solve(profile, "wfbp", **options)


def priority_plans(profile, wire_of: dict[int, str] | None = None) -> list:
    """ByteScheduler's and US-Byte's plans on ``profile``, both measured, each parameter in the wire dtype
    ``wire_of`` gives it (the initial plan's: a narrowed synchronous plan's priority rivals narrow the same
    parameters; ``hybrid.priority_plan_with_wire``).

    Why a deft step tries them: a synchronous plan that waits at the end of backward exposes the input-side
    gradients' communication every step (DESIGN.md §1). These plans send the input side first and wait for
    each layer's gradients just before that layer's forward in the next step: no staleness, DDP's numbers,
    part of the communication hidden behind the next forward. Where the Preserver finds staleness too
    costly, this is what is left to gain (measured: 0.82-0.91x DDP on the suite's CNNs in emulation).
    Both, not the one predicted faster: the simulator can miss these plans by 20-40 % and rank them wrongly
    (ResNet-50)."""
    plans = []
    for policy in PRIORITY_POLICIES:
        try:
            plans.append(priority_plan_with_wire(profile, policy, wire_of or {}))
        except ValueError as exc:  # a profile that solver cannot plan: measure the others
            log.warning("closed loop: no %s candidate: %s", policy, exc)
    return plans


def trial_queue(policy: str, plan, profile, measured: Measured, synchronous: IsSynchronous, config: ClosedLoopConfig,
                solve_own: Callable[[dict], Any], loss_scaled: bool) -> list[tuple[Any, str]]:
    """The candidates to measure after the initial ``plan``, in order, with why: the synchronous candidate (unless
    ``plan`` is synchronous), and for ``deft`` the priority plans (``priority_candidate``; not under loss
    scaling); none measured before."""
    queue = []
    if not synchronous(plan):
        queue.append((synchronous_candidate(policy, plan, profile, solve_own), "synchronous candidate"))
    if config.priority_candidate and policy == "deft" and not loss_scaled:
        if can_gain(plan, profile, config):
            queue += [(p, f"synchronous priority candidate ({p.policy})")
                      for p in priority_plans(profile, wire_by_param(plan))]
        else:
            log.info("closed loop: no priority candidates: the plan's communication, %.3g ms per step on its busiest "
                     "link (x%.2f for the profile's error), is under %.0f%% of its %.3g ms step, the least gain a "
                     "plan must show", link_load_ms(profile, plan), 1 + config.tolerance, 100 * config.min_gain,
                     predicted_ms(profile, plan))
    return [(p, why) for p, why in queue if p.hash() not in measured]


def link_load_ms(profile, plan) -> float:
    """The busiest link's communication per step under ``plan`` (``simulator.coverage_rate`` in ms): no schedule
    of the same bytes hides more than this."""
    return coverage_rate(profile, plan) * (profile.forward_ms + profile.backward_ms)


def can_gain(plan, profile, config: ClosedLoopConfig) -> bool:
    """Whether another schedule of ``plan``'s bytes could beat it by ``min_gain`` of its step: its busiest link's
    load, scaled up by ``tolerance`` for the profile's error, reaches that share. A priority plan hides
    communication and computes the same, so it gains at most that load; below it, its trial (graphs, a flush and a
    window of steps) cannot pay."""
    return (1 + config.tolerance) * link_load_ms(profile, plan) >= config.min_gain * predicted_ms(profile, plan)


def refined_plan(profile, policy: str, initial, own_options: dict[str, Any]):
    """The plan re-solved on the refined ``profile``, with hysteresis against ``initial`` (the plan measured
    first). The initial plan's options, not the last trial's: that may be the synchronous candidate (solved with
    max_staleness=0) or a priority plan (another solver's options). A priority policy's plan options are its
    search's results (partition size, credit, ...): it searches again, from the step's own options
    (``own_options``)."""
    options = own_options if policy in PRIORITY_POLICIES else dict(initial.options)
    return solve_stable(profile, policy, incumbent=initial, **options)


def worst_gap(profile, measured: Measured) -> float:
    """The largest relative gap between a measured plan's time and the simulator's prediction for it."""
    return max((abs(ms - predicted_ms(profile, plan)) / ms for plan, ms in measured.values() if ms > 0), default=0.0)


def clocks_measured(config: ClosedLoopConfig, thread_ms: list) -> bool:
    """Whether the refinement measures rather than fits (``refine_from_threads``; ``thread_ms`` as
    ``refine.thread_ms_of`` gives it): then it runs whatever the gap. ``tolerance`` keeps a fit to step times
    alone from following noise; measured, the compute and the contention come from the step thread's clocks.
    Why: gated by the gap, most of the suite's transformer launches keep the profile's contention of 0 (their
    priority plans miss by 12-20 %, under the tolerance), and a plan with delays the Preserver trades on that
    profile is predicted 21 % below its measured time on GPT-2."""
    return config.measure_contention and sum(t is not None for t in thread_ms) >= 2


def candidates_record(profile, measured: Measured, synchronous: IsSynchronous, compute_cpu: dict[str, float],
                      run_queue: dict[str, float]) -> dict[str, dict[str, Any]]:
    """Every measured plan's numbers for ``plan_history``, by short hash."""
    return {
        h[:12]: {"measured_ms": round(ms, 3), "predicted_ms": round(predicted_ms(profile, p), 3),
                 "synchronous": synchronous(p),
                 **({"compute_cpu_ms": round(compute_cpu[h], 3)} if h in compute_cpu else {}),
                 **({"run_queue_ms": round(run_queue[h], 3)} if h in run_queue else {})}
        for h, (p, ms) in measured.items()
    }


# --------------------------------------------------------------------------------------------- later re-plans
def priority_schedule_for(settled, policy: str, links: int, measured: Measured, synchronous: IsSynchronous,
                          pick: str | None, config: ClosedLoopConfig) -> str | None:
    """The priority schedule of the synchronous plan settled on, or, settling on a plan with delays, the one
    it carries or else that of the synchronous plan chosen (``fastest_synchronous``) (None for DDP's buckets).

    Why: that measurement says the next forward hides more of the synchronous communication than the end of
    backward does; a plan with delays (the Preserver's trade) leaves parameters synchronous, and carrying them
    on the same schedule keeps that gain beside the delays (``planner.solvers.hybrid``). The plan with delays
    still has to win its duel against the fastest synchronous plan. ``deft`` on one link only.
    """
    if not config.priority_schedule or policy != "deft" or links != 1:
        return None

    def schedule_of(plan) -> str | None:
        return plan.policy if plan.policy in PRIORITY_POLICIES else plan.options.get("synchronous_schedule")

    if synchronous(settled) or schedule_of(settled) is not None:
        return schedule_of(settled)
    if not any(synchronous(p) for p, _ in measured.values()):
        return None
    return schedule_of(fastest_synchronous(measured, synchronous, pick)[0])


def adjust_options(options: dict[str, Any], synchronous_only: bool, priority_schedule: str | None) -> dict[str, Any]:
    """Solver options for a re-plan by someone else (the Preserver): synchronous once that won
    (``synchronous_only``); and, once the loop settled on a priority plan, its schedule for the parameters a plan
    with delays leaves synchronous (``synchronous_schedule``, ``planner.solvers.hybrid``)."""
    if synchronous_only:
        options = {**options, "max_staleness": 0, "allow_period": False}
    if priority_schedule is not None and "synchronous_schedule" not in options:
        options = {**options, "synchronous_schedule": priority_schedule}
    return options
