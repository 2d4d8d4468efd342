"""Closed-loop planning: measure the plan that runs, refine the profile, keep the fastest measured plan.

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
   instead and only the link is fitted, per byte and per message apart (``refine_from_threads``,
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
   DDP's buckets by less than ``duel_margin`` must first win a duel against them
   (``SYNCHRONOUS_DUEL``). Why: DDP's buckets, the initial plan, are measured
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
   alternative, whoever chose it.

A plan with update periods has steps of different lengths (communication every
K-th step): its time is the median over whole K-step cycles of the cycle's mean
step, measured over at least three cycles, never the median step (which would
count only the cheap steps).

Every decision is appended to ``CompiledStep.plan_history`` (key
``closed_loop`` with the measured and predicted times) and logged.
Tests and experiments can add time to a plan's measurement with ``inject``.
"""

from __future__ import annotations

import logging
import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Callable

from deft_compile.planner.solvers.hybrid import PRIORITY_SOLVERS
from deft_compile.timing import Elapsed, comm_device, resolve_ms

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
            be kept. 1 % because a plan with delays costs staleness, so a tie goes to the synchronous plan.
        duel_rounds: interleaved rounds of the duel between the best plan with delays or periods and the
            synchronous plan (0: decide from the sequential measurements alone). 4 rounds in alternating order
            let a load trend fall on both plans alike.
        duel_steps: measured steps per plan and round (at least one whole update period), after one unmeasured
            step following the switch. 3 keeps a four-round duel to 32 steps.
        duel_margin: no duel when the sequential measurements put the plan with delays this fraction or more
            above the synchronous one; a priority plan measured this much faster than DDP's buckets is taken
            without a duel (closer, it must win one). 0.25 because plans of equal speed measured one after the
            other on a busy host differ by up to about 20 %.
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


#: simulate_parts(plan, compute factor, link factor) -> (step ms without contention, ms of overlap per step)
SimulateParts = Callable[[Any, float, float], "tuple[float, float]"]


@dataclass(frozen=True)
class Refinement:
    """What the closed loop fitted: compute and link factors, the contention, and the rms relative error left.
    ``run_queue_share`` is set when the contention was measured from run-queue delays (``measured_contention``);
    ``latency`` when the links' per-message latency got a factor of its own (``refine_from_threads``; otherwise
    ``link`` scales it with the per-byte cost)."""

    compute: float
    link: float
    contention: float
    error: float
    run_queue_share: float | None = None
    latency: float | None = None


def contention_parts(profile, plan) -> tuple[float, float]:
    """(the simulated step without contention, the time per step communication overlaps compute).

    The simulator adds ``Profile.contention`` times the second to the first (``Timeline.contention_ms``), so one
    simulation at contention 1 gives the step at every contention, and the best contention for a set of measured
    plans is a one-line least squares."""
    import dataclasses

    from deft_compile.planner.simulator import simulate

    timeline = simulate(dataclasses.replace(profile, contention=1.0), plan, record=False, check=False)
    return timeline.iteration_ms - timeline.contention_ms, timeline.contention_ms


#: the least link factor the refinement may fit. The profiler times the link alone, on an idle step, and keeps
#: the faster half of its repeats: a running step does not send faster than that. Without this floor the fit
#: trades compute against link freely on the suite's transformers (three synchronous plans measured within a
#: few percent of one another): refined profiles with compute 1.7x the floor's step and a link 4x faster, or
#: 0.6x the floor's step, on which the Preserver sees nothing to gain (docs/PLANNER.md).
MIN_LINK_FACTOR = 1.0

#: how far below the compute thread's measured CPU time the refinement may put the step's compute
#: (``compute_floor``): that time includes the step's own Python and bookkeeping, and under contention some
#: cache and memory-bandwidth loss, neither of which the profile's compute has
COMPUTE_FLOOR_SLACK = 0.1


def compute_floor(cpu_ms: list[tuple[Any, float]], compute_ms: Callable[[Any], float],
                  slack: float = COMPUTE_FLOOR_SLACK) -> float:
    """The least compute factor the measurements allow: ``(1 - slack)`` times the median, over the measured plans,
    of the step thread's CPU ms per step (``cpu_ms``: (plan, ms) pairs) over the profile's compute for that plan
    (``compute_ms(plan)``: the simulator's compute-stream time per step). 0 (no bound) without measurements.

    Why: a step's time alone cannot tell slow compute and a fast link from fast compute and a slow link when its
    plans differ in how much they overlap. On the suite in normal mode the unbounded fit takes compute 0.14-0.23x
    on ResNet-50 and 0.19x on GPT-2 (``benchmarks/results/recorded/``): a profile of almost no compute, on which
    the Preserver sees nothing to hide. The compute thread's CPU time is a direct measure: it runs the step's kernels
    (one intra-op thread, as on the suite's workers; with more, it sees only its own share, and the bound is only
    looser) and sleeps while it waits for a collective, so the time it waited, and the time another thread took
    its core, are not in it. Not on an accelerator, where the thread only launches kernels (and may spin in a
    synchronise): the runtime passes no CPU time there, and the bound is 0."""
    pairs = [(ms, compute_ms(plan)) for plan, ms in cpu_ms if ms > 0]
    ratios = [ms / compute for ms, compute in pairs if compute > 0]
    return (1.0 - slack) * statistics.median(ratios) if ratios else 0.0


