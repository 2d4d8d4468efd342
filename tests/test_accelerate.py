"""The accelerate recipe (docs/INTEGRATIONS.md) in 2 gloo processes: ``accelerator.prepare`` the data loader,
``accelerator.prepare_model(model, evaluation_mode=True)`` (device and bf16 forward, no DDP), the optimizer
unprepared, ``deft_compile`` with ``accumulation_steps`` and ``max_grad_norm``; against accelerate's own loop
(``prepare(model, optimizer, loader)``, ``accumulate``, ``backward``, ``clip_grad_norm_``) on a tiny GPT-2.

Losses within 1e-5 relative and parameters within 1e-5 relative after every update (measured 2e-7; the attention
key bias, round-off under Adam, within 1e-4 absolute). The learning rate is 5e-5: under bf16 a parameter that
differs by float32 round-off can round to another bf16 value, which a larger rate carries further (1e-3 gave 4.5e-5
relative after the second update). One all-reduce per bucket per update.
"""

from __future__ import annotations

import pytest

from deft_compile.tools.launcher import run_local_workers
from trainer_workers import accelerate_recipe

import accelerate  # noqa: F401  (a dev dependency: a missing install fails here, loudly)


@pytest.fixture(scope="module")
def reports() -> list[dict]:
    return [r.value for r in run_local_workers(accelerate_recipe, 2, timeout_s=300)]


def test_accelerate_recipe_equals_accelerate_loop(reports):
    for rank, report in enumerate(reports):
        assert report["reference_type"] == "DistributedDataParallel"
        assert report["updates"] == 4 and len(report["losses"]) == len(report["reference_losses"]) == 8
        for t, (a, b) in enumerate(zip(report["losses"], report["reference_losses"])):
            assert abs(a - b) <= 1e-5 * abs(b), f"rank {rank} micro-batch {t}: {a} vs {b}"
        for t, entry in enumerate(report["params"]):
            assert not entry["missing"] and entry["max_rel"] <= 1e-5 and entry["key_bias_abs"] <= 1e-4, (rank, t, entry)


def test_accelerate_recipe_communicates_once_per_bucket_per_update(reports):
    for report in reports:
        assert report["buckets"] >= 2
        assert report["collectives"] == {"all_reduce": report["buckets"]}
