"""Input shapes that change: every route trains correctly on a new sequence length, and compiles once per shape
family, not once per length (``deft_compile/step/symbolic.py``).

An Inductor route's numbers are the aten route's (or DDP's) within ``DRIFT_MULTIPLE`` times the yardstick: the same
steps on the same lengths with the model compiled by ``torch.compile``, against eager (tests/bounds.py):
``shape_workers.compiled_lengths`` measures it once per length sequence and optimizer in this process,
``per_rank_lengths_beside_ddp`` in the same launch as deft."""

from __future__ import annotations

import pytest

from bounds import check_difference, check_scalars_within_drift, relative
from deft_compile.tools.launcher import run_local_workers
from shape_workers import compiled_lengths, lengths_of, per_rank_lengths_beside_ddp, relative_error, train_lengths

#: lengths of a fine-tune with dynamic padding: every call its own, then the same again
LENGTHS = [9, 13, 7, 17, 13, 9, 11, 7]


@pytest.fixture(scope="module")
def aten_run():
    return train_lengths("aten", LENGTHS)


@pytest.fixture(scope="module")
def lengths_drift():
    """The yardstick of SGD on ``LENGTHS`` (``shape_workers.compiled_lengths``)."""
    return compiled_lengths(LENGTHS)


def _check_losses(run: dict, reference: dict, drift: dict, lengths: list[int]) -> None:
    check_scalars_within_drift(relative(run["losses"], reference["losses"]), drift["losses"],
                               f"losses on lengths {lengths}")


@pytest.mark.parametrize("compiler", ["inductor", "inductor-graph"])
def test_new_lengths_train_as_the_aten_route(compiler, aten_run, lengths_drift):
    """A region or graph compiled for one length never runs another's: the numbers are the aten route's (SGD with
    momentum, Inductor's round-off: losses and final parameters within ``DRIFT_MULTIPLE`` times the yardstick's),
    and nothing falls back to aten."""
    run = train_lengths(compiler, LENGTHS)
    assert run["fallbacks"] == []
    _check_losses(run, aten_run, lengths_drift, LENGTHS)
    differences = {name: relative_error(value, aten_run["params"][name]) for name, value in run["params"].items()}
    worst = max(differences, key=differences.get)
    check_difference(differences[worst], max(lengths_drift["params"].values()), f"parameters, worst {worst}")


def test_regions_compile_once_per_shape_family():
    """The first call's capture is static; the second length makes the length symbolic, and every later length
    reuses that capture and its compiled regions: at most two compiles per region (first and steady update)."""
    run = train_lengths("inductor", LENGTHS)
    assert run["captures"] == 2
    assert max(run["compiles_per_region"].values()) <= 2, run["compiles_per_region"]


def test_a_dimension_marked_dynamic_is_symbolic_from_the_first_call():
    """``torch._dynamo.mark_dynamic(tensor, dim)`` on an input: its first capture is already symbolic in that
    dimension, so every length shares one capture and each region compiles once for it (updates: first and steady);
    the numbers are those of the capture made symbolic at the second length."""
    run = train_lengths("inductor", LENGTHS, mark_dynamic=True)
    assert run["captures"] == 1
    assert max(run["compiles_per_region"].values()) <= 2, run["compiles_per_region"]
    forward = [region for region in run["compiles_per_region"] if "forward" in str(region)]
    assert forward and all(run["compiles_per_region"][region] == 1 for region in forward), run["compiles_per_region"]


def test_whole_graph_compiles_once_per_shape_family():
    run = train_lengths("inductor-graph", LENGTHS + LENGTHS)
    assert run["captures"] == 2
    assert sum(run["compiles_per_region"].values()) <= 2, run["compiles_per_region"]