def measured_contention(samples: list[tuple[float, float, float]]) -> tuple[float, float] | None:
    """(the run-queue share of compute, the contention) that explain the step thread's measured run-queue delays.

    ``samples``: per measured plan, (the step thread's CPU ms per step, its run-queue ms per step, the simulator's
    ms per step that the plan's communication overlaps compute). The model: ``run_queue = share x cpu +
    contention x overlap``. The first term is what the thread waits for its core with no communication beside it
    (another process; in accelerator emulation, the other rank's compute thread pinned to the same core, which
    the profile's compute already includes); the second is what communication beside the compute takes from it,
    the simulator's ``Profile.contention``. A non-negative least squares, contention at most 1; None with fewer
    than two plans, or none that overlaps, since then the two terms cannot be told apart.

    Why measure it: the step's time alone cannot tell what overlapped communication costs the compute from a
    slower link or slower compute. Fitted from three plans' times, the contention comes out 0 to 0.7 across
    launches of one model, and held at 0 the refinement explains the priority plans' slowness in normal mode
    with a slow link that then over-predicts DDP's buckets by about 23 % (docs/PLANNER.md).
    The kernel counts the run-queue delay directly (``step.thread_clock``)."""
    samples = [(cpu, queue, overlap) for cpu, queue, overlap in samples if cpu > 0]
    if len(samples) < 2 or not any(overlap > 0 for _, _, overlap in samples):
        return None

    def residual(share: float, contention: float) -> float:
        return sum((queue - share * cpu - contention * overlap) ** 2 for cpu, queue, overlap in samples)

    cc = sum(cpu * cpu for cpu, _, _ in samples)
    oo = sum(overlap * overlap for _, _, overlap in samples)
    co = sum(cpu * overlap for cpu, _, overlap in samples)
    cq = sum(cpu * queue for cpu, queue, _ in samples)
    oq = sum(overlap * queue for _, queue, overlap in samples)
    candidates = []
    determinant = cc * oo - co * co
    if determinant > 1e-9 * cc * oo:  # the unconstrained solution, if it is feasible
        share, contention = (cq * oo - oq * co) / determinant, (oq * cc - cq * co) / determinant
        if share >= 0.0 and 0.0 <= contention <= 1.0:
            candidates.append((share, contention))
    # otherwise on the boundary: no share, no contention, or contention 1, each with the other term's best value
    candidates.append((0.0, min(1.0, max(0.0, oq / oo))))
    candidates.append((max(0.0, cq / cc), 0.0))
    candidates.append((max(0.0, (cq - co) / cc), 1.0))
    return min(candidates, key=lambda pair: residual(*pair))


#: how strongly the refinement prefers factors near 1 (the profile as measured), in squared relative error per
#: squared log factor: doubling a factor costs as much as a 2 % rms miss. Why: the plans a step measures are
#: often close in time (three synchronous plans within a few percent), and then very different factor pairs fit
#: them about equally well. Unregularised, one GPT-2 launch takes compute 0.18x and link 1.87x (2.5 % rms)
#: where 1.27x and 1.30x fit another launch of the same model within 0.3 %: a profile with almost no compute,
#: on which the Preserver sees nothing to hide and makes no trade (``benchmarks/results/recorded/``). Among fits
#: that explain the measurements about equally, take the least change to what the profiler measured.
PRIOR_WEIGHT = (0.02 / math.log(2.0)) ** 2


def refine_scales(measured: list[tuple[Any, float]], simulate_parts: SimulateParts,
                  contention: float | None = None, fit_link: bool = True,
                  min_link: float = MIN_LINK_FACTOR, prior_weight: float = PRIOR_WEIGHT,
                  min_compute: float = 0.0) -> Refinement:
    """Compute and link factors (a, b), and the contention, minimising the squared relative error of the
    simulated times.

    ``measured``: (plan, measured ms) pairs; ``simulate_parts(plan, a, b)``: the plan's simulated time with compute
    scaled by ``a`` and link costs by ``b``, split as ``contention_parts`` splits it. ``contention``: a fixed
    value, or None to fit it in [0, 1] (for each (a, b) exactly: the time is linear in it). ``fit_link=False``
    keeps the link as measured (one plan cannot separate compute from link); ``min_link`` is the least link factor
    tried (``MIN_LINK_FACTOR``); ``min_compute`` the least compute factor (``compute_floor``: what the compute
    thread was measured busy). The fit minimises the mean squared relative error plus ``prior_weight`` times
    (ln a)² + (ln b)² (``PRIOR_WEIGHT``: near-equal fits resolve toward the profile as measured; 0 for a pure
    least-squares fit); ``Refinement.error`` is the rms relative error alone. A coarse log grid (0.125x..8x),
    then two finer ones around the best.
    """

    def evaluate(a: float, b: float) -> tuple[float, Refinement]:
        parts = [(simulate_parts(plan, a, b), ms) for plan, ms in measured]
        gamma = contention
        if gamma is None:
            weight = sum(overlap * overlap / (ms * ms) for (_, overlap), ms in parts)
            slack = sum(overlap * (ms - base) / (ms * ms) for (base, overlap), ms in parts)
            gamma = min(1.0, max(0.0, slack / weight)) if weight > 0 else 0.0
        error = _rms_miss(parts, gamma)
        return error * error + prior_weight * (math.log(a) ** 2 + math.log(b) ** 2), Refinement(a, b, gamma, error)

    return _log_grid_search(evaluate, (max(1.0, min_compute), 1.0), (min_compute, min_link), fit_link)


