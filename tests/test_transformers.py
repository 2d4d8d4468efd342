"""``transformers`` models (GPT-2, BERT, Llama from small configs, random weights, nothing downloaded): the step
takes their ``ModelOutput`` (``.loss``) without a loss_fn and, with ``wfbp`` and clipping, equals torch DDP."""

from __future__ import annotations

import pytest

from deft_compile.tools.launcher import run_local_workers
from loop_workers import transformers_with_ddp
from workers import check_entry

import transformers  # noqa: F401  (a dev dependency: a missing install fails here, loudly)


@pytest.mark.parametrize("family", ["gpt2", "bert", "llama"])
def test_transformers_model_equals_ddp(family: str) -> None:
    results = run_local_workers(transformers_with_ddp, 2, (family, 3), timeout_s=300)
    for rank, result in enumerate(results):
        report = result.value
        assert report["buckets"] >= 2
        for entry in report["steps"]:
            check_entry(entry, False, f"{family} rank {rank} step {entry['step']}", tolerance=1e-5)
            assert entry["loss_diff"] <= 1e-6
