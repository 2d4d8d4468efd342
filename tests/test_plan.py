"""Plan/Profile data model: JSON round trip, stable hash, validation catches bad plans."""

from __future__ import annotations

import ast
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from deft_compile.planner.plan import (
    CommItem,
    LinkCost,
    ParamProfile,
    ParamSlice,
    Plan,
    Profile,
    before_forward_of_layer,
    dtype_bytes,
    layer_of_point,
)

REPO = Path(__file__).resolve().parents[1]
PLANNER_FILES = ["deft_compile/planner/plan.py", "deft_compile/planner/simulator.py", "deft_compile/tools/simulate.py",
                 "deft_compile/planner/zoo_profiles.py", *sorted(
                     str(p.relative_to(REPO)) for p in (REPO / "deft_compile/solvers").glob("*.py"))]


def small_profile() -> Profile:
    params = [ParamProfile("head.w", 1000, "float32", 1.0, 2.0, 0.1, layer=2),
              ParamProfile("mid.w", 300, "float32", 1.5, 3.0, 0.1, layer=1),
              ParamProfile("emb.w", 500, "float16", 0.5, 1.0, 0.1, layer=0, bucket_key="half")]
    return Profile(params, [LinkCost("nccl", 0.05, 1e-5), LinkCost("gloo", 0.2, 3e-5)],
                   world_size=4, extra_forward_ms=0.25, extra_backward_ms=0.5, name="small")


def small_plan() -> Plan:
    items = [
        CommItem(0, (ParamSlice(2, 0, 500),), link=1, window="forward-next", delay=1, order=0,
                 wait_at="before-update-next-step", update_at="next-step", bucket=2),
        CommItem(1, (ParamSlice(0, 0, 600),), link=0, order=1, period=2, period_offset=1, bucket=0),
        CommItem(2, (ParamSlice(0, 600, 400), ParamSlice(1, 0, 300)), link=0, order=2, period=2,
                 period_offset=1, bucket=1),
    ]
    return Plan("deft", items, options={"max_period": 2, "weights": (1.5, 2)},
                predicted_iteration_ms=12.5, metadata={"note": "hand made"})


def test_profile_round_trip_and_totals() -> None:
    profile = small_profile()
    again = Profile.from_json(profile.to_json())
    assert again == profile
    assert profile.forward_ms == pytest.approx(3.0 + 0.25)
    assert profile.backward_ms == pytest.approx(6.0 + 0.5)
    assert profile.total_bytes == 1000 * 4 + 300 * 4 + 500 * 2
    assert profile.links[0].cost(1000) == pytest.approx(0.05 + 0.01)


def test_profile_buckets_follow_ddp_and_separate_keys() -> None:
    profile = small_profile()
    # 4000 B closes the first bucket at a 1000 B first limit; 'half' never joins float32
    assert profile.buckets(first_bucket_bytes=1000, bucket_cap_bytes=10_000) == [[0], [1], [2]]
    assert profile.buckets(first_bucket_bytes=100_000, bucket_cap_bytes=100_000) == [[0, 1], [2]]


def test_plan_json_round_trip_is_exact() -> None:
    plan = small_plan()
    text = plan.to_json()
    again = Plan.from_json(text)
    assert again == plan
    assert again.to_json() == text
    assert again.hash() == plan.hash()
    assert plan.options["weights"] == [1.5, 2]  # stored JSON-normalised


def test_hash_covers_decisions_not_predictions() -> None:
    plan = small_plan()
    other = Plan.from_dict(plan.to_dict())
    other.predicted_iteration_ms = 99.0
    other.metadata = {"different": True}
    assert other.hash() == plan.hash()
    changed = Plan("deft", [dataclasses.replace(plan.items[0], link=0), *plan.items[1:]],
                   options=plan.options)
    assert changed.hash() != plan.hash()
    assert len(plan.hash()) == 64


def test_hash_is_computed_once_and_anew_for_new_items_or_options() -> None:
    """The running step asks for its plan's hash on every call: it is cached, but a plan given another item list
    or other options is hashed from them."""
    plan = small_plan()
    first = plan.hash()
    assert plan.hash() is first  # the cached digest, not a recomputation
    plan.items = [dataclasses.replace(plan.items[0], link=0), *plan.items[1:]]
    assert plan.hash() != first
    plan.items = list(small_plan().items)
    assert plan.hash() == first
    plan.options = {**plan.options, "extra": 1}
    assert plan.hash() != first


def test_hash_is_identical_in_another_process() -> None:
    plan = small_plan()
    code = ("import sys; from deft_compile.planner.plan import Plan; "
            "print(Plan.from_json(sys.stdin.read()).hash())")
    result = subprocess.run([sys.executable, "-c", code], input=plan.to_json(), text=True,
                            capture_output=True, cwd=REPO, check=True,
                            env={"PYTHONPATH": str(REPO), "PYTHONHASHSEED": "123"})
    assert result.stdout.strip() == plan.hash()


