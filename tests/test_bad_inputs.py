"""The bad-input matrix (2 gloo workers): each input either trains as DDP does (then with DDP's numbers) or is
refused with a clear ``DeftError`` on every rank, never a hang or silent wrong numbers (docs/API.md, "Errors").

The aten-route runs go in one process pair, in turn (``CASE_LIST``, tests/batched.py), and each test asserts its own
run's results; the input that changes on one rank only (its collective times out) and the Inductor runs launch their
own pairs."""

from __future__ import annotations

import math

import pytest

from bad_input_workers import (
    batch_sizes,
    changed_after_compile,
    differing_models,
    nan_under_the_preserver,
    non_finite_beside_ddp,
    shapes_beside_ddp,
    trainer_refusals,
)
from batched import Case, launch_cases
from bounds import check_within_drift, worst
from deft_compile.tools.launcher import run_local_workers
from workers import check_entry

STEPS = 7
POLICY_COMPILERS = [("wfbp", "aten"), ("bytescheduler", "aten"), ("deft", "aten"), ("deft", "inductor")]
PATTERNS = ["uneven", "last"]


def _run(fn, args: tuple = (), timeout_s: float = 180, collective_timeout_s: float = 10) -> list:
    return run_local_workers(fn, 2, args, timeout_s=timeout_s, collective_timeout_s=collective_timeout_s,
                             raise_on_failure=False)


def _values(results: list) -> list:
    for result in results:
        assert result.ok, result.error
    return [result.value for result in results]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("policy,compiler", POLICY_COMPILERS)
@pytest.mark.parametrize("pattern", PATTERNS)
def test_batch_sizes_that_differ_train_as_ddp(outcome, policy, compiler, pattern):
    """``uneven``: rank 1's batch shrinks to 6 at step 3 (rank 1 alone retraces, with delayed gradients pending
    under ``deft``) and grows back at step 5; ``last``: every rank's last batch is smaller. DDP averages the ranks'
    mean gradients whatever their batch sizes; so does the step: DDP's numbers (``deft``: the eager reference of its
    delays, which averages as DDP does), bit-identical on aten; through Inductor within ``DRIFT_MULTIPLE`` times the
    yardstick measured in the same launch, the reference with its model compiled by ``torch.compile`` against the
    eager one on the same batch sizes (tests/bounds.py)."""
    if compiler == "aten":
        values = outcome(("shapes", policy, pattern))
    else:  # the rank that retraces compiles new regions while the other waits in a collective
        values = _values(_run(shapes_beside_ddp, (policy, pattern, STEPS, compiler), timeout_s=420,
                              collective_timeout_s=300))
    exact = compiler == "aten"
    for rank, value in enumerate(values):
        sizes = batch_sizes(rank, STEPS, pattern)
        where = f"{policy}/{compiler}/{pattern} rank {rank}"
        if exact:
            for entry in value["steps"]:
                check_entry(entry, True, f"{where} step {entry['step']}")
            check_entry(value["final"], True, f"{where} after flush")
        else:
            assert len(value["compiled"]) == STEPS + 1, value["compiled"]
            check_within_drift(value["steps"] + [value["final"]], worst(value["compiled"]), where)
        if compiler == "inductor":
            assert value["compiler"] == "inductor"
        if policy == "deft":
            assert value["delayed"] > 0
            changed = [t for t in range(1, STEPS) if sizes[t] != sizes[t - 1]]
            assert all(value["steps"][t - 1]["pending"] for t in changed), "the retrace must meet pending gradients"
    for name, tensor in values[0]["params"].items():  # one model on every rank
        assert (tensor - values[1]["params"][name]).abs().max().item() == 0.0, name


@pytest.mark.timeout(120)
def test_a_rank_whose_model_differs(outcome):
    """Other values on rank 1: rank 0's are broadcast, as DDP does; other trainable parameters or another learning
    rate: ``ModelMismatchError`` on every rank (other shapes: tests/test_errors_distributed.py)."""
    for value in outcome("differing models"):
        assert value["values_broadcast"] and value["replicas_equal_after_a_step"]
        for key in ("requires_grad", "learning_rate"):
            assert value[key] is not None and value[key].startswith("ModelMismatchError"), value[key]
        assert "rank 1 differs from rank 0 in parameters" in value["requires_grad"]
        assert "rank 1 differs from rank 0 in learning rates" in value["learning_rate"]


@pytest.mark.timeout(120)
def test_an_inf_input_makes_nan_gradients_as_under_ddp(outcome):
    """No loss scaling: the NaN gradient of rank 1 reaches every rank, DDP's parameters turn NaN and training goes
    on; the step's do the same, step by step, without raising."""
    for value in outcome("inf input"):
        assert all(value["same_as_ddp"]), value["same_as_ddp"]
        assert value["nan_params"] > 0
        assert math.isfinite(value["losses"][2][1]) and math.isnan(value["losses"][-1][1])


@pytest.mark.timeout(120)
def test_a_nan_loss_with_finite_gradients_under_the_preserver(outcome):
    """The loss is NaN at one step, its gradients are finite: training goes on as DDP's would, the replicas stay
    one model, and the Preserver (loss windows of 2 steps, staleness measured every 4) neither crashes nor reads
    the NaN as the plan's divergence: no step-down, and its best loss stays finite."""
    for value in outcome(("nan", "loss")):
        assert value["error"] is None, value["error"]
        assert math.isnan(value["losses"][4]) and all(math.isfinite(x) for i, x in enumerate(value["losses"]) if i != 4)
        assert value["finite_params"] and value["replicas_equal"]
        assert value["delayed"] > 0, "the plan keeps its delays"
        assert value["events"] == [] or not any("nan" in reason for reason in value["events"]), value["events"]
        assert value["best_loss"] is not None and math.isfinite(value["best_loss"])


