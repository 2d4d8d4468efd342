"""``DeftTrainer`` (``deft_compile.integrations.transformers``) in 2 gloo processes, a one-layer GPT-2 from a config:

- ``policy="wfbp"`` equals the plain ``Trainer`` (DDP) update by update, with gradient accumulation 2, bf16, clipping
  at 1.0, the default fused AdamW and linear decay: logged losses and gradient norms within 1e-5 relative (measured:
  equal), parameters within 1e-5 relative (measured 2e-7; GPT-2's attention key bias, pure round-off under Adam,
  within 1e-4 absolute). One all-reduce per bucket per update, no DDP.
- The plain ``Trainer`` around ``torch.compile(model, backend="deft")`` (``DDP(compiled)``; a small LM, which Dynamo
  compiles quickly) communicates once: the backend's one all-reduce per backward (DDP's bucket and unused-parameter
  all-reduces are off; it ran all three per update before), with the plain Trainer's losses.
- Resuming a ``DeftTrainer`` checkpoint (a delaying ``deft`` plan with pending gradients, the Preserver on) on a fresh
  process pair continues bit-identically: losses, parameters, optimizer state, the Preserver's state.
- Unsupported ``TrainingArguments`` raise clear errors at construction.

The 2-process runs go in one process pair, in turn (tests/batched.py), and each test asserts its own run's results.
"""

from __future__ import annotations

import pytest
import torch

from batched import Case, launch_cases
from deft_compile.tools.launcher import run_local_workers
from trainer_workers import trainer_against_ddp, trainer_checkpoint_run, trainer_refusals

import transformers  # noqa: F401  (a dev dependency: a missing install fails here, loudly)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


AGAINST_DDP_TESTS = ("test_wfbp_equals_plain_trainer_update_by_update", "test_one_all_reduce_per_bucket_per_update",
                     "test_ddp_of_compiled_under_trainer_communicates_once")
RESUME_TESTS = ("test_resume_from_trainer_checkpoint_is_exact",)


@pytest.fixture(scope="module")
def outcome(request, tmp_path_factory):
    """The per-rank values of each 2-process run by key (a failed run fails the test that reads it): the trainers
    beside DDP; a checkpointing run from the start (``straight``) and one resumed from its checkpoint of update 3."""
    folder = tmp_path_factory.mktemp("trainer")
    return launch_cases(request, [
        Case("against ddp", trainer_against_ddp, (str(folder / "ddp"),), tests=AGAINST_DDP_TESTS),
        Case("straight", trainer_checkpoint_run, (str(folder / "a"), None), tests=RESUME_TESTS),
        Case("resumed", trainer_checkpoint_run, (str(folder / "b"), str(folder / "a" / "checkpoint-3")),
             tests=RESUME_TESTS),
    ])


@pytest.fixture
def against_ddp(outcome) -> list[dict]:
    return outcome("against ddp")


def test_wfbp_equals_plain_trainer_update_by_update(against_ddp):
    for rank, report in enumerate(against_ddp):
        plain, deft = report["plain"], report["deft"]
        assert report["ddp_wrapped"] == "DistributedDataParallel" and report["deft_wrapped"] == "ModelView"
        assert report["updates"] == 4 and report["accumulation_steps"] == 2 and report["max_grad_norm"] == 1.0
        assert len(deft["losses"]) == len(plain["losses"]) == 4
        for t, (a, b) in enumerate(zip(deft["losses"], plain["losses"])):
            assert _rel(a, b) <= 1e-5, f"rank {rank} update {t}: loss {a} vs {b}"
        for t, (a, b) in enumerate(zip(deft["grad_norms"], plain["grad_norms"])):
            assert _rel(a, b) <= 1e-5, f"rank {rank} update {t}: grad norm {a} vs {b}"
        for t, entry in enumerate(report["params"]):
            assert entry["compared"] >= 15 and not entry["missing"], entry
            assert entry["max_rel"] <= 1e-5 and entry["key_bias_abs"] <= 1e-4, f"rank {rank} update {t}: {entry}"


def test_one_all_reduce_per_bucket_per_update(against_ddp):
    for report in against_ddp:
        assert report["buckets"] >= 2
        # the last update: the step's all-reduces only (no DDP); Trainer's own collectives run outside it
        assert report["deft"]["collectives"] == [{"all_reduce": report["buckets"]}]
        assert report["plain"]["collectives"][0].get("all_reduce", 0) >= 1


def test_ddp_of_compiled_under_trainer_communicates_once(against_ddp):
    for report in against_ddp:
        result = report["ddp_of_compiled"]
        assert result["collectives"] == [{"all_reduce": 1}]
        assert result["wrapped"] == "DistributedDataParallelWithoutGradientSync"
        assert result["reference_collectives"][0]["all_reduce"] == 2  # DDP alone: its bucket and unused-parameter map
        for a, b in zip(result["losses"], result["reference_losses"], strict=True):
            assert _rel(a, b) <= 1e-5


def test_resume_from_trainer_checkpoint_is_exact(outcome):
    straight, resumed = outcome("straight"), outcome("resumed")
    for rank in range(2):
        expected, actual = straight[rank], resumed[rank]
        assert actual["profile"] == expected["profile"], "both runs plan from the same profile"
        assert expected["delayed"] >= 1 and expected["saved_pending"] >= 1 and expected["saved_step_count"] == 3
        assert expected["global_step"] == actual["global_step"] == 6
        assert actual["step_count"] == expected["step_count"] == 6 and actual["pending_at_end"] == []
        assert [actual["losses"][t] for t in (4, 5, 6)] == [expected["losses"][t] for t in (4, 5, 6)]
        for name, tensor in expected["params"].items():
            assert torch.equal(tensor, actual["params"][name]), f"rank {rank}: {name} differs after resuming"
        assert expected["optimizer"].keys() == actual["optimizer"].keys()
        for name, tensor in expected["optimizer"].items():
            assert torch.equal(tensor, actual["optimizer"][name]), f"rank {rank}: optimizer {name} differs"
        drop = lambda state: {k: v for k, v in state.items() if k != "attribution_budget"}  # noqa: E731 (wall clock)
        assert drop(actual["preserver"]) == drop(expected["preserver"])


def test_unsupported_trainer_settings_raise(tmp_path):
    messages = run_local_workers(trainer_refusals, 1, (str(tmp_path),), timeout_s=300)[0].value
    for name in ("torch_compile", "torch_compile_backend"):
        assert messages[name].startswith("ValueError: DeftTrainer compiles the whole training step"), messages[name]
        assert "Leave torch_compile and torch_compile_backend unset" in messages[name]
    assert messages["deepspeed"].startswith("ValueError: ") and "DeepSpeed" in messages["deepspeed"]
    assert messages["fsdp"].startswith("ValueError: ") and "FSDP" in messages["fsdp"]
    assert "TrainingArguments.max_grad_norm makes it 1.0" in messages["conflict"]
    assert messages["optimizer"].startswith("UnsupportedOptimizerError: ") and "Adafactor" in messages["optimizer"]
