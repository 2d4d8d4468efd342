"""The tests that pin numerics, on the compiler a user gets: ``DeftConfig()``'s default, regional Inductor.

The rest of the suite runs step graphs as aten (tests/conftest.py). Here each 2-process gloo run takes
``$DEFT_COMPILER`` out (``default_route_workers.on_default_route``), so every ``DeftConfig()`` takes the default,
and each test checks that it did: the default is ``"inductor"``, Inductor compiled the step graphs' regions and
none fell back to aten.

Bounds: every comparison is bounded by the yardstick measured in the same launch, the reference itself with the model
compiled by ``torch.compile`` (``default_route_workers.compile_beside_ddp`` after the worker, through
``with_yardstick``; ``delayed_beside_compile`` beside the delayed semantics; ``Trainer(torch_compile=True)`` beside
``DeftTrainer``): deft's largest difference from its reference over the run may be at most ``DRIFT_MULTIPLE`` (10)
times the yardstick's largest (tests/bounds.py, the derivation). The Adam models hold no parameter whose gradient is
mathematically zero and numerically round-off, such as an attention key bias (``models.TinyTransformerLM`` has no
biases, ``models.BatchNormCNN`` no bias before BatchNorm): Adam turns such round-off into steps of size lr in any two
implementations. ``DeftTrainer``'s GPT-2 has one; as in tests/test_hf_trainer.py it is bounded apart, in absolute
terms (against the yardstick's own key bias difference).

Also on the default route elsewhere: ``wfbp`` against DDP (SGD with Dropout, AdamW, Adam with BatchNorm), ByteScheduler
under a per-step learning-rate schedule and the delayed semantics on AdamW in tests/test_inductor.py; the default
semantics and the ``torch.save`` resume in tests/test_delayed.py; bf16 autocast in tests/test_bf16_tracks_eager.py;
the closed loop in tests/test_closed_loop.py; the demo in tests/test_readme_demo.py.
"""

from __future__ import annotations

import pytest
import torch

from bounds import check_difference, check_scalars_within_drift, check_within_drift, relative, worst
from default_route_workers import (delayed_beside_compile, dlcp_beside_ddp, loss_scaling_beside_compile,
                                   on_default_route, policy_beside_ddp, trainer_beside_plain, with_yardstick)
from deft_compile.tools.launcher import run_local_workers
from integration_workers import assert_resumed_as_straight, dcp_checkpoint_run
from loop_workers import accumulation_with_ddp, clip_with_ddp

# Cold Inductor compiles on a 2-core host take minutes per launch when the host is busy; this is a hang guard.
pytestmark = pytest.mark.timeout(900)

ADAM_CASE, ADAM_STEPS = "transformer_tied_adamw_groups", 5


def _launch(fn, *args) -> list:
    """``fn(rank, 2, *args)`` in 2 gloo processes on the default compiler; each rank's result, after checking that
    the default route ran (Inductor compiled regions, none fell back to aten)."""
    results = run_local_workers(on_default_route, 2, (fn, *args), timeout_s=800, collective_timeout_s=600)
    for rank, result in enumerate(r.value for r in results):
        assert result["default"] == "inductor", result["default"]
        assert result["lowered"].get("inductor", 0) > 0, f"rank {rank}: no region compiled: {result['lowered']}"
        assert result["lowered"].get("aten", 0) == 0, f"rank {rank}: regions fell back to aten: {result['lowered']}"
    return [r.value["value"] for r in results]


def _check(report: dict, where: str) -> None:
    """Every step and the state after ``flush()`` within ``DRIFT_MULTIPLE`` times the yardstick the launch measured
    (``report["compiled"]``)."""
    assert report["compiled"] and all(entry["missing"] == [] for entry in report["compiled"]), report["compiled"]
    check_within_drift(report["steps"] + [report["final"]], worst(report["compiled"]), where)


# -- policies equal to DDP -------------------------------------------------------------------------------------
@pytest.mark.parametrize("policy, case", [("wfbp", "frozen_unused_sgd"), ("bytescheduler", "mlp_dropout_sgd"),
                                          ("usbyte", "mlp_dropout_sgd"), ("deft-sync", "mlp_dropout_sgd")])
def test_timing_policies_equal_ddp_with_sgd(policy, case):
    """wfbp with a frozen layer and an unused parameter (DDP's ``find_unused_parameters``); ByteScheduler and US-Byte,
    whose plans move updates into the next forward; deft's solver without delays. DDP's numbers to round-off: within
    ``DRIFT_MULTIPLE`` times DDP around ``torch.compile(model)`` against DDP."""
    for rank, report in enumerate(_launch(with_yardstick, policy_beside_ddp, (case, 6, policy), case, 6)):
        assert report["compiler"] == "inductor"
        _check(report, f"{policy}/{case} rank {rank}")
        assert report["pending_after_flush"] == []
        deferred = [entry["deferred"] for entry in report["steps"]]
        assert all(deferred) if policy in ("bytescheduler", "usbyte") else not any(deferred), deferred


