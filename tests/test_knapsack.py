"""The DeFT knapsack DP is exact: equal to brute force on integer weights."""

from __future__ import annotations

import itertools
import random

import pytest

from deft_compile.planner.solvers.deft import suffix_knapsacks
from deft_compile.planner.solvers.knapsack import discretise, knapsack_01, knapsack_time


def brute_force(weights: list[int], values: list[float], capacity: int) -> float:
    best = 0.0
    for mask in itertools.product((0, 1), repeat=len(weights)):
        weight = sum(w for w, m in zip(weights, mask) if m)
        if weight <= capacity:
            best = max(best, sum(v for v, m in zip(values, mask) if m))
    return best


def random_instance(rng: random.Random) -> tuple[list[int], list[float], int]:
    n = rng.randint(0, 12)
    weights = [rng.randint(0, 30) for _ in range(n)]
    # mostly positive values, some non-positive (priced staleness can make them negative)
    values = [round(rng.uniform(-2.0, 20.0), 3) for _ in range(n)]
    capacity = rng.randint(0, 80)
    return weights, values, capacity


def test_knapsack_equals_brute_force_on_random_instances() -> None:
    rng = random.Random(20250316)
    for _ in range(250):
        weights, values, capacity = random_instance(rng)
        best, chosen = knapsack_01(weights, values, capacity)
        expected = brute_force(weights, values, capacity)
        assert best == pytest.approx(expected, abs=1e-9)
        # the returned set is feasible and really has that value
        assert chosen == sorted(set(chosen))
        assert sum(weights[i] for i in chosen) <= capacity
        assert sum(values[i] for i in chosen) == pytest.approx(best, abs=1e-9)
        assert all(values[i] > 0 for i in chosen)


def test_knapsack_prefers_value_over_count() -> None:
    # capacity 10: {0} is worth 10, {1, 2} only 9 together
    best, chosen = knapsack_01([10, 5, 5], [10.0, 4.5, 4.5], 10)
    assert (best, chosen) == (10.0, [0])


def test_zero_weight_items_and_empty_capacity() -> None:
    assert knapsack_01([0, 3], [1.0, 5.0], 0) == (1.0, [0])
    assert knapsack_01([], [], 5) == (0.0, [])
    assert knapsack_01([1], [-1.0], 5) == (0.0, [])


def test_discretised_choice_never_overfills_real_capacity() -> None:
    rng = random.Random(7)
    for _ in range(100):
        times = [rng.uniform(0.01, 5.0) for _ in range(rng.randint(1, 10))]
        capacity = rng.uniform(0.5, 15.0)
        _, chosen = knapsack_time(times, times, capacity, units=64)
        assert sum(times[i] for i in chosen) <= capacity + 1e-9


def test_discretise_rounds_weights_up_and_reports_resolution() -> None:
    weights, capacity, resolution = discretise([0.5, 1.0, 1.01], 4.0, units=4)
    assert resolution == 1.0 and capacity == 4
    assert weights == [1, 1, 2]


def test_suffix_knapsacks_equal_a_fresh_knapsack_of_each_suffix() -> None:
    rng = random.Random(11)
    for _ in range(60):
        weights, values, capacity = random_instance(rng)
        chosen_of = suffix_knapsacks(weights, values, capacity)
        for k in range(len(weights) + 1):
            chosen = chosen_of(k)
            assert all(i >= k for i in chosen)
            assert sum(weights[i] for i in chosen) <= capacity
            expected = brute_force(weights[k:], values[k:], capacity)
            assert sum(values[i] for i in chosen) == pytest.approx(expected, abs=1e-9)