#: the least per-byte link factor ``refine_from_threads`` may fit. Lower than ``MIN_LINK_FACTOR``: there the
#: compute is measured, not fitted, so the link can no longer trade against it, and the profiler's per-byte cost
#: comes from messages of at most 4 MiB while DDP's buckets hold 25 MiB: on the suite's ResNet-50 in normal mode
#: the fit takes 0.75x with its three plans reproduced within 0.3 % (benchmarks/results/clock-probes).
MIN_MEASURED_LINK_FACTOR = 0.5


def refine_from_threads(measured: list[tuple[Any, float]], simulate_parts: Callable[..., "tuple[float, float]"],
                        compute_ms: Callable[[Any], float], thread_ms: list[tuple[float, float] | None],
                        prior_weight: float = PRIOR_WEIGHT,
                        min_link: float = MIN_MEASURED_LINK_FACTOR) -> Refinement | None:
    """The profile's factors from what the step thread measured, the link's from the times; None with fewer than
    two plans that have thread times (``measured_contention`` cannot separate its two terms then).

    ``thread_ms``: per entry of ``measured``, the step thread's (CPU ms, run-queue ms) per step, or None.
    ``simulate_parts(plan, compute, link, latency)``: the plan's simulated time split as ``contention_parts``
    splits it, on the profile with compute times scaled by ``compute``, the links' per-byte costs by ``link`` and
    their per-message latencies by ``latency``; ``compute_ms(plan)``: the simulator's compute-stream ms per step
    of the plan on the profile as measured.

    Three steps, each from a measurement where one exists:

    1. The run-queue share of compute and the contention, at the profile's factors (``measured_contention``).
    2. The compute factor: the median over plans of what the step thread ran (CPU ms) plus what it waited for its
       core with no communication beside it (the share of that), over the simulated compute of the plan. The
       share matters under accelerator emulation, where two ranks' compute threads take turns on one core: there
       a thread runs half its compute stream's time, and the profile, timed the same way, holds the whole.
    3. The link's per-byte and per-message factors, on a log grid (as ``refine_scales``, with its prior): the
       contention measured again at each point (the overlap moves with the link).

    Why the latency apart: plans of a few large buckets hinge on the per-byte cost, plans of many small
    partitions (ByteScheduler's 164 per step on ResNet-50) on the per-message latency; one factor for both made
    the slow partitions' time look like a slow link, which then over-predicts DDP's buckets by 21-23 % on
    ResNet-50 in normal mode (docs/PLANNER.md)."""
    if len(thread_ms) != len(measured):
        raise ValueError(f"thread_ms has {len(thread_ms)} entries for {len(measured)} measured plans")
    timed = [(plan, ms, threads) for (plan, ms), threads in zip(measured, thread_ms) if threads is not None]
    if len(timed) < 2:
        return None

    def contention_at(compute: float, link: float, latency: float):
        overlaps = [simulate_parts(plan, compute, link, latency)[1] for plan, _, _ in timed]
        return measured_contention([(cpu, queue, overlap) for (_, _, (cpu, queue)), overlap in zip(timed, overlaps)])

    first = contention_at(1.0, 1.0, 1.0)
    if first is None:
        return None
    share = first[0]
    simulated = [(cpu, compute_ms(plan)) for plan, _, (cpu, _) in timed]
    ratios = [cpu * (1.0 + share) / busy for cpu, busy in simulated if busy > 0]
    if not ratios:
        return None
    compute = statistics.median(ratios)

    def evaluate(link: float, latency: float) -> tuple[float, Refinement]:
        parts = [(simulate_parts(plan, compute, link, latency), ms) for plan, ms in measured]
        found = measured_contention([(cpu, queue, overlap) for ((_, overlap), _), threads
                                     in zip(parts, thread_ms) if threads is not None for cpu, queue in [threads]])
        queue_share, gamma = found if found is not None else (share, first[1])
        error = _rms_miss(parts, gamma)
        score = error * error + prior_weight * (math.log(link) ** 2 + math.log(latency) ** 2)
        return score, Refinement(compute, link, gamma, error, queue_share, latency)

    return _log_grid_search(evaluate, (1.0, 1.0), (min_link, min_link), True)


def _rms_miss(parts: list[tuple[tuple[float, float], float]], contention: float) -> float:
    """The rms relative miss of simulated times against measured ones: ``parts`` are ((step ms without
    contention, overlap ms), measured ms) per plan (``contention_parts``), at ``contention``."""
    return math.sqrt(sum(((base + contention * overlap - ms) / ms) ** 2 for (base, overlap), ms in parts) / len(parts))


def _log_grid_search(evaluate: Callable[[float, float], "tuple[float, Refinement]"], start: tuple[float, float],
                     least: tuple[float, float], search_second: bool) -> Refinement:
    """The best of ``evaluate(x, y)`` (score, refinement) on three log grids, each around the best point so far:
    0.125x..8x with points sqrt(2) apart, then sqrt(2) either side, then 2^(1/8) (about 1 %); neither factor
    below its ``least``, the second held at its start unless ``search_second``."""
    best_point, best = start, (math.inf, None)
    for span, points in ((8.0, 13), (math.sqrt(2.0), 9), (2 ** 0.125, 9)):
        center = best_point
        for i in range(points):
            for j in range(points if search_second else 1):
                x = max(least[0], center[0] * span ** (2 * i / (points - 1) - 1))
                y = max(least[1], center[1] * span ** (2 * j / (points - 1) - 1)) if search_second else center[1]
                score, refinement = evaluate(x, y)
                if score < best[0] - 1e-12:
                    best, best_point = (score, refinement), (x, y)
    return best[1]


