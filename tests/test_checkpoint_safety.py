"""Checkpoints load no code: the step state is tensors and plain data, read with ``torch.load(weights_only=True)``.

- ``deft_compile.step_state``: a round trip gives back exactly the state saved (types, values, tensors bit for
  bit); what it could not give back is refused when saving.
- A step state whose pickle would run code (``pathlib.Path.touch``, ``os.system``), on either resume path
  (``checkpoint.load`` of a DCP folder on 2 ranks, ``DeftTrainer.train(resume_from_checkpoint=...)`` on 2 ranks),
  is refused with ``DeftError`` on every rank and the marker file it would create never appears; so is DCP
  metadata that would, and a refused DCP load leaves the model and optimizer as they were.
- A truncated file gets ``TornCheckpointError``, a foreign one ``DeftError``, never a pickle traceback.
- A checkpoint written the previous way (``torch.save(step.state_dict())``) resumes bit-identically where
  ``weights_only`` reads it; where it does not (a numpy scalar) it is refused with the way to convert it, and
  after ``convert_trusted`` it resumes bit-identically too.

The 2-process runs go in two process pairs, each running its cases in turn (tests/batched.py): the first writes the
straight runs and the checkpoints of the previous format, tries the refusals and the resumes that need nothing
converted; the second runs what needs a checkpoint converted or rewritten in this process in between. Each test
asserts its own runs' results.
"""

from __future__ import annotations

import dataclasses
import enum
import io
import os
import pickle

import numpy
import pytest
import torch

from batched import Case, launch_cases
from checkpoint_safety_workers import (CASE, RunsCode, RunsSystem, dcp_previous_format_run, dcp_refusals,
                                       saved_bytes, trainer_resume_refusals, trainer_variants)
from deft_compile import step_state
from deft_compile.errors import DeftError, TornCheckpointError
from deft_compile.tools.convert_checkpoint import convert_trusted
from integration_workers import assert_resumed_as_straight, dcp_checkpoint_run
from trainer_workers import trainer_checkpoint_run

STOP = 6

#: the error each refused variant gets (type, then words its message must hold)
REFUSALS = {
    "touch_in_step_state": ("DeftError", "names getattr", "convert-checkpoint --trust"),
    "system_inside_plain_wrapper": ("DeftError", "names posix.system", "refused"),
    "raw_pickle": ("DeftError", "not a file torch.save writes"),
    "truncated": ("TornCheckpointError", "truncated or damaged"),
    "empty": ("TornCheckpointError", "is empty"),
    "foreign_text": ("DeftError", "not a file torch.save writes"),
    "foreign_torch_file": ("DeftError", "not a deft_compile step state"),
    "previous_format_numpy": ("DeftError", "numpy", "convert-checkpoint --trust"),
}


def _state() -> dict:
    """A step state with every kind of value the step saves (the Preserver's replay schedule holds tuples)."""
    return {"step_count": 7, "policy": "deft", "plan": '{"items": []}', "profile": None,
            "pending": {"0": torch.randn(3, 2), "1": torch.arange(5, dtype=torch.int64)},
            "accumulated": {0: 2, 3: 1},
            "preserver": {"level": 0, "best_loss": float("nan"), "traded": True, "recent_losses": [1.5, 2.25],
                          "pins": [[["a.weight"], 1.0]],
                          "admission": {"kind": "propose", "schedule": {"a.weight": (1, 2), "b.bias": (0, 3)},
                                        "prices": [{"a.weight": 0.5}, {}], "metrics": {"gain_ms": -0.0}}},
            "loss_scaler": {"scale": 65536.0, "growth_tracker": 1}}