def test_dlcp_without_a_deadline_equals_ddp():
    for rank, report in enumerate(_launch(with_yardstick, dlcp_beside_ddp, (5,), "mlp_dropout_sgd", 5)):
        assert all(entry["stats"] is None for entry in report["steps"]), "no deadline: nothing chunked or dropped"
        _check(report, f"dlcp rank {rank}")


@pytest.mark.parametrize("policy", ["wfbp", "deft-sync"])
def test_adam_policies_equal_ddp_within_torch_compiles_drift(policy):
    """AdamW with tied weights and two parameter groups: wfbp, and deft's solver without delays (the plan the default
    policy starts from)."""
    for rank, report in enumerate(_launch(with_yardstick, policy_beside_ddp, (ADAM_CASE, ADAM_STEPS, policy), ADAM_CASE,
                                          ADAM_STEPS)):
        _check(report, f"{policy} rank {rank}")
        assert report["pending_after_flush"] == []


# -- delayed and compensated semantics -------------------------------------------------------------------------
@pytest.mark.parametrize("delayed_update", ["averaged", "compensated"])
def test_delayed_semantics_follow_their_eager_reference_with_sgd(delayed_update):
    """A plan that delays buckets (SGD with Nesterov momentum and Dropout) against ``workers.PlanReference`` of the same
    plan, written without deft_compile: the averaged delayed gradient, and the compensated form (forward and
    backward at the predicted weights, Nesterov-form update). The bound is the same reference with the model compiled
    by torch.compile, against the eager one, over the same steps."""
    per_rank = _launch(delayed_beside_compile, "mlp_dropout_sgd", 6, delayed_update)
    assert per_rank[0]["delayed"] and per_rank[0]["delayed"] == per_rank[1]["delayed"]
    for rank, report in enumerate(per_rank):
        assert report["semantics"] == delayed_update
        _check(report, f"{delayed_update} rank {rank}")
        assert all(entry["pending"] > 0 for entry in report["steps"]) and report["pending_after_flush"] == []
    for name, tensor in per_rank[0]["final_params"].items():
        assert torch.equal(tensor, per_rank[1]["final_params"][name]), f"replicas differ in {name}"


def test_compensated_adamw_follows_its_eager_reference_within_torch_compiles_drift():
    """The semantics ``DeftConfig()`` resolves to for AdamW (compensated), on a plan that mixes delayed and synchronous
    buckets, against its eager reference; the bound is the same reference with the model compiled by torch.compile,
    against the eager one, over the same steps."""
    for rank, report in enumerate(_launch(delayed_beside_compile, ADAM_CASE, ADAM_STEPS, "compensated")):
        assert report["semantics"] == "compensated"
        assert report["delayed"] and len(report["delayed"]) < report["all_params"]
        _check(report, f"compensated rank {rank}")
        assert report["pending_after_flush"] == []


# -- clipping, accumulation, loss scaling ----------------------------------------------------------------------
def test_clipping_equals_ddp_then_clip_grad_norm():
    """wfbp with ``max_grad_norm`` against DDP then ``clip_grad_norm_``: the state, and the norm deft measured against
    the one ``clip_grad_norm_`` returned, each within ``DRIFT_MULTIPLE`` times the compiled DDP's own (the norm: its
    ``clip_grad_norm_`` against eager's)."""
    case, steps, max_norm = "mlp_dropout_sgd", 6, 0.05
    for rank, report in enumerate(_launch(with_yardstick, clip_with_ddp, (case, steps, max_norm), case, steps,
                                          {"max_grad_norm": max_norm})):
        assert all(entry["norm"] > max_norm for entry in report["steps"]), "the test must actually clip"
        check_within_drift(report["steps"], worst(report["compiled"]), f"rank {rank}")
        check_scalars_within_drift(relative([entry["deft_norm"] for entry in report["steps"]],
                                            [entry["norm"] for entry in report["steps"]]),
                                   [entry["norm_diff"] for entry in report["compiled"]], f"rank {rank} norm")


def test_accumulation_equals_ddp_no_sync():
    case, steps, accumulation = "mlp_dropout_sgd", 6, 3
    for rank, report in enumerate(_launch(with_yardstick, accumulation_with_ddp, (case, steps, accumulation, "wfbp"),
                                          case, steps, {"accumulation": accumulation})):
        assert len(report["steps"]) == len(report["compiled"]) == 2
        for entry in report["steps"]:
            assert "error" not in entry and entry["updated"], entry
        check_within_drift(report["steps"], worst(report["compiled"]), f"rank {rank}")


