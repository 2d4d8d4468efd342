"""A link's cost from timed all-reduces: ``alpha + beta * bytes`` fitted to (bytes, ms) samples, and the
trimmed mean each size's repeats are reduced to. Pure: numbers in, numbers out (the profiler times them,
``deft_compile.step.profiler``)."""

from __future__ import annotations

import math
import statistics
from typing import Sequence


def fast_mean(samples: Sequence[float]) -> float:
    """Mean of the faster half of ``samples`` (a trimmed statistic).

    Noise on a shared machine only ever adds time, so the slow tail is dropped;
    averaging the fast half (rather than taking the single fastest) keeps one
    lucky sample from making a link look faster than it runs.
    """
    ordered = sorted(float(x) for x in samples)
    if not ordered:
        raise ValueError("fast_mean needs at least one sample")
    half = ordered[: max(1, (len(ordered) + 1) // 2)]
    return float(statistics.fmean(half))


def fit_alpha_beta(samples: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares ``time_ms = alpha + beta * bytes`` on relative errors, with ``alpha, beta >= 0``.

    The sizes span orders of magnitude (4 KiB to 4 MiB), so an absolute-error fit lets a few percent of noise
    on the largest size move the intercept by milliseconds: measured on a shaped link, α came out anywhere
    from 0 to 3.6 ms across launches, and plans of hundreds of messages (ByteScheduler's, US-Byte's) were
    predicted 46 % too fast or 50 % too slow with it. Weighting each sample by 1 / time² (its relative error)
    makes the small sizes fix α and the large ones fix β.

    Exact two-variable NNLS: the unconstrained solution if it is feasible,
    otherwise the best of the boundary fits (alpha = 0, beta = 0, both 0).
    Negative values would make the planner believe in free or time-travelling
    messages, so they are clamped by refitting, not by truncation.
    """
    points = [(float(x), float(y)) for x, y in samples]
    if len(points) < 2 or len({x for x, _ in points}) < 2:
        raise ValueError(f"fit_alpha_beta needs samples at two or more distinct sizes, got {len(points)} sample(s)")
    if not all(math.isfinite(x) and math.isfinite(y) for x, y in points):
        raise ValueError("fit_alpha_beta got a non-finite sample")
    floor = max((y for _, y in points), default=0.0) * 1e-6 or 1e-12
    weights = [1.0 / max(y, floor) ** 2 for _, y in points]
    s = sum(weights)
    sx = sum(w * x for w, (x, _) in zip(weights, points))
    sy = sum(w * y for w, (_, y) in zip(weights, points))
    sxx = sum(w * x * x for w, (x, _) in zip(weights, points))
    sxy = sum(w * x * y for w, (x, y) in zip(weights, points))

    def residual(alpha: float, beta: float) -> float:
        return sum(w * (y - alpha - beta * x) ** 2 for w, (x, y) in zip(weights, points))

    denominator = s * sxx - sx * sx
    beta = (s * sxy - sx * sy) / denominator
    alpha = (sy - beta * sx) / s
    if alpha >= 0 and beta >= 0:
        return alpha, beta
    candidates = [(0.0, 0.0), (max(0.0, sy / s), 0.0)]
    if sxx > 0:
        candidates.append((0.0, max(0.0, sxy / sxx)))
    return min(candidates, key=lambda ab: residual(*ab))