def _same(a, b) -> bool:
    """Equal with the same types all the way down; tensors bit for bit; NaN equals NaN."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and a != a:
        return b != b
    return a == b


def _expect(outcome: str | None, name: str) -> None:
    kind, *words = REFUSALS[name]
    assert outcome is not None and outcome.startswith(f"{kind}: "), (name, outcome)
    for word in words:
        assert word in outcome, (name, word, outcome)
    assert "Traceback" not in outcome and "Weights only load failed" not in outcome, outcome


# -- the format, in this process ---------------------------------------------------------------------------------
def test_round_trip_gives_back_exactly_the_state_saved():
    state = _state()
    buffer = io.BytesIO()
    step_state.write(state, buffer)
    loaded = step_state.read(buffer.getvalue(), "a state")
    assert _same(loaded, state)
    assert type(loaded["preserver"]["admission"]["schedule"]["a.weight"]) is tuple
    stored = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    assert stored["format"] == step_state.FORMAT and stored["state"]["preserver"]["admission"]["schedule"] == {
        "a.weight": [1, 2], "b.bias": [0, 3]}  # tuples are stored as lists


class _Colour(enum.Enum):
    RED = 1


@dataclasses.dataclass
class _Point:
    x: int


@pytest.mark.parametrize(("value", "named"), [
    ((1, 2), "builtins.tuple"), (numpy.float64(1.0), "numpy.float64"), (torch.Size([2]), "torch.Size"),
    (_Colour.RED, "_Colour"), (_Point(1), "_Point"), (torch.nn.Parameter(torch.ones(1)), "Parameter"),
])
def test_what_a_checkpoint_could_not_give_back_is_refused_when_saving(value, named):
    with pytest.raises(DeftError, match=rf"state\['preserver'\]\['x'\] is a .*{named}"):
        step_state.write({**_state(), "preserver": {"x": value}}, io.BytesIO())


def test_a_pickle_that_runs_code_is_refused_and_never_called(tmp_path):
    marker = tmp_path / "marker"
    for payload in (saved_bytes(RunsCode(str(marker))), saved_bytes({"state": RunsSystem(str(marker))}),
                    saved_bytes({"format": step_state.FORMAT, "version": 1, "state": [RunsCode(str(marker))]}),
                    pickle.dumps(RunsSystem(str(marker)))):
        with pytest.raises(DeftError, match="refused"):
            step_state.read(payload, "a step state")
    assert not marker.exists()


def test_truncated_and_foreign_files_get_deft_errors(tmp_path):
    buffer = io.BytesIO()
    step_state.write(_state(), buffer)
    good = buffer.getvalue()
    for cut in (0, 10, len(good) // 2, len(good) - 30):
        with pytest.raises(TornCheckpointError):
            step_state.read(good[:cut], f"the first {cut} bytes")
    (tmp_path / "foreign.zip").write_bytes(b"")
    import zipfile

    with zipfile.ZipFile(tmp_path / "foreign.zip", "w") as archive:
        archive.writestr("hello.txt", "a zip torch did not write")
    foreign = [b"not a checkpoint\n", (tmp_path / "foreign.zip").read_bytes(), saved_bytes(torch.zeros(3)),
               saved_bytes({"format": step_state.FORMAT, "version": 99, "state": {}}),
               saved_bytes({"format": step_state.FORMAT, "version": 1, "state": {"step_count": 1}}),
               saved_bytes({"format": step_state.FORMAT, "version": 1, "state": {**_state(), "x": torch.Size([1])}})]
    for content in foreign:
        with pytest.raises(DeftError) as caught:
            step_state.read(content, "a file")
        assert not isinstance(caught.value, TornCheckpointError), caught.value
    with pytest.raises(DeftError, match="no such file"):
        step_state.read(tmp_path / "missing.pt", "a file")


def test_previous_format_is_converted_as_it_loads_or_refused_with_the_way_to_convert(tmp_path):
    state = _state()
    path = tmp_path / "deft_step_rank0.pt"
    torch.save(state, path)  # the previous format: torch.save(step.state_dict())
    assert _same(step_state.read(path, str(path)), state)
    torch.save({**state, "step_count": numpy.int64(7)}, path)
    with pytest.raises(DeftError, match="convert-checkpoint --trust") as caught:
        step_state.read(path, str(path))
    assert "numpy" in str(caught.value)
    assert convert_trusted(path) == [str(path)]
    assert _same(step_state.read(path, str(path)), state)
    assert torch.load(path, weights_only=True)["format"] == step_state.FORMAT


# -- both resume paths, 2 gloo processes --------------------------------------------------------------------------
DCP_REFUSALS_TEST = "test_dcp_checkpoints_that_would_run_code_are_refused_on_every_rank"
TRAINER_REFUSALS_TEST = "test_trainer_step_states_that_would_run_code_are_refused_on_every_rank"
DCP_RESUME_TESTS = {numpy_scalar: f"test_previous_format_dcp_checkpoint_resumes_exactly[{numpy_scalar}]"
                    for numpy_scalar in (False, True)}
TRAINER_VARIANTS = ["previous_format", "previous_format_numpy"]
TRAINER_RESUME_TESTS = {variant: f"test_previous_format_trainer_checkpoint_resumes_exactly[{variant}]"
                        for variant in TRAINER_VARIANTS}
TRAINER_TESTS = (TRAINER_REFUSALS_TEST, *TRAINER_RESUME_TESTS.values())


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="module")
def first(request, folder):
    """The runs that need nothing from this process: the DCP refusals; the straight DCP and Trainer runs; each DCP
    checkpoint of the previous format saved after step 1 and, where ``weights_only`` reads it, resumed; the one with
    a numpy scalar tried as it is (refused, last: a run that raises ends its launch)."""
    cases = [Case("dcp refusals", dcp_refusals, (str(folder / "refusals"), str(folder / "dcp-marker")),
                  tests=(DCP_REFUSALS_TEST,)),
             Case("dcp straight", dcp_checkpoint_run, (CASE, 0, STOP, None, None), tests=tuple(DCP_RESUME_TESTS.values())),
             Case("trainer straight", trainer_checkpoint_run, (str(folder / "trainer-straight"), None), tests=TRAINER_TESTS)]
    for numpy_scalar, test in DCP_RESUME_TESTS.items():
        cases.append(Case(("dcp previous format", numpy_scalar), dcp_previous_format_run,
                          (CASE, 1, str(folder / f"dcp-{numpy_scalar}"), numpy_scalar), tests=(test,)))
    cases.append(Case(("dcp resumed", False), dcp_checkpoint_run, (CASE, 1, STOP, str(folder / "dcp-False"), None),
                      tests=(DCP_RESUME_TESTS[False],)))
    cases.append(Case(("dcp refused", True), dcp_checkpoint_run, (CASE, 1, STOP, str(folder / "dcp-True"), None),
                      tests=(DCP_RESUME_TESTS[True],)))
    return launch_cases(request, cases)


@pytest.fixture(scope="module")
def second(request, folder, first):
    """The runs of checkpoints this process rewrote after ``first``: the numpy DCP checkpoint after
    ``convert_trusted``; the Trainer checkpoint of update 3 rewritten into variants (``trainer_variants``) twice: the
    refused ones of one set tried on every rank, the previous-format ones of the other resumed (the numpy one after
    conversion). Returns the
    outcomes and what each conversion gave."""
    names = {item.name for item in request.session.items if getattr(item, "module", None) is request.module}
    converted: dict[str, list] = {}
    cases = []
    if DCP_RESUME_TESTS[True] in names:
        first.errors(("dcp refused", True))  # the refusal ran before the conversion
        path = str(folder / "dcp-True")
        converted["dcp"] = convert_trusted(path)
        cases.append(Case(("dcp resumed", True), dcp_checkpoint_run, (CASE, 1, STOP, path, None),
                          tests=(DCP_RESUME_TESTS[True],)))
    if names & set(TRAINER_TESTS):
        first("trainer straight")
        source, marker = str(folder / "trainer-straight" / "checkpoint-3"), str(folder / "trainer-marker")
        folders = trainer_variants(source, str(folder / "variants-refused"), marker)
        refusals = {name: folders[name] for name in (*REFUSALS, "rank0_only")}
        cases.append(Case("trainer refusals", trainer_resume_refusals, (refusals, str(folder / "trainer-out"), marker),
                          tests=(TRAINER_REFUSALS_TEST,)))
        folders = trainer_variants(source, str(folder / "variants-resumed"), str(folder / "unused-marker"))
        converted["trainer"] = convert_trusted(folders["previous_format_numpy"])
        cases += [Case(("trainer resumed", variant), trainer_checkpoint_run,
                       (str(folder / f"trainer-{variant}"), folders[variant]), tests=(TRAINER_RESUME_TESTS[variant],))
                  for variant in TRAINER_VARIANTS]
    return launch_cases(request, cases), converted


def test_dcp_checkpoints_that_would_run_code_are_refused_on_every_rank(first, folder):
    marker = str(folder / "dcp-marker")
    reports = first("dcp refusals")
    for rank, report in enumerate(reports):
        assert not report["marker"] and not os.path.exists(marker)
        for name in REFUSALS:
            _expect(report[name], name)
            assert report[f"{name}:untouched"], f"rank {rank}: {name} changed the model or optimizer"
        for name in ("touch_as_dcp_entry", "metadata"):
            assert report[name] is not None and report[name].startswith("DeftError: "), report[name]
            assert "refused" in report[name] and report[f"{name}:untouched"], report[name]
        assert "not part of a DCP checkpoint's metadata" in report["metadata"]
        assert "names pathlib.Path.touch" in report["metadata"]
        assert report["step_count"] == 1
    assert "names getattr" in reports[0]["rank0_only"]
    assert reports[1]["rank0_only"].startswith("DeftError: ") and "1 other rank(s) refused" in reports[1]["rank0_only"]
    assert reports[1]["rank0_only:untouched"] and reports[0]["rank0_only:untouched"]


@pytest.mark.parametrize("numpy_scalar", [False, True])
def test_previous_format_dcp_checkpoint_resumes_exactly(first, second, folder, numpy_scalar):
    """Saved after step 1 the previous way: read as it is (or, with a numpy scalar, refused, then converted) and
    continued to step 6 bit-identically to the run that never stopped."""
    first(("dcp previous format", numpy_scalar))
    if numpy_scalar:
        for error in first.errors(("dcp refused", True)):
            assert error is not None and "DeftError" in error and "convert-checkpoint --trust" in error, error
        assert second[1]["dcp"] == [str(folder / "dcp-True")]
    resumed = (second[0] if numpy_scalar else first)(("dcp resumed", numpy_scalar))
    dcp_straight = first("dcp straight")
    for rank in range(2):
        expected, actual = dcp_straight[rank], resumed[rank]
        assert actual["step_count"] == expected["step_count"] == STOP and actual["lr"] == expected["lr"]
        assert_resumed_as_straight(rank, expected, actual)
        drop = lambda state: {k: v for k, v in state.items() if k != "attribution_budget"}  # noqa: E731 (wall clock)
        assert drop(actual["preserver"]) == drop(expected["preserver"])


def test_trainer_step_states_that_would_run_code_are_refused_on_every_rank(second, folder):
    marker = str(folder / "trainer-marker")
    reports = second[0]("trainer refusals")
    for report in reports:
        assert not report["marker"] and not os.path.exists(marker)
        for name in REFUSALS:
            _expect(report[name], name)
    assert "names getattr" in reports[0]["rank0_only"]
    assert "1 other rank(s) refused" in reports[1]["rank0_only"]


@pytest.mark.parametrize("variant", TRAINER_VARIANTS)
def test_previous_format_trainer_checkpoint_resumes_exactly(first, second, variant):
    """A Trainer checkpoint whose step states were written the previous way resumes to the losses, parameters,
    optimizer state and Preserver state of the run that never stopped (with a numpy scalar: after conversion)."""
    straight = first("trainer straight")
    if variant == "previous_format_numpy":
        assert len(second[1]["trainer"]) == 2
    resumed = second[0](("trainer resumed", variant))
    for rank in range(2):
        expected, actual = straight[rank], resumed[rank]
        assert actual["step_count"] == expected["step_count"] == 6
        assert [actual["losses"][t] for t in (4, 5, 6)] == [expected["losses"][t] for t in (4, 5, 6)]
        for name, tensor in expected["params"].items():
            assert torch.equal(tensor, actual["params"][name]), f"rank {rank}: {name} differs after resuming"
        for name, tensor in expected["optimizer"].items():
            assert torch.equal(tensor, actual["optimizer"][name]), f"rank {rank}: optimizer {name} differs"
        drop = lambda state: {k: v for k, v in state.items() if k != "attribution_budget"}  # noqa: E731 (wall clock)
        assert drop(actual["preserver"]) == drop(expected["preserver"])
