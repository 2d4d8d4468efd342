"""The closed loop's refinement: compute and link factors, and the contention, that make the simulator reproduce
measured plans. Pure: profiles, plans and measured numbers in, factors and a refined profile out.

Two ways, by what the runtime measured (docs/PLANNER.md, "The closed loop's refinement"):

- ``refine_from_threads``: the step thread's CPU time gives the compute, its run-queue delay the contention
  (``measured_contention``), and the link's per-byte and per-message factors are fitted to the step times.
- ``refine_scales``: compute and link factors (and optionally the contention) fitted to the step times alone,
  the compute never below what the step thread was measured busy (``compute_floor``).

``refine_profile`` chooses between them as ``ClosedLoopConfig`` says and returns the refined profile.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass
from typing import Any, Callable

from deft_compile.planner.plan import Profile
from deft_compile.planner.simulator import ScaledSimulation, simulate

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
    timeline = simulate(dataclasses.replace(profile, contention=1.0), plan, record=False, check=False)
    return timeline.iteration_ms - timeline.contention_ms, timeline.contention_ms


def scaled_parts(profile) -> Callable[..., tuple[float, float]]:
    """``simulate_parts`` for ``refine_scales`` and ``refine_from_threads``: ``(plan, compute, link, latency=None)``
    -> ``contention_parts`` of ``scaled_profile(profile, compute, link, latency=latency)``, each plan's structure
    flattened once (``ScaledSimulation``; the same numbers to round-off, a few times faster than scaling the
    profile). The profile is read when a plan is first simulated: change it and make new parts.

    Without ``latency`` (one factor for the whole link) a plan is simulated once per link-to-compute ratio: every
    time the simulator forms is a sum or a maximum of compute and link times (and the overlap is a length of
    time), so scaling both by ``compute`` scales both parts by it, and ``parts(plan, a, b)`` is ``a`` times
    ``parts(plan, 1, b / a)``. The log grids of ``refine_scales`` hold up to 13 x 13 and 9 x 9 points on at
    most 25 and 17 ratios. Ratios within ``RATIO_RESOLUTION`` of one another share the simulation (a relative
    change of the times below 1e-9, far under any measurement)."""
    simulations: dict[int, tuple[Any, ScaledSimulation]] = {}
    by_ratio: dict[tuple[int, int], tuple[float, float]] = {}

    def parts(plan, compute: float, link: float, latency: float | None = None) -> tuple[float, float]:
        entry = simulations.get(id(plan))
        if entry is None:  # the entry holds the plan, so no other plan takes its id while the parts live
            entry = simulations[id(plan)] = (plan, ScaledSimulation(profile, plan))
        if latency is None and compute > 0 and link > 0:
            key = (id(plan), round(math.log(link / compute) / RATIO_RESOLUTION))
            unit = by_ratio.get(key)
            if unit is None:
                timeline = entry[1].run(1.0, link / compute, None, contention=1.0)
                unit = by_ratio[key] = (timeline.iteration_ms - timeline.contention_ms, timeline.contention_ms)
            return compute * unit[0], compute * unit[1]
        timeline = entry[1].run(compute, link, latency, contention=1.0)
        return timeline.iteration_ms - timeline.contention_ms, timeline.contention_ms

    return parts


#: how close (in natural log) two link-to-compute ratios must be to share one simulation in ``scaled_parts``
RATIO_RESOLUTION = 1e-9


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
    seen: set[tuple[float, float]] = set()  # points clamped to a floor repeat; a repeat cannot improve the best
    for span, points in ((8.0, 13), (math.sqrt(2.0), 9), (2 ** 0.125, 9)):
        center = best_point
        for i in range(points):
            for j in range(points if search_second else 1):
                x = max(least[0], center[0] * span ** (2 * i / (points - 1) - 1))
                y = max(least[1], center[1] * span ** (2 * j / (points - 1) - 1)) if search_second else center[1]
                if (x, y) in seen:
                    continue
                seen.add((x, y))
                score, refinement = evaluate(x, y)
                if score < best[0] - 1e-12:
                    best, best_point = (score, refinement), (x, y)
    return best[1]


def scaled_profile(profile, compute: float, link: float, contention: float | None = None,
                   latency: float | None = None):
    """``profile`` with every compute time times ``compute``, every link's β times ``link`` and α times ``latency``
    (``link`` when None), and (if given) its contention replaced."""
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



@dataclass(frozen=True)
class RefinedProfile:
    """What ``refine_profile`` made of the measurements: the factors, the least compute factor the step thread's
    CPU time allowed (``compute_floor``), the refined profile, and whether the contention was fitted."""

    refinement: Refinement
    min_compute: float
    profile: Profile
    fitted_contention: bool


def thread_ms_of(measured: dict[str, tuple[Any, float]], compute_cpu: dict[str, float],
                 run_queue: dict[str, float]) -> list[tuple[float, float] | None]:
    """Per measured plan (in ``measured``'s order, plan hash -> (plan, ms)), the step thread's agreed (CPU ms,
    run-queue ms) per step, or None where either was not read."""
    return [(compute_cpu[h], run_queue[h]) if h in compute_cpu and h in run_queue else None for h in measured]


def refine_profile(profile: Profile, measured: dict[str, tuple[Any, float]], compute_cpu: dict[str, float],
                   run_queue: dict[str, float], *, measure_contention: bool, fit_contention: bool) -> RefinedProfile:
    """Scale ``profile`` (and measure or fit its contention) so the simulator reproduces the ``measured`` plans
    (plan hash -> (plan, agreed ms)); ``compute_cpu`` and ``run_queue``: plan hash -> the step thread's agreed CPU
    and run-queue ms per step, where read.

    Measured (``refine_from_threads``) where ``measure_contention`` and the thread's clocks were read for two
    plans or more: compute from its CPU time, contention from its run-queue delay, the link (per byte and per
    message) fitted to the times. Otherwise fitted to the times (``refine_scales``): one measurement cannot
    separate compute from link (the link is kept as measured and the compute fitted alone); from three plans on
    (differing in what they overlap) the contention is fitted too when ``fit_contention``, else the profile's
    is kept."""
    entries = list(measured.values())
    thread_ms = thread_ms_of(measured, compute_cpu, run_queue)

    simulate_parts = scaled_parts(profile)

    simulated: dict[str, float] = {}  # plan hash -> compute ms: the floor and the measured refinement both ask

    def compute_ms(plan) -> float:
        if plan.hash() not in simulated:
            simulated[plan.hash()] = simulate(profile, plan, record=False, check=False).compute_ms
        return simulated[plan.hash()]

    min_compute = compute_floor([(measured[h][0], cpu) for h, cpu in compute_cpu.items() if h in measured],
                                compute_ms)
    fitted = refine_from_threads(entries, simulate_parts, compute_ms, thread_ms) if measure_contention else None
    fit_gamma = fitted is None and fit_contention and len(entries) >= 3
    if fitted is None:
        fitted = refine_scales(entries, simulate_parts, contention=None if fit_gamma else profile.contention,
                               fit_link=len(entries) >= 2, min_compute=min_compute)
    refined = scaled_profile(profile, fitted.compute, fitted.link, fitted.contention, latency=fitted.latency)
    return RefinedProfile(fitted, min_compute, refined, fit_gamma)
