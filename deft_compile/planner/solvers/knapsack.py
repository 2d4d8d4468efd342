"""Exact 0/1 knapsack over integer weights, and its use on times in milliseconds.

Why a dense DP and not a heuristic: DeFT's solver is the knapsack; with
capacities discretised to at most ``DEFAULT_UNITS`` units the table is small
(n x 1025 booleans for n buckets) and numpy fills one row per item.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

#: Default resolution: a capacity in ms is cut into this many integer units.
DEFAULT_UNITS = 1024


def knapsack_01(weights: Sequence[int], values: Sequence[float], capacity: int) -> tuple[float, list[int]]:
    """Maximise the sum of values of a subset whose integer weights sum to <= capacity.

    Exact (dynamic programming over capacities 0..capacity). Items with a
    non-positive value are never chosen; among optimal subsets the one found
    is deterministic (an item is taken only if it strictly improves).

    Returns:
        (best value, chosen item indices in increasing order).
    """
    n = len(weights)
    if len(values) != n:
        raise ValueError("weights and values must have the same length")
    capacity = int(capacity)
    if capacity < 0:
        return 0.0, []
    positive = [i for i in range(n) if float(values[i]) > 0]
    if sum(int(weights[i]) for i in positive) <= capacity:
        # everything worth taking fits: the optimum is all positive-value items
        if any(int(w) < 0 for w in weights):
            raise ValueError("negative weight")
        return float(sum(float(values[i]) for i in positive)), positive
    best = np.zeros(capacity + 1)
    taken = np.zeros((n, capacity + 1), dtype=bool)
    for i in range(n):
        w = int(weights[i])
        v = float(values[i])
        if w < 0:
            raise ValueError(f"item {i} has negative weight {w}")
        if v <= 0 or w > capacity:
            continue
        if w == 0:
            best += v
            taken[i, :] = True
            continue
        candidate = best[:-w] + v
        np.greater(candidate, best[w:], out=taken[i, w:])
        np.maximum(best[w:], candidate, out=best[w:])
    chosen = []
    c = capacity
    for i in range(n - 1, -1, -1):
        if taken[i, c]:
            chosen.append(i)
            c -= int(weights[i])
    chosen.reverse()
    return float(best[capacity]), chosen


def discretise(times_ms: Sequence[float], capacity_ms: float,
               units: int = DEFAULT_UNITS) -> tuple[list[int], int, float]:
    """Integer weights and capacity for a knapsack over times.

    The resolution is ``capacity_ms / units`` ms. Weights are rounded *up* and
    the capacity down, so every subset feasible after discretisation is also
    feasible in real time (never over-fills the compute it hides behind).

    Returns:
        (weights, capacity in units, resolution in ms).
    """
    if capacity_ms <= 0:
        return [0 if t <= 0 else 1 for t in times_ms], 0, 0.0
    resolution = capacity_ms / units
    scaled = np.ceil(np.asarray(times_ms, dtype=float) / resolution - 1e-9)
    weights = [int(w) for w in np.maximum(scaled, 0)]
    return weights, units, resolution


def knapsack_time(times_ms: Sequence[float], values: Sequence[float], capacity_ms: float,
                  units: int = DEFAULT_UNITS) -> tuple[float, list[int]]:
    """0/1 knapsack with weights in ms, exact on the discretised weights (see ``discretise``)."""
    weights, capacity, _ = discretise(times_ms, capacity_ms, units)
    return knapsack_01(weights, values, capacity)