def test_a_length_the_guards_exclude_gets_its_own_static_capture(aten_run):
    """Length 1 is outside the symbolic capture's range (sizes 0 and 1 are specialised, as in torch.compile): it is
    captured statically, and the numbers still follow the aten route's (the losses, within ``DRIFT_MULTIPLE`` times
    the yardstick's on these lengths)."""
    lengths = [9, 13, 1, 7]
    run, reference = train_lengths("inductor", lengths), train_lengths("aten", lengths)
    assert run["captures"] == 3
    _check_losses(run, reference, compiled_lengths(lengths), lengths)


def test_static_shapes_on_request_capture_every_shape():
    """``DeftConfig(dynamic_shapes=False)``: every new shape is a capture of its own (and the same numbers)."""
    lengths = [9, 13, 7, 13]
    run, reference = train_lengths("aten", lengths, dynamic_shapes=False), train_lengths("aten", lengths)
    assert run["captures"] == 3 and reference["captures"] == 2
    assert run["losses"] == reference["losses"]


def test_adamw_on_new_lengths_tracks_the_aten_route():
    """AdamW: the losses within ``DRIFT_MULTIPLE`` times the yardstick's (AdamW on the same lengths)."""
    run, reference = train_lengths("inductor", LENGTHS, "adamw"), train_lengths("aten", LENGTHS, "adamw")
    _check_losses(run, reference, compiled_lengths(LENGTHS, "adamw"), LENGTHS)


STEPS = 8


@pytest.mark.parametrize("compiler", ["aten", "inductor", "inductor-graph"])
def test_ranks_with_their_own_lengths_match_ddp(compiler):
    """Dynamic padding: each rank its own length every step. Every rank runs the same collectives (no hang, no
    mismatch) and the result is DDP's on the same per-rank batches: bit-identical on aten, round-off on Inductor
    (within ``DRIFT_MULTIPLE`` times DDP around ``torch.compile(model)`` against DDP, measured in the same launch)."""
    inductor = compiler != "aten"
    results = [r.value for r in run_local_workers(per_rank_lengths_beside_ddp, 2, (compiler, STEPS, inductor),
                                                  timeout_s=600)]
    assert lengths_of(0, STEPS) != lengths_of(1, STEPS)
    for rank, report in enumerate(results):
        assert report["buckets"] >= 2
        assert report["captures"] <= 2, f"rank {rank}: {report['captures']} captures"
        if inductor:
            check_difference(max(report["worst"]), max(report["compiled"]), f"rank {rank} {report['lengths']}")
        else:
            assert max(report["worst"]) == 0.0, f"rank {rank} {report['lengths']}: {report['worst']}"


def test_deft_trainer_with_dynamic_padding_matches_trainer(tmp_path):
    """A fine-tune with dynamic padding (2 processes, each batch padded to its own longest sample, so the ranks'
    lengths differ every step): ``DeftTrainer(policy="wfbp")`` trains as the plain Trainer (DDP) does, with no
    hang, and captures the step twice (the first call, then once with the length symbolic); with
    ``dynamic_lengths=True`` once, symbolic from the first call, with the same numbers."""
    from shapes import trainer_worker
    from trainer_workers import _compare_params

    runs = {}
    for variant in ("trainer", "deft-wfbp", "deft-wfbp-dynamic"):
        output = tmp_path / variant
        runs[variant] = [r.value for r in run_local_workers(trainer_worker, 2, (variant, 6, str(output), True),
                                                            timeout_s=600)]
    for variant, captures in (("deft-wfbp", 2), ("deft-wfbp-dynamic", 1)):
        for rank in range(2):
            deft, plain = runs[variant][rank], runs["trainer"][rank]
            assert deft["captures"] == captures, (variant, rank, deft["captures"])
            assert deft["fallbacks"] == []
            # GPT-2's attention key bias has a round-off gradient, which Adam turns into steps of size lr: compared
            # absolutely, the rest relatively (as the Trainer tests do)
            entry = _compare_params([deft["params"]], [plain["params"]])[0]
            assert not entry["missing"] and entry["max_rel"] <= 1e-5 and entry["key_bias_abs"] <= 1e-4, \
                (variant, rank, entry)
