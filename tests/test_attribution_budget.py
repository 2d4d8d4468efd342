"""The loss attribution's time budget (deft_compile.preserver.budget): pure arithmetic, no processes."""

import pytest

from deft_compile.preserver import PreserverConfig
from deft_compile.preserver.budget import FORWARD_SHARE, AttributionBudget


def _trained(steps: int, seconds: float, share: float | None = 0.05) -> AttributionBudget:
    budget = AttributionBudget(share)
    for _ in range(steps):
        budget.count_step(seconds)
    return budget


def test_a_replay_fits_only_within_its_share_of_the_training_time():
    budget = _trained(80, 0.125)  # 10 s trained: 0.5 s of attribution allowed
    assert budget.affords(0.5) and not budget.affords(0.51)
    budget.spend(0.25)
    assert budget.affords(0.25) and not budget.affords(0.26)


def test_early_in_a_run_a_replay_costs_more_than_the_budget_and_later_it_fits():
    """The measured case: 14 steps replayed twice at about a step each, against 40 steps trained."""
    budget = _trained(40, 0.15)
    replay = budget.replay_seconds(trained=28, evaluated=20)
    assert replay == pytest.approx(0.15 * (28 + FORWARD_SHARE * 20))
    assert not budget.affords(replay)
    for _ in range(2000):
        budget.count_step(0.15)
    assert budget.affords(replay)


def test_the_replay_is_priced_at_the_measured_eager_pass_once_there_is_one():
    budget = _trained(10, 0.2)
    assert budget.replay_seconds(3, 0) == pytest.approx(0.6)  # a step's mean time stands in
    budget.pass_seconds = 0.05
    assert budget.replay_seconds(3, 3) == pytest.approx(0.05 * (3 + 1))
    assert AttributionBudget().replay_seconds(5, 5) == 0.0  # nothing measured or trained yet
    budget.replayed(0.5, trained=4, evaluated=3)  # a replay measured: spent, and its pass time predicts the next
    assert budget.spent_seconds == 0.5 and budget.replay_seconds(4, 3) == pytest.approx(0.5)


def test_no_limit_and_zero_share():
    assert AttributionBudget(None).affords(1e9)
    assert not _trained(100, 1.0, share=0.0).affords(0.0), "a zero budget allows nothing, not even a free copy"


def test_every_rank_decides_from_the_same_means():
    """``numbers`` is what the loss window all-reduces; ``agreed`` rebuilds the budget from the means."""
    a, b = _trained(10, 0.1), _trained(10, 0.3)
    a.spend(0.05)
    b.pass_seconds, b.copy_seconds = 0.02, 0.01
    means = [(x + y) / 2 for x, y in zip(a.numbers(), b.numbers())]
    agreed_a, agreed_b = a.agreed(means), b.agreed(means)
    assert agreed_a == agreed_b
    assert agreed_a.training_seconds == pytest.approx(2.0) and agreed_a.steps == 10
    assert agreed_a.spent_seconds == pytest.approx(0.025) and agreed_a.pass_seconds == pytest.approx(0.01)
    assert agreed_a.share == 0.05


def test_the_budget_is_saved_and_restored():
    budget = _trained(7, 0.5, share=0.1)
    budget.spend(0.25)
    budget.pass_seconds, budget.copy_seconds = 0.125, 0.0625
    restored = AttributionBudget(0.1)
    restored.load_state_dict(budget.state_dict())
    assert restored == budget and isinstance(restored.steps, int)
    restored.load_state_dict({})  # an older checkpoint without one leaves it as it is
    assert restored == budget


def test_the_config_refuses_a_negative_budget():
    with pytest.raises(ValueError, match="attribution_budget"):
        PreserverConfig(attribution_budget=-0.1)
    assert PreserverConfig().attribution_budget == 0.05 and PreserverConfig(attribution_budget=None)