@pytest.mark.timeout(120)
def test_nan_gradients_under_the_preserver(outcome):
    """An inf input on rank 1 makes the gradients NaN, and every parameter after it, as under DDP: training goes on
    without an error, and the Preserver reads the windows of nothing but NaN losses as divergence (a step-down)."""
    for value in outcome(("nan", "gradient")):
        assert value["error"] is None, value["error"]
        assert all(math.isnan(x) for x in value["losses"][6:]) and not value["finite_params"]  # delays: one step later
        assert value["replicas_equal"]
        assert value["events"] and "training diverges: window mean loss inf" in value["events"][0], value["events"]


REFUSED = {
    "half": "ModelChangedError: parameter 'net.0.weight' is float16 on cpu",
    "to_float64": "ModelChangedError: parameter 'net.0.weight' is float64 on cpu",
    "frozen_then_unfrozen": "ModelChangedError: parameter 'net.2.weight' is float32 on cpu, shape (2, 16), requires grad now",
    "foreign_param_group": "TraceError: optimizer param group 1 holds a tensor of shape (3,) that is not a parameter",
    "input_dtype_refused": "InputChangeError: the step failed on inputs whose dtype or device changed since the last "
                           "step that ran (args[0] is float64 on cpu, float32 on cpu before)",
    "input_device": "TraceError: cannot capture the training step",
}
#: changes after ``deft_compile`` that DDP takes, and so must the step
TAKEN = ["to_same_device", "unfreeze_group", "input_dtype_cast_by_model"]


def _cases() -> list[Case]:
    listed = [Case(("shapes", policy, pattern), shapes_beside_ddp, (policy, pattern, STEPS, compiler),
                   tests=(f"test_batch_sizes_that_differ_train_as_ddp[{pattern}-{policy}-{compiler}]",))
              for pattern in PATTERNS for policy, compiler in POLICY_COMPILERS if compiler == "aten"]
    listed += [Case("differing models", differing_models, tests=("test_a_rank_whose_model_differs",)),
               Case("inf input", non_finite_beside_ddp, (STEPS, 3),
                    tests=("test_an_inf_input_makes_nan_gradients_as_under_ddp",)),
               Case(("nan", "loss"), nan_under_the_preserver, (12, 4, "loss"),
                    tests=("test_a_nan_loss_with_finite_gradients_under_the_preserver",)),
               Case(("nan", "gradient"), nan_under_the_preserver, (12, 4, "gradient"),
                    tests=("test_nan_gradients_under_the_preserver",))]
    listed += [Case(("changed", change), changed_after_compile, (change,),
                    tests=(f"test_a_change_after_deft_compile_it_cannot_follow_is_refused_on_every_rank[{change}]",))
               for change in sorted(REFUSED)]
    listed += [Case(("changed", change), changed_after_compile, (change,),
                    tests=(f"test_a_change_after_deft_compile_that_ddp_takes_trains_as_ddp[{change}]",))
               for change in TAKEN]
    listed.append(Case("trainer refusals", trainer_refusals, tests=("test_deft_trainer_with_an_option_it_cannot_honour",)))
    return listed


CASE_LIST = _cases()


@pytest.fixture(scope="module")
def outcome(request):
    """The per-rank values of a run of ``CASE_LIST`` by key (a failed run fails the test that reads it); collectives
    time out after 10 s, as in the runs launched alone."""
    return launch_cases(request, CASE_LIST, timeout_s=240, collective_timeout_s=10)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("change", sorted(REFUSED))
def test_a_change_after_deft_compile_it_cannot_follow_is_refused_on_every_rank(outcome, change):
    for value in outcome(("changed", change)):
        assert value["error"] is not None and value["error"].startswith(REFUSED[change]), value["error"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("change", TAKEN)
def test_a_change_after_deft_compile_that_ddp_takes_trains_as_ddp(outcome, change):
    """``model.to()`` where the parameters already are; a parameter group of the model's own trainable parameters
    added to the optimizer (their gradients were averaged all along, as DDP's); inputs of another dtype that the
    model casts (a retrace)."""
    for value in outcome(("changed", change)):
        assert value["error"] is None, value["error"]
        assert value["same_as_ddp"]


@pytest.mark.timeout(120)
def test_an_input_change_on_one_rank_only():
    """Rank 1's input dtype changes and its model refuses it: rank 1 names the input, rank 0 does not wait on it
    forever (its collective times out, and it names rank 1)."""
    first, second = _values(_run(changed_after_compile, ("input_dtype_refused_on_rank_1",)))
    assert second["error"].startswith(REFUSED["input_dtype_refused"]), second["error"]
    assert first["error"].startswith("PeerFailureError") and "rank 1" in first["error"], first["error"]


@pytest.mark.timeout(120)
def test_deft_trainer_with_an_option_it_cannot_honour(outcome):
    """Refused on every rank before any training: settings it cannot honour with ``ValueError`` naming the setting
    (as Trainer refuses its own), an optimizer it cannot capture with ``UnsupportedOptimizerError``."""
    for value in outcome("trainer refusals"):
        assert value["torch_compile"].startswith("ValueError: DeftTrainer compiles the whole training step")
        assert value["deft_config_conflict"].startswith("ValueError: deft_config.max_grad_norm=0.5 but "
                                                        "TrainingArguments.max_grad_norm makes it 1.0")
        assert value["optimizer"].startswith("UnsupportedOptimizerError"), value["optimizer"]