def test_fp16_loss_scaling_equals_ddp_with_grad_scaler_within_torch_compiles_drift():
    """fp16 autocast with a GradScaler shared with deft, clipping at 5.0; the scale jumps to 2**40 at step 4, so
    backward overflows and deft skips that update and lowers the scale as DDP's recipe does. Under fp16 the SGD
    bound is torch.compile's too: Inductor computes a chain of fp16 pointwise ops in float32 and rounds once
    (``torch._inductor.config.emulate_precision_casts`` off), eager rounds to fp16 after every op, so both
    compiled runs differ from eager by fp16 round-off, far above float32's."""
    for rank, report in enumerate(_launch(loss_scaling_beside_compile, 8, 4, "float16")):
        deft, compiled = report["deft"], report["compiled"]
        skipped = [entry["skipped"] for entry in deft]
        assert skipped == [entry["skipped"] for entry in compiled] and skipped[4] and not any(skipped[:4]), skipped
        for entry in deft:
            assert entry["scales"][0] == entry["scales"][1], f"rank {rank} step {entry['step']}"
        check_within_drift(deft, worst(compiled), f"rank {rank}")
        check_difference(max(entry["loss_diff"] for entry in deft), max(entry["loss_diff"] for entry in compiled),
                         f"rank {rank} losses")


# -- resume ----------------------------------------------------------------------------------------------------
def test_dcp_checkpoint_resumes_bit_identically(tmp_path):
    """``deft_compile.checkpoint`` (DCP) after two steps of a delaying plan with the Preserver on (the first ran as
    aten, ``aten_first_call``), resumed on a fresh process pair: every region runs the same kernels in both runs, so
    parameters, gradients, optimizer state, pending gradients and the Preserver's state equal the run that never
    stopped, bit for bit."""
    case, stop, path = "mlp_dropout_sgd", 5, str(tmp_path / "ckpt")
    straight = _launch(dcp_checkpoint_run, case, 0, stop, None, None)
    first = _launch(dcp_checkpoint_run, case, 0, 2, None, path)
    resumed = _launch(dcp_checkpoint_run, case, 2, stop, path, None)
    for rank in range(2):
        expected, actual = straight[rank], resumed[rank]
        assert first[rank]["pending_before_save"] > 0, "the checkpoint must carry pending gradients"
        assert actual["step_count"] == expected["step_count"] == stop and actual["lr"] == expected["lr"]
        assert_resumed_as_straight(rank, expected, actual)
        drop = lambda state: {k: v for k, v in state.items() if k != "attribution_budget"}  # noqa: E731 (wall clock)
        assert drop(actual["preserver"]) == drop(expected["preserver"])


# -- DeftTrainer -----------------------------------------------------------------------------------------------
def test_deft_trainer_equals_plain_trainer_within_torch_compiles_drift(tmp_path):
    """``DeftTrainer(policy="wfbp")`` against the plain ``Trainer`` update by update (accumulation 2, clipping at 1.0,
    the default fused AdamW, linear decay): parameters, GPT-2's attention key bias (absolutely), logged losses and
    gradient norms within ``DRIFT_MULTIPLE`` times ``Trainer(torch_compile=True)``'s difference from the plain one.
    In float32: under bf16 autocast Inductor's fused kernels round bf16 intermediates differently from eager (as
    under fp16), and the first AdamW steps turn those gradient differences into opposite signs on elements of
    GPT-2's zero-initialised biases, where any compiled Trainer differs from eager by twice the tensor's largest
    element: a bound that holds anything. bf16 on the default route: tests/test_bf16_tracks_eager.py. The first AdamW
    steps at Trainer's default learning rate (5e-5) give the largest yardstick of the lane (6e-5, a tenth of one
    update): there the parameters' bound is about one update, and the logged losses and gradient norms (yardstick
    6e-8, one float32 ulp at the least) carry the check."""
    for rank, report in enumerate(_launch(trainer_beside_plain, str(tmp_path))):
        assert report["compiler"] == "inductor" and report["updates"] == 4
        deft, compiled = report["deft"], report["compiled"]
        assert len(deft) == len(compiled) == 4
        for t, entry in enumerate(deft):
            assert entry["compared"] >= 15 and not entry["missing"], f"rank {rank} update {t}: {entry}"
        check_within_drift([{**entry, "step": t} for t, entry in enumerate(deft)], worst(compiled), f"rank {rank}")
        check_difference(max(entry["key_bias_abs"] for entry in deft), max(entry["key_bias_abs"] for entry in compiled),
                         f"rank {rank} key bias (absolute)")
        for quantity in ("losses", "grad_norms"):
            # the compiled Trainer may log the plain one's numbers exactly: at least one float32 ulp (tests/bounds.py)
            runs = report[quantity]
            check_scalars_within_drift(relative(runs["deft"], runs["plain"]), relative(runs["compiled"], runs["plain"]),
                                       f"rank {rank} {quantity} {runs}")
