"""Debugging artifacts: plan/profile/timeline files, Gantt PNG, measured trace, TORCH_TRACE, graph dumps, explain."""

from __future__ import annotations

import ast
import json
import logging
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from deft_compile.debug import artifacts
from deft_compile.debug.artifacts import (
    ascii_timeline,
    gantt_png,
    measured_gantt_png,
    measured_timeline,
    trace_artifacts,
    trace_event_names,
    write_plan_artifacts,
)
from deft_compile.planner.plan import LinkCost, ParamProfile, Plan, Profile
from deft_compile.planner.simulator import simulate
from deft_compile.planner.solvers import POLICIES, SCHEDULING_POLICIES, solve

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _profile(links: int = 1) -> Profile:
    """Six parameters in three layers, communication about as long as the backward."""
    sizes = [4096, 64, 262144, 256, 524288, 512]
    params = [ParamProfile(f"p{i}", n, forward_ms=0.4, backward_ms=0.8, update_ms=0.05, layer=(5 - i) // 2)
              for i, n in enumerate(sizes)]
    link_costs = [LinkCost("fast", 0.05, 1.2e-6), LinkCost("slow", 0.2, 3e-6)][:links]
    return Profile(params, link_costs, world_size=4, name="toy")


def _chrome_events(path: Path) -> list[dict]:
    data = json.loads(path.read_text())
    assert isinstance(data, dict) and isinstance(data["traceEvents"], list)
    spans = [ev for ev in data["traceEvents"] if ev.get("ph") == "X"]
    assert spans, f"{path} has no complete events"
    for ev in spans:
        assert {"name", "ph", "ts", "dur", "pid", "tid"} <= set(ev), ev
        assert ev["dur"] >= 0
    return spans


@pytest.mark.parametrize("policy", POLICIES)
def test_plan_artifacts_exist_parse_and_round_trip(tmp_path, policy):
    profile = _profile()
    plan = solve(profile, policy, **({"first_bucket_bytes": 16384, "bucket_cap_bytes": 1 << 20}
                                     if policy in ("wfbp", "deft") else {}))
    written = write_plan_artifacts(tmp_path, profile, plan)
    names = {p.name for p in written}
    assert names == {"plan.txt", "plan.json", "profile.json", "timeline_simulated.json", "timeline_simulated.png"}
    assert all(p.exists() and p.stat().st_size > 0 for p in written)

    loaded = Plan.from_json((tmp_path / "plan.json").read_text())
    assert loaded.hash() == plan.hash() and loaded.to_dict() == plan.to_dict()
    assert Profile.from_json((tmp_path / "profile.json").read_text()).to_dict() == profile.to_dict()
    text = (tmp_path / "plan.txt").read_text()
    assert plan.hash()[:12] in text and f"policy={policy}" in text and "simulated" in text

    spans = _chrome_events(tmp_path / "timeline_simulated.json")
    timeline = simulate(profile, plan)
    comm = [ev for ev in spans if ev["pid"] == 1]
    assert len(comm) == len(timeline.comm_events()) and comm
    assert {ev["cat"] for ev in spans if ev["pid"] == 0} >= {"forward", "backward"}
    assert (tmp_path / "timeline_simulated.png").read_bytes()[:8] == PNG_MAGIC


def test_gantt_has_one_row_per_link_plus_compute(tmp_path):
    profile = _profile(links=2)
    plan = solve(profile, "deft", first_bucket_bytes=16384, bucket_cap_bytes=1 << 20)
    timeline = simulate(profile, plan)
    gantt = gantt_png(timeline, tmp_path / "g.png", "toy", plan=plan)
    assert gantt is not None and gantt.path.read_bytes()[:8] == PNG_MAGIC
    assert gantt.rows == ["compute", "link 0: fast", "link 1: slow"]
    assert gantt.bars["compute"] > 0
    used_links = {item.link for item in plan.items}
    for link in used_links:
        assert gantt.bars[gantt.rows[1 + link]] > 0
    # The text version has the same rows.
    text = ascii_timeline(timeline)
    assert [line.split("|")[0].strip() for line in text.splitlines()[1:]] == ["compute", "link 0", "link 1"]


def test_png_is_skipped_without_matplotlib(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(artifacts, "_pyplot", lambda: None)
    profile = _profile()
    with caplog.at_level(logging.WARNING, logger="deft_compile"):
        written = write_plan_artifacts(tmp_path, profile, solve(profile, "wfbp"))
    assert "timeline_simulated.png" not in {p.name for p in written}
    assert not (tmp_path / "timeline_simulated.png").exists()
    assert "matplotlib" in caplog.text


def _mlp_step(dump_dir=None, policy="deft"):
    from deft_compile import deft_compile
    from deft_compile.tools.presets import get_preset

    model, optimizer, loss_fn, args, kwargs = get_preset("mlp").make(batch_size=16)
    return deft_compile(model, optimizer, loss_fn, dump_dir=dump_dir, policy=policy), args, kwargs


def test_graph_dumps_describe_the_graph_that_ran(tmp_path):
    step, args, kwargs = _mlp_step(tmp_path)
    step(*args, **kwargs)
    step(*args, **kwargs)  # the same graph (the optimizer state exists from the first capture)
    from deft_compile.tools.presets import get_preset

    _, _, _, smaller, smaller_kwargs = get_preset("mlp").make(batch_size=8)
    step(*smaller, **smaller_kwargs)  # a second graph: another batch size
    graphs = sorted(p for p in tmp_path.iterdir() if p.name.startswith("graph_"))
    assert [p.name for p in graphs] == ["graph_00", "graph_01"]
    for folder in graphs:
        records = json.loads((folder / "passes.json").read_text())
        assert records[0]["pass"] == "captured"
        for record in records:
            text = (folder / record["file"]).read_text()
            assert f"# nodes: {record['nodes']}" in text
            ast.parse(text)  # the dumps are valid Python
    last = json.loads((tmp_path / "graph_01" / "passes.json").read_text())[-1]
    ran = step.graph.graph_module
    assert last["nodes"] == len(ran.graph.nodes)
    code = ran.print_readable(print_output=False, include_stride=False, include_device=False)
    assert (tmp_path / "graph_01" / last["file"]).read_text().endswith(code.replace("class <lambda>(", "class StepGraph(", 1))


def test_measured_timeline_single_process(tmp_path):
    step, args, kwargs = _mlp_step()
    path = measured_timeline(lambda: step(*args, **kwargs), tmp_path / "measured.json", warmup=2)
    spans = _chrome_events(path)
    names = {ev["name"] for ev in spans}
    assert "deft_compile.step 0" in names
    assert any(name.startswith("aten::") for name in names)
    assert path.with_suffix(".png").read_bytes()[:8] == PNG_MAGIC


def _measured_worker(rank: int, world_size: int, out: str) -> list[str]:
    # wfbp: every step communicates, and no later step retraces (a deft plan with an update period would).
    step, args, kwargs = _mlp_step(policy="wfbp")
    step(*args, **kwargs)
    step(*args, **kwargs)
    path = measured_timeline(lambda: step(*args, **kwargs), Path(out) / f"rank{rank}.json", gantt=False)
    gantt = measured_gantt_png(path, path.with_suffix(".png"))
    return sorted(trace_event_names(path)), gantt.rows, gantt.bars


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory):
    """The per-rank values of this file's 2-process runs, in one process pair in turn (tests/batched.py), and the
    folder each run writes in."""
    from batched import Case, launch_cases
    from workers import dumped_deft_run

    folders = {name: tmp_path_factory.mktemp(name) for name in ("measured", "recorder", "dumped")}
    return launch_cases(request, [
        Case("measured", _measured_worker, (str(folders["measured"]),),
             tests=("test_measured_timeline_shows_gloo_collectives",)),
        Case("recorder", _recorder_worker, (str(folders["recorder"]),), tests=("test_step_recorder_sees_every_collective",)),
        Case("dumped", dumped_deft_run, (str(folders["dumped"]), 4), tests=("test_runtime_dump_folder_describes_the_run",)),
    ]), folders


def test_measured_timeline_shows_gloo_collectives(launched):
    outcome, folders = launched
    for rank, (names, rows, bars) in enumerate(outcome("measured")):
        assert "gloo:all_reduce" in names, sorted(names)
        assert "c10d::allreduce_" in names and "_c10d_functional::wait_tensor" in names
        assert (folders["measured"] / f"rank{rank}.json").exists()
        # compute row + at least one gloo thread row, each with bars
        assert rows[0] == "compute" and len(rows) >= 2 and all(bars[row] > 0 for row in rows)


def _recorder_worker(rank: int, world_size: int, out: str) -> dict:
    """The step recorder around two wfbp steps of a model with BatchNorm buffers (all-reduces and a broadcast)."""
    import torch

    from deft_compile import DeftConfig, deft_compile
    from deft_compile.debug.artifacts import MeasuredTimelineRecorder, trace_event_counts

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64, bias=False), torch.nn.BatchNorm1d(64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = deft_compile(model, optimizer, torch.nn.functional.cross_entropy, policy="wfbp",
                        config=DeftConfig(first_bucket_mb=0.005, bucket_cap_mb=0.01))
    inputs, targets = torch.randn(16, 32), torch.randint(0, 4, (16,))
    step(inputs, targets)
    step(inputs, targets)
    recorder = MeasuredTimelineRecorder(Path(out) / f"rank{rank}.json", steps=2)
    for _ in range(2):
        recorder.around(lambda: step(inputs, targets))
    code = step.graph.graph_module.code
    return {"counts": trace_event_counts(recorder.path), "all_reduces": code.count("_c10d_functional.all_reduce"),
            "broadcasts": code.count("_c10d_functional.broadcast"), "waits": code.count("_c10d_functional.wait_tensor")}


def test_step_recorder_sees_every_collective(launched):
    """Every launch, every gloo execution and every wait of the steps recorded is in the timeline."""
    outcome, _folders = launched
    for report in outcome("recorder"):
        counts = report["counts"]
        assert report["all_reduces"] >= 2 and report["broadcasts"] >= 1
        assert counts.get("c10d::allreduce_", 0) == 2 * report["all_reduces"], counts
        assert counts.get("gloo:all_reduce", 0) == 2 * report["all_reduces"], counts
        assert counts.get("c10d::broadcast_", 0) == 2 * report["broadcasts"], counts
        assert counts.get("_c10d_functional::wait_tensor", 0) == 2 * report["waits"], counts
        assert counts.get("deft_compile.step 0") == 1 and counts.get("deft_compile.step 1") == 1


TRACE_SCRIPT = textwrap.dedent("""
    import torch, torch.fx
    from deft_compile.debug.artifacts import log_graph_pass, record_plan, structured_trace_enabled
    from deft_compile.planner.plan import LinkCost, ParamProfile, Profile
    from deft_compile.planner.solvers import solve
    assert structured_trace_enabled()
    profile = Profile([ParamProfile("w", 1000, backward_ms=1.0, forward_ms=0.5),
                       ParamProfile("b", 10, backward_ms=0.1, forward_ms=0.1, layer=1)],
                      [LinkCost("l", 0.1, 1e-6)], world_size=2, name="tiny")
    plan = solve(profile, "deft")
    record_plan(profile, plan)
    gm = torch.fx.symbolic_trace(torch.nn.Linear(3, 2))
    log_graph_pass(0, 4, "strip_markers", gm)
    print(plan.hash())
""")


def test_torch_trace_captures_plan_profile_and_passes(tmp_path):
    env = dict(os.environ, TORCH_TRACE=str(tmp_path / "trace"))
    done = subprocess.run([sys.executable, "-c", TRACE_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    plan_hash = done.stdout.strip().splitlines()[-1]
    files = list((tmp_path / "trace").glob("*.log"))
    assert len(files) == 1
    found = trace_artifacts(files[0])
    assert Plan.from_dict(found["deft_plan"][0]).hash() == plan_hash
    assert plan_hash[:12] in found["deft_plan_table"][0]
    assert Profile.from_dict(found["deft_profile"][0]).name == "tiny"
    assert "def forward" in found["deft_graph_00_04_strip_markers"][0]


def test_log_structured_is_a_no_op_without_torch_trace():
    from torch._logging._internal import trace_log

    assert not artifacts.structured_trace_enabled(), [type(h).__name__ for h in trace_log.handlers]
    called = []
    assert artifacts.log_structured("x", lambda: called.append(1) or {}) is False
    assert not called


def test_explain_prints_every_policy(tmp_path, capsys):
    from deft_compile.tools.cli import main

    assert main(["explain", "--model", "mlp", "--repeats", "1", "--batch", "16", "--dump", str(tmp_path),
                 "--json", str(tmp_path / "summary.json")]) == 0
    out = capsys.readouterr().out
    assert "MODELLED, not measured" in out
    for policy in SCHEDULING_POLICIES:
        assert re.search(rf"^{policy}\s+\d+\.\d+\s+\d+\.\d+x", out, re.M), policy
        assert f"== {policy} ==" in out and f"policy={policy}" in out
        assert (tmp_path / policy / "plan.json").exists()
        assert (tmp_path / policy / "timeline_simulated.png").read_bytes()[:8] == PNG_MAGIC
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [r["policy"] for r in summary["results"]] == list(SCHEDULING_POLICIES)
    assert summary["results"][0]["speedup_vs_wfbp"] == 1.0


def test_explain_policy_subset_and_bad_world_size(capsys):
    from deft_compile.tools.cli import main

    assert main(["explain", "--model", "mlp", "--policy", "deft", "--repeats", "1", "--batch", "8",
                 "--no-tables"]) == 0
    out = capsys.readouterr().out
    rows = [line.split()[0] for line in out.splitlines() if re.match(r"^\w+\s+\d+\.\d+\s", line)]
    assert rows == ["deft"]
    assert main(["explain", "--model", "mlp", "--world-size", "1"]) == 2
    assert "world-size" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["mlp", "vgg", "resnet", "gpt2"])
def test_presets_train_one_step(name):
    from deft_compile.tools.presets import get_preset

    model, optimizer, loss_fn, args, kwargs = get_preset(name).make(batch_size=2)
    loss = model(*args, **kwargs) if loss_fn is None else loss_fn(model(args[0]), args[1])
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_runtime_dump_folder_describes_the_run(launched):
    """A 2-rank deft run with dump_dir: rank 0 writes the plan artifacts, every rank its measured timeline
    (with the gloo all-reduces of the step) and per-pass graphs whose last file is the code that ran."""
    from deft_compile.planner.plan import Plan

    outcome, folders = launched
    results, tmp_path = outcome("dumped"), folders["dumped"]
    plan_dir = tmp_path / "rank0" / "plan"
    assert Plan.from_json((plan_dir / "plan.json").read_text()).hash() == results[0]["plan_hash"]
    assert json.loads((plan_dir / "timeline_simulated.json").read_text())["traceEvents"]
    assert (plan_dir / "timeline_simulated.png").read_bytes()[:8] == PNG_MAGIC
    assert not (tmp_path / "rank1" / "plan").exists(), "plan artifacts are written once, by rank 0"
    for rank, result in enumerate(results):
        folder = tmp_path / f"rank{rank}"
        names = trace_event_names(folder / f"timeline_measured_rank{rank}.json")
        assert "deft_compile.step 0" in names
        assert any("all_reduce" in name or "allreduce" in name for name in names), sorted(names)[:20]
        steady = sorted(p for p in folder.iterdir() if p.name.startswith("graph_"))[-1]
        records = json.loads((steady / "passes.json").read_text())
        last = (steady / records[-1]["file"]).read_text()
        ast.parse(last)
        assert re.findall(r"torch\.ops\.[\w.]+(?=\()", last) == re.findall(r"torch\.ops\.[\w.]+(?=\()", result["code"])
