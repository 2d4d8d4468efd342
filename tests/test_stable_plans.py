"""Plans do not follow measurement noise: quantised profiles and hysteresis. Pure: no processes."""

from __future__ import annotations

import random

import pytest

from deft_compile.planner.plan import Profile
from deft_compile.planner.link_fit import fast_mean
from deft_compile.planner.stability import quantise_profile, solve_stable
from deft_compile.planner.zoo_profiles import build_profile


def _noisy(profile: Profile, rng: random.Random, eps: float = 0.1) -> Profile:
    """Every compute and link number independently scaled by a factor in [1 - eps, 1 + eps]."""
    data = profile.to_dict()
    for param in data["params"]:
        for key in ("forward_ms", "backward_ms", "update_ms"):
            param[key] *= 1 + rng.uniform(-eps, eps)
    for link in data["links"]:
        for key in ("alpha_ms", "beta_ms_per_byte"):
            link[key] *= 1 + rng.uniform(-eps, eps)
    data["message_cpu_ms"] = 0.03 * (1 + rng.uniform(-eps, eps))
    return Profile.from_dict(data)


@pytest.mark.parametrize("model, gbps", [("resnet101", 25), ("resnet101", 50), ("vgg19", 10), ("vgg19", 25), ("gpt2", 10), ("gpt2", 25)])
def test_noisy_profiles_keep_the_deft_plan(model, gbps):
    profile = build_profile(model, inter_gbps=gbps)
    plan = solve_stable(profile, "deft")
    assert plan.metadata.get("delayed_buckets", 0) > 0, "the case should be one where DeFT delays buckets"
    rng = random.Random(13)
    for _ in range(8):
        again = solve_stable(_noisy(profile, rng), "deft", incumbent=plan)
        assert again.hash() == plan.hash(), again.metadata.get("stability")
        assert again.metadata["stability"]["kept_incumbent"]


def test_a_real_change_still_replans():
    """Hysteresis is not a freeze: a link 4x slower gets its own plan."""
    plan = solve_stable(build_profile("resnet101", inter_gbps=50), "deft")
    slower = solve_stable(build_profile("resnet101", inter_gbps=12.5), "deft", incumbent=plan)
    assert slower.hash() != plan.hash()
    assert not slower.metadata["stability"]["kept_incumbent"]


def test_quantised_numbers_sit_on_the_grid():
    profile = quantise_profile(build_profile("vgg19"), 0.05)
    assert quantise_profile(profile, 0.05).to_dict() == profile.to_dict(), "idempotent: values are grid points"
    near = build_profile("vgg19").to_dict()
    near["links"][0]["beta_ms_per_byte"] *= 1.001
    assert quantise_profile(Profile.from_dict(near), 0.05).links[0].beta_ms_per_byte == profile.links[0].beta_ms_per_byte


def test_link_statistic_ignores_the_slow_tail():
    assert fast_mean([1.0, 1.2, 9.0, 30.0]) == pytest.approx(1.1)
    assert fast_mean([2.0]) == 2.0