def scaled_profile(profile, compute: float, link: float, contention: float | None = None,
                   latency: float | None = None):
    """``profile`` with every compute time times ``compute``, every link's β times ``link`` and α times ``latency``
    (``link`` when None), and (if given) its contention replaced."""
    from deft_compile.planner.plan import Profile

    data = profile.to_dict()
    if contention is not None:
        data["contention"] = contention
    for param in data["params"]:
        for key in ("forward_ms", "backward_ms", "update_ms"):
            param[key] *= compute
    for key in ("extra_forward_ms", "extra_backward_ms", "message_cpu_ms"):
        data[key] *= compute
    for entry in data["links"]:
        entry["alpha_ms"] *= link if latency is None else latency
        entry["beta_ms_per_byte"] *= link
    return Profile.from_dict(data)


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


def _is_synchronous(plan) -> bool:
    """No delays, no update periods, one link: DDP's numbers, whatever the schedule (wfbp, ByteScheduler, US-Byte)."""
    return all(item.delay == 0 and item.period == 1 and item.link == 0 for item in plan.items)


#: ``Duel.why`` of the duel between a priority plan and DDP's buckets, both synchronous (which one runs as "the
#: synchronous plan"); every other duel is between a plan with delays and the synchronous plan.
SYNCHRONOUS_DUEL = "synchronous"


@dataclass
class Duel:
    """Interleaved rounds of a challenger (``plans[0]``: a plan with delays or periods; in a ``SYNCHRONOUS_DUEL`` a
    priority plan) against the incumbent (``plans[1]``: the synchronous plan; DDP's buckets)."""

    plans: tuple[Any, Any]
    why: str
    order: list[int]  # which plan each block runs: 0 1 1 0 0 1 ...
    block: int = 0
    steps: int = 0  # steps run in the current block, the unmeasured first one included
    times: list[Elapsed] = field(default_factory=list)  # measured step times of the current block
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