def test_valid_plan_passes_and_queries_work() -> None:
    profile, plan = small_profile(), small_plan()
    plan.validate(profile)
    assert plan.items_of_param()[0] == [plan.items[1], plan.items[2]]
    assert plan.param_schedule() == {2: (1, 1, 0), 0: (0, 2, 1), 1: (0, 2, 1)}
    assert [item.nbytes(profile) for item in plan.items] == [1000, 2400, 1600 + 1200]
    table = plan.table(profile)
    assert "p0[600:1000],p1" in table and "forward-next" in table and "2+1" in table


def test_plan_items_are_kept_in_issue_order() -> None:
    plan = small_plan()
    shuffled = Plan("deft", list(reversed(plan.items)), options=plan.options)
    assert [item.order for item in shuffled.items] == [0, 1, 2]
    assert shuffled.hash() == plan.hash()


def _with(plan: Plan, index: int, **changes) -> Plan:
    items = list(plan.items)
    items[index] = dataclasses.replace(items[index], **changes)
    return Plan(plan.policy, items, options=plan.options)


@pytest.mark.parametrize("index, changes, message", [
    (1, {"slices": (ParamSlice(0, 0, 500),)}, "gap"),
    (1, {"slices": (ParamSlice(0, 0, 700),)}, "overlap"),
    (2, {"slices": (ParamSlice(0, 600, 400),)}, "never communicated"),
    (0, {"link": 5}, "link"),
    (1, {"delay": 1}, "delayed item"),
    (0, {"delay": 0, "wait_at": "end-of-backward", "update_at": "step"}, "needs delay 1"),
    (1, {"window": "sideways"}, "unknown window"),
    (2, {"period": 2, "period_offset": 2}, "bad period"),
    (2, {"slices": (ParamSlice(0, 600, 400), ParamSlice(1, 0, 300), ParamSlice(2, 0, 1))},
     "mixes dtypes"),
    (1, {"wait_at": "somewhere"}, "unknown wait"),
    (1, {"wait_at": before_forward_of_layer(2), "update_at": "step"}, "same update point"),
    (1, {"order": 7}, "orders"),
])
def test_validation_rejects(index: int, changes: dict, message: str) -> None:
    bad = _with(small_plan(), index, **changes)
    with pytest.raises(ValueError, match=message):
        bad.validate(small_profile())


def test_validation_rejects_window_out_of_program_order() -> None:
    plan = small_plan()
    items = [dataclasses.replace(plan.items[0], order=2), dataclasses.replace(plan.items[1], order=0),
             dataclasses.replace(plan.items[2], order=1)]
    with pytest.raises(ValueError, match="issued after a later window"):
        Plan("deft", items).validate(small_profile())


def test_validation_rejects_mixed_schedules_of_one_param() -> None:
    plan = _with(_with(small_plan(), 2, period=1, period_offset=0), 1, period=1, period_offset=0)
    plan.validate(small_profile())  # p0 split over two items, both K=1: fine
    mixed = _with(small_plan(), 1, period=1, period_offset=0)
    with pytest.raises(ValueError, match="different delay/period"):
        mixed.validate(small_profile())


def test_per_layer_wait_must_precede_first_use() -> None:
    profile = small_profile()
    point = before_forward_of_layer(2)
    items = [CommItem(0, (ParamSlice(0, 0, 1000), ParamSlice(1, 0, 300)), order=0, wait_at=point,
                      update_at=point),
             CommItem(1, (ParamSlice(2, 0, 500),), order=1, wait_at=before_forward_of_layer(0),
                      update_at=before_forward_of_layer(0))]
    with pytest.raises(ValueError, match="uses it first"):
        Plan("usbyte", items).validate(profile)
    items[0] = dataclasses.replace(items[0], wait_at=before_forward_of_layer(1),
                                   update_at=before_forward_of_layer(1))
    Plan("usbyte", items).validate(profile)


def test_vocabulary_helpers() -> None:
    assert dtype_bytes("torch.bfloat16") == 2 and dtype_bytes("float64") == 8
    with pytest.raises(ValueError):
        dtype_bytes("float7")
    assert layer_of_point(before_forward_of_layer(12)) == 12
    assert layer_of_point("end-of-backward") is None


def test_profile_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        Profile([], [LinkCost("l", 0, 0)])
    with pytest.raises(ValueError):
        Profile([ParamProfile("p", 0)], [LinkCost("l", 0, 0)])
    with pytest.raises(ValueError):
        Profile([ParamProfile("p", 1)], [LinkCost("l", -1, 0)])


@pytest.mark.parametrize("path", PLANNER_FILES)
def test_planner_modules_do_not_import_torch(path: str) -> None:
    tree = ast.parse((REPO / path).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        else:
            continue
        assert not any(name == "torch" or name.startswith("torch.") for name in names), path


def test_plan_json_is_plain_json() -> None:
    data = json.loads(small_plan().to_json())
    assert data["items"][2]["slices"] == [[0, 600, 400], [1, 0, 300]]