class ClosedLoop:
    """Drives observe → trial → duel → settled for one ``CompiledStep`` (see the module docstring)."""

    def __init__(self, config: ClosedLoopConfig) -> None:
        self.config = config
        self.state = "observe"
        self.inject: Callable[[Any], float] | None = None  # extra ms added to a plan's measured steps
        self.measured: dict[str, tuple[Any, float]] = {}  # plan hash -> (plan, agreed measured ms)
        # plan hash -> agreed CPU ms per step of the step's thread, from its sequential window (``compute_floor``)
        self.compute_cpu: dict[str, float] = {}
        # plan hash -> agreed run-queue ms per step of the step's thread (time it was ready while another thread held
        # its core), from the same window (``measured_contention``)
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
        self._times: list[Elapsed] = []  # the current window's steps, read when it completes
        self._cold: list[bool] = []  # per entry of _times: the step ran a graph cold
        self._cpu: list[float] = []  # per entry of _times: the step thread's CPU ms (none when not given)
        self._queued: list[float] = []  # per entry of _times: the step thread's run-queue ms (none when not given)
        self._window: int | None = None  # steps of the current window once stretched (``min_window_ms``)
        self._kinds: dict[str, bool] = {}  # plan hash -> synchronous (``_synchronous``)
        self._refined = False
        self._sync_pick: str | None = None  # hash of the synchronous plan chosen (``_choose_synchronous``)
        self._pending = None  # a re-plan by someone else made during a ``SYNCHRONOUS_DUEL``: dueled after it
        self._initial = None  # the plan measured first: the refined re-plan solves with its options
        self.gap = 0.0
        # the priority schedule (ByteScheduler's, US-Byte's) of the plan settled on (``_measured_priority_schedule``):
        # later deft re-plans carry their synchronous parameters on it (``adjust_options``)
        self.priority_schedule: str | None = None

    @property
    def scales(self) -> tuple[float, float]:
        """(compute factor, link factor) of the refined profile; (1, 1) before any refinement."""
        return (self.refinement.compute, self.refinement.link) if self.refinement is not None else (1.0, 1.0)

    # -- hooks called by CompiledStep -------------------------------------------------
    def adjust_options(self, options: dict[str, Any]) -> dict[str, Any]:
        """Solver options for a re-plan by someone else (the Preserver): synchronous once that won; and, once the
        loop settled on a priority plan, its schedule for the parameters a plan with delays leaves synchronous
        (``synchronous_schedule``, ``planner.solvers.hybrid``)."""
        if self.synchronous_only:
            options = {**options, "max_staleness": 0, "allow_period": False}
        if self.priority_schedule is not None and "synchronous_schedule" not in options:
            options = {**options, "synchronous_schedule": self.priority_schedule}
        return options

    def after_step(self, step, elapsed: Elapsed, measurable: bool = True, cpu_seconds: float | None = None,
                   run_queue_seconds: float | None = None) -> None:
        """One step of ``step.plan`` took ``elapsed`` (on the step's device clock, ``deft_compile.timing``: read when a
        window or a duel's block completes, so a GPU is synchronised once per window); ``measurable=False`` if it ran a graph cold (its time is
        the compiler's, not the plan's: counted in the window, left out of the plan's time). ``cpu_seconds``: the
        step thread's CPU time in it (``time.thread_time``), which bounds the refined compute (``compute_floor``);
        ``run_queue_seconds``: the time the step thread was ready to run while another thread held its core
        (``thread_clock``), which measures the contention (``measured_contention``)."""
        if step.plan is None or step.process_group is None:
            return
        if self._expect is None:
            self._expect, self._switches = step.plan.hash(), step.plan_switches
        # someone else (the Preserver) switched: to another plan, or to the one that runs (its decision to step back
        # to the synchronous plan during a duel's synchronous block, which would otherwise go unseen and be undone
        # by the duel's verdict)
        if step.plan.hash() != self._expect or step.plan_switches != self._switches:
            self._switches = step.plan_switches
            self._new_window(step.plan.hash())
            if self.state == "duel" and self.duel.why == SYNCHRONOUS_DUEL:
                # which synchronous plan a re-plan must beat is being decided: the re-plan waits for the verdict
                self._pending = step.plan
                self.duel.restart_block()
                self._switch(step, self.duel.current, "closed loop duel", record=False)
                return
            if self.state in ("settled", "duel"):
                self.duel = None
                self.state = "settled"
                self._after_replan(step)
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
        self.windows[step.plan.hash()] = len(self._times)
        self.measured[step.plan.hash()] = (step.plan, measured)
        if self.state == "observe":
            self._after_observe(step, measured)
        else:
            self._next_trial(step)

    def _new_window(self, plan_hash: str | None) -> None:
        """Start counting (warm-up, window, re-check interval) afresh for the plan ``plan_hash``."""
        self._expect, self._since_change, self._times, self._cold, self._window = plan_hash, 0, [], [], None
        self._cpu, self._queued = [], []

    def _synchronous(self, plan) -> bool:
        """``_is_synchronous`` once per plan: asked on every settled step, over plans of up to hundreds of items."""
        key = plan.hash()
        if key not in self._kinds:
            self._kinds[key] = _is_synchronous(plan)
        return self._kinds[key]

    def _window_step(self, step, ms: Elapsed, cold: bool, cpu_ms: float | None = None,
                     queue_ms: float | None = None) -> float | None:
        """Add one step to the current window; the plan's agreed time once the window is complete, else None.
        With the step thread's CPU ms (run-queue ms) given for every step of the window, their agreed value (the
        same statistic, one all-reduce with the time) becomes the plan's ``compute_cpu`` (``run_queue``) once the
        window is complete."""
        self._times.append(ms)
        self._cold.append(cold)
        if cpu_ms is not None:
            self._cpu.append(cpu_ms)
        if queue_ms is not None:
            self._queued.append(queue_ms)
        planned = self._window or measure_window(step.plan, self.config.measure_steps)
        if len(self._times) < planned:
            return None
        period = max_period(step.plan)
        threads = {name: samples for name, samples in (("cpu", self._cpu), ("queue", self._queued))
                   if len(samples) == len(self._times)}
        agreed = self._agree(step, plan_step_ms(resolve_ms(self._times), period, self._cold),
                             *(plan_step_ms(samples, period, self._cold) for samples in threads.values()))
        measured, thread_ms = agreed[0], dict(zip(threads, agreed[1:]))
        # the agreed time says whether the window spans enough time (the same on every rank); asked again at the
        # stretched length, since the first steps after a switch run slower and stretch it too little
        stretched = window_steps(measured, planned, period, self.config.min_window_ms,
                                 self.config.max_window_steps)
        if stretched > planned:
            self._window = stretched
            log.info("closed loop: %.2f ms steps, window stretched from %d to %d steps (min_window_ms %.0f)",
                     measured, planned, stretched, self.config.min_window_ms)
            return None
        if "cpu" in thread_ms:
            self.compute_cpu[step.plan.hash()] = thread_ms["cpu"]
        if "queue" in thread_ms:
            self.run_queue[step.plan.hash()] = thread_ms["queue"]
        return measured

    def _recheck_step(self, step, ms: Elapsed, cold: bool) -> None:
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

    # -- decisions ----------------------------------------------------------------------
    def _agree(self, step, *values: float) -> list[float]:
        """Every rank's maximum of each value (one all-reduce): the slower rank sets the step."""
        import torch
        import torch.distributed as dist

        tensor = torch.tensor(values, dtype=torch.float64, device=comm_device(step.control_group))
        # on the control group: on the data-parallel group this would wait for the gradients still in flight
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=step.control_group)
        return tensor.tolist()

    def _after_observe(self, step, measured: float) -> None:
        plan = step.plan
        predicted = float(plan.predicted_iteration_ms or 0.0)
        self.gap = abs(measured - predicted) / measured if measured > 0 else 0.0
        self._note(step, "closed loop: measured the initial plan", plan, measured, predicted, gap=self.gap,
                   window_steps=self.windows.get(plan.hash()))
        self._initial = plan
        self._queue = []
        if not self._synchronous(plan):
            self._queue.append((self._synchronous_plan(step), "synchronous candidate"))
        if self.config.priority_candidate and step.policy == "deft" and step.loss_scaler is None:
            self._queue += [(plan, f"synchronous priority candidate ({plan.policy})") for plan in self._priority_plans(step)]
        self._queue = [(p, why) for p, why in self._queue if p.hash() not in self.measured]
        self.state = "trial"
        self._next_trial(step)

    def _synchronous_plan(self, step):
        """DDP's buckets, no delays or periods: the synchronous candidate every step measures."""
        if step.policy == "deft":
            return step.solve({**step.plan.options, "max_staleness": 0, "allow_period": False})
        from deft_compile.planner.solvers import solve

        options = {k: v for k, v in step.plan.options.items() if k in ("first_bucket_bytes", "bucket_cap_bytes")}
        return solve(step.profile, "wfbp", **options)

    def _priority_plans(self, step) -> list:
        """ByteScheduler's and US-Byte's plans on the step's profile, both measured.

        Why a deft step tries them: a synchronous plan that waits at the end of backward exposes the input-side
        gradients' communication every step (DESIGN.md §1). These plans send the input side first and wait for
        each layer's gradients just before that layer's forward in the next step: no staleness, DDP's numbers,
        part of the communication hidden behind the next forward. Where the Preserver finds staleness too
        costly, this is what is left to gain (measured: 0.82-0.91x DDP on the suite's CNNs in emulation).
        Both, not the one predicted faster: the simulator can miss these plans by 20-40 % and rank them wrongly
        (ResNet-50)."""
        from deft_compile.planner.solvers import solve

        plans = []
        for policy in PRIORITY_POLICIES:
            try:
                plans.append(solve(step.profile, policy))
            except ValueError as exc:  # a profile that solver cannot plan: measure the others
                log.warning("closed loop: no %s candidate: %s", policy, exc)
        return plans

    def _thread_ms(self) -> list[tuple[float, float] | None]:
        """Per measured plan (in ``measured``'s order), the step thread's agreed (CPU ms, run-queue ms), or None."""
        return [(self.compute_cpu[h], self.run_queue[h]) if h in self.compute_cpu and h in self.run_queue else None
                for h in self.measured]

    def _clocks_measured(self) -> bool:
        """Whether the refinement measures rather than fits (``refine_from_threads``): then it runs whatever the
        gap. ``tolerance`` keeps a fit to step times alone from following noise; measured, the compute and the
        contention come from the step thread's clocks. Why: gated by the gap, most of the suite's transformer
        launches keep the profile's contention of 0 (their priority plans miss by 12-20 %, under the tolerance),
        and a plan with delays the Preserver trades on that profile is predicted 21 % below its measured time on
        GPT-2."""
        return self.config.measure_contention and sum(t is not None for t in self._thread_ms()) >= 2

    def _worst_gap(self, step) -> float:
        """The largest relative gap between a measured plan's time and the simulator's prediction for it."""
        from deft_compile.planner.stability import predicted_ms

        return max((abs(ms - predicted_ms(step.profile, plan)) / ms for plan, ms in self.measured.values() if ms > 0),
                   default=0.0)

    def _refined_plan(self, step):
        """Scale the profile (and fit its contention) so the simulator reproduces the measured plans, re-solve
        with hysteresis."""
        from deft_compile.planner.stability import solve_stable

        base = step.profile
        measured = [value for value in self.measured.values()]
        thread_ms = self._thread_ms()

        def simulate_parts(plan, a: float, b: float, latency: float | None = None) -> tuple[float, float]:
            return contention_parts(scaled_profile(base, a, b, latency=latency), plan)

        simulated: dict[str, float] = {}  # plan hash -> compute ms: the floor and the measured refinement both ask

        def compute_ms(plan) -> float:
            from deft_compile.planner.simulator import simulate

            if plan.hash() not in simulated:
                simulated[plan.hash()] = simulate(base, plan, record=False, check=False).compute_ms
            return simulated[plan.hash()]

        self.min_compute = compute_floor([(self.measured[h][0], cpu) for h, cpu in self.compute_cpu.items()
                                          if h in self.measured], compute_ms)
        # Measured where the step thread's clocks were read for two plans or more: compute from its CPU time,
        # contention from its run-queue delay, the link (per byte and per message) fitted to the times.
        fitted = refine_from_threads(measured, simulate_parts, compute_ms, thread_ms) \
            if self.config.measure_contention else None
        # Otherwise fitted to the times: one measurement cannot separate compute from link (assume the link is as
        # measured and fit compute only); three plans on (differing in what they overlap) pin the contention down,
        # fewer keep the profile's.
        fit_gamma = fitted is None and self.config.fit_contention and len(measured) >= 3
        if fitted is None:
            fitted = refine_scales(measured, simulate_parts, contention=None if fit_gamma else base.contention,
                                   fit_link=len(measured) >= 2, min_compute=self.min_compute)
        a, b, error = fitted.compute, fitted.link, fitted.error
        self.refinement = fitted
        step.profile = scaled_profile(base, a, b, fitted.contention, latency=fitted.latency)
        # The initial plan's options, not the last trial's: that may be the synchronous candidate (solved with
        # max_staleness=0) or a priority plan (another solver's options). A priority policy's plan options are
        # its search's results (partition size, credit, ...): it searches again on the refined profile.
        initial = self._initial or step.plan
        options = step.solver_options() if step.policy in PRIORITY_POLICIES else dict(initial.options)
        refined = solve_stable(step.profile, step.policy, incumbent=initial, **options)
        if fitted.run_queue_share is not None:
            log.info("closed loop: refined profile from the step thread's clocks (compute x%.2f, run-queue share "
                     "%.2f, contention %.2f) and the times (link x%.2f per byte, x%.2f per message; fit error "
                     "%.1f%%)", a, fitted.run_queue_share, fitted.contention, b, fitted.latency, 100 * error)
        else:
            log.info("closed loop: refined profile (compute x%.2f, at least x%.2f by the step thread's CPU time; "
                     "link x%.2f, contention %.2f %s, fit error %.1f%%)", a, self.min_compute, b, fitted.contention,
                     "fitted" if fit_gamma else "kept", 100 * error)
        if refined.hash() in (initial.hash(), step.plan.hash()):
            return None
        return refined

    def _next_trial(self, step) -> None:
        if not self._queue and not self._refined:  # every candidate measured: refine once, on the worst miss
            self.gap = max(self.gap, self._worst_gap(step))
            if self.gap > self.config.tolerance or self._clocks_measured():
                self._refined = True
                refined = self._refined_plan(step)
                if refined is not None and refined.hash() not in self.measured:
                    self._queue.append((refined, "re-planned on the refined profile"))
        if self._queue:
            plan, why = self._queue.pop(0)
            self._switch(step, plan, f"closed loop trial: {why}")
            return
        self._decide(step)

    def _decide(self, step) -> None:
        """Every candidate measured one after the other: choose the synchronous plan (a duel when that is close),
        then duel the best plan with delays against it, or settle."""
        if self._sync_pick is None and self._choose_synchronous(step):
            return
        entries = list(self.measured.values())
        stale = [(p, ms) for p, ms in entries if not self._synchronous(p)]
        if len(stale) in (0, len(entries)):  # only one kind measured: nothing to duel
            best_plan, best_ms = self._fastest_synchronous() if not stale else min(entries, key=lambda e: e[1])
            self._settle(step, best_plan, best_ms, "fastest measured plan")
            return
        sync_plan, sync_ms = self._fastest_synchronous()
        stale_plan, stale_ms = min(stale, key=lambda e: e[1])
        if self.config.duel_rounds > 0 and stale_ms < sync_ms * (1.0 + self.config.duel_margin):
            self._start_duel(step, stale_plan, sync_plan, "settle")
            return
        best_plan, best_ms = (stale_plan, stale_ms) if stale_ms <= sync_ms * (1.0 - self.config.min_gain) else self._fastest_synchronous()
        self._settle(step, best_plan, best_ms, "fastest measured plan")

    def _fastest_synchronous(self):
        """(plan, ms) of the synchronous plan to run whenever the plan is synchronous, and the one a plan with
        delays must beat (it is what runs instead, with no staleness): the one ``_choose_synchronous`` chose, else
        the fastest measured. A priority plan (ByteScheduler's, US-Byte's) qualifies: its measured time is its
        real one, since no collective after a step waits for the gradients it leaves in flight
        (``CompiledStep.control_group``)."""
        if self._sync_pick in self.measured:
            return self.measured[self._sync_pick]
        return min(((p, ms) for p, ms in self.measured.values() if self._synchronous(p)), key=lambda e: e[1])

    def _choose_synchronous(self, step) -> bool:
        """Choose between DDP's buckets and the fastest priority plan, both measured one after the other; True if
        that takes a ``SYNCHRONOUS_DUEL`` (started here). The priority plan is taken at once when it measured
        ``duel_margin`` or more faster (emulated CNNs: 17-29 %), DDP's buckets when it was not ``min_gain`` faster;
        in between the sequential numbers do not tell the plans apart (see the module docstring)."""
        synchronous = [(p, ms) for p, ms in self.measured.values() if self._synchronous(p)]
        buckets = [(p, ms) for p, ms in synchronous if p.policy not in PRIORITY_POLICIES]
        priority = [(p, ms) for p, ms in synchronous if p.policy in PRIORITY_POLICIES]
        if not buckets or not priority:
            return False
        (base, base_ms), (challenger, challenger_ms) = (min(group, key=lambda e: e[1]) for group in (buckets, priority))
        if challenger_ms >= base_ms * (1.0 - self.config.min_gain):
            self._sync_pick = base.hash()
        elif challenger_ms <= base_ms * (1.0 - self.config.duel_margin) or self.config.duel_rounds <= 0:
            self._sync_pick = challenger.hash()
        else:
            self._start_duel(step, challenger, base, SYNCHRONOUS_DUEL)
            return True
        return False

    def _measured_priority_schedule(self, step, settled) -> str | None:
        """The priority schedule of the synchronous plan settled on, or, settling on a plan with delays, the one
        it carries or else that of the synchronous plan chosen (``_fastest_synchronous``) (None for DDP's buckets).

        Why: that measurement says the next forward hides more of the synchronous communication than the end of
        backward does; a plan with delays (the Preserver's trade) leaves parameters synchronous, and carrying them
        on the same schedule keeps that gain beside the delays (``planner.solvers.hybrid``). The plan with delays
        still has to win its duel against the fastest synchronous plan. One link only.
        """
        if not self.config.priority_schedule or step.policy != "deft" or len(step.profile.links) != 1:
            return None

        def schedule_of(plan) -> str | None:
            return plan.policy if plan.policy in PRIORITY_POLICIES else plan.options.get("synchronous_schedule")

        if self._synchronous(settled) or schedule_of(settled) is not None:
            return schedule_of(settled)
        if not any(self._synchronous(p) for p, _ in self.measured.values()):
            return None
        return schedule_of(self._fastest_synchronous()[0])

    def _candidates(self, step) -> dict[str, dict[str, Any]]:
        from deft_compile.planner.stability import predicted_ms

        return {
            h[:12]: {"measured_ms": round(ms, 3), "predicted_ms": round(predicted_ms(step.profile, p), 3),
                     "synchronous": self._synchronous(p),
                     **({"compute_cpu_ms": round(self.compute_cpu[h], 3)} if h in self.compute_cpu else {}),
                     **({"run_queue_ms": round(self.run_queue[h], 3)} if h in self.run_queue else {})}
            for h, (p, ms) in self.measured.items()
        }

    def _settle(self, step, plan, ms: float, why: str, **extra: Any) -> None:
        self.synchronous_only = self._synchronous(plan) and any(not self._synchronous(p)
                                                                for p, _ in self.measured.values())
        self.priority_schedule = self._measured_priority_schedule(step, plan)
        self.state = "settled"
        self.duel = None
        self._new_window(self._expect)  # re-checks count from here
        extra = {"candidates": self._candidates(step), **extra}
        if plan.hash() != step.plan.hash():
            self._switch(step, plan, f"closed loop: {why} ({ms:.1f} ms)", **extra)
        else:
            self._note(step, f"closed loop: {why} ({ms:.1f} ms), kept", plan, ms,
                       float(plan.predicted_iteration_ms or 0.0), **extra)

    def _after_replan(self, step) -> None:
        """Someone else switched after settling: measured before means decided at once, else a duel."""
        plan = step.plan
        if not any(self._synchronous(p) for p, _ in self.measured.values()):
            return
        sync_plan, sync_ms = self._fastest_synchronous()
        if self._synchronous(plan):
            # Every synchronous plan gives DDP's numbers: run the fastest one measured (a priority plan, say,
            # when the Preserver steps back to synchronous and the solver answers with DDP's buckets).
            known = self.measured.get(plan.hash())
            if sync_plan.hash() != plan.hash() and (known is None or sync_ms < known[1] * (1.0 - self.config.min_gain)):
                self._settle(step, sync_plan, sync_ms, "synchronous re-plan: the fastest measured synchronous plan "
                             "runs instead (same numbers)",
                             replaced={"plan_hash": plan.hash(), "measured_ms": known[1] if known else None})
            return
        known = self.measured.get(plan.hash())
        if known is None and self.config.duel_rounds > 0:
            self._start_duel(step, plan, sync_plan, "re-plan")
            return
        if known is None:  # no duel configured: measure it on its own first
            self.state = "trial"
            self._queue = []
            return
        if known[1] > sync_ms * (1.0 - self.config.min_gain):
            self._settle(step, sync_plan, sync_ms, f"the re-plan measured {known[1]:.1f} ms, not faster than the "
                         f"synchronous plan's {sync_ms:.1f} ms: back to synchronous",
                         rejected={"plan_hash": plan.hash(), "measured_ms": known[1]})

    # -- the duel -------------------------------------------------------------------------
    def _start_duel(self, step, challenger, incumbent, why: str) -> None:
        # blocks long enough in time: from the faster of the two plans' agreed measurements (the same on every rank)
        # (a plan with update periods rounds its blocks up to whole periods in ``_duel_step``)
        known = [self.measured[p.hash()][1] for p in (challenger, incumbent) if p.hash() in self.measured]
        block = window_steps(min(known, default=0.0), self.config.duel_steps, 1, self.config.min_window_ms,
                             self.config.max_window_steps)
        self.duel = Duel.between(challenger, incumbent, self.config.duel_rounds, why, block_steps=block)
        # the times it was called on, plan hash -> agreed ms (the duel's own times replace them in ``measured``)
        self.duel.sequential = {h[:12]: round(ms, 3) for h, (_plan, ms) in self.measured.items()}
        self.state = "duel"
        log.info("closed loop: duel (%s) of %s against %s, %d interleaved rounds", why, challenger.hash()[:12],
                 incumbent.hash()[:12], self.config.duel_rounds)
        if self.duel.current.hash() != step.plan.hash():
            self._switch(step, self.duel.current, "closed loop duel", record=False)

    def _duel_step(self, step, ms: Elapsed, cold: bool = False) -> None:
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
        ratios = duel.ratios()
        ratio = statistics.median(ratios)
        challenger, incumbent = duel.plans
        self.measured[challenger.hash()] = (challenger, duel.plan_ms(0))
        self.measured[incumbent.hash()] = (incumbent, duel.plan_ms(1))
        won = ratio < 1.0 - self.config.min_gain
        verdict = f"median ratio {ratio:.3f} over {len(ratios)} interleaved rounds"
        challenger_key = "priority_plan" if duel.why == SYNCHRONOUS_DUEL else "stale_plan"
        record = {"duel": {"why": duel.why, "ratios": [round(r, 4) for r in ratios], "median_ratio": round(ratio, 4),
                           challenger_key: challenger.hash(), "synchronous_plan": incumbent.hash(),
                           "block_steps": duel.block_steps, "sequential": duel.sequential}}
        if duel.why == SYNCHRONOUS_DUEL:
            self._after_synchronous_duel(step, challenger if won else incumbent, won, verdict, record)
        elif won:
            self._settle(step, challenger, duel.plan_ms(0), f"plan with delays won the duel ({verdict})", **record)
        else:
            # The duel's synchronous plan runs: it was measured in the same interleaved rounds as the plan it beat,
            # while another synchronous plan's time (measured alone, earlier) is not comparable with it.
            self._settle(step, incumbent, duel.plan_ms(1), f"synchronous plan won the duel ({verdict})", **record)

    def _after_synchronous_duel(self, step, winner, priority_won: bool, verdict: str, record: dict) -> None:
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

    def _switch(self, step, plan, reason: str, record: bool = True, **extra: Any) -> None:
        step.switch_plan(plan.options, reason, plan=plan, record=record)
        self._switches = step.plan_switches
        self._new_window(step.plan.hash())
        if record:
            step.plan_history[-1]["closed_loop"] = {"state": self.state, **self._profile_record(step), **extra}
            log.info("%s; measured so far: %s", reason, {h[:12]: round(ms, 3) for h, (_p, ms) in self.measured.items()})

    def _profile_record(self, step) -> dict[str, Any]:
        """What the refinement made of the profile, for ``plan_history``."""
        fitted = self.refinement
        record = {"scales": list(self.scales), "min_compute": self.min_compute, "contention": step.profile.contention}
        if fitted is not None and fitted.run_queue_share is not None:
            record.update(run_queue_share=fitted.run_queue_share, latency_scale=fitted.latency)
        return record

    def _note(self, step, reason: str, plan, measured: float, predicted: float, **extra: Any) -> None:
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
