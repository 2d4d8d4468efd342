"""The time-to-accuracy benchmark: one real end-to-end run per workload (tiny GPT-2 and tiny BatchNorm ResNet, 2
gloo workers, unshaped loopback, a few steps; about 30 s together) and unit tests of its analysis."""

from __future__ import annotations

import gzip
import itertools
import json
import math

import pytest
import torch

from deft_compile.tools import cli
import tta  # benchmarks/tta.py (conftest.py puts benchmarks/ on sys.path)

STEPS, EVAL_EVERY = 8, 4
VARIANTS = ("ddp", "deft", "deft-sync")  # the default set adds two deft variants that run the same code paths
DOCS = "# Title\n\nintro\n\n## Results\n\n<!-- tta:begin -->\nNot yet run.\n<!-- tta:end -->\n\ntail text\n"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("tta")
    docs = out / "TTA.md"
    docs.write_text(DOCS)
    cfg = tta.TTAConfig(size="tiny", steps=STEPS, eval_every=EVAL_EVERY, chunk=3, batch=2, val_windows=8,
                        corpus_bytes=300_000, variants=VARIANTS, progress=False)
    record = tta.run_benchmark(cfg, [0], bandwidth=None, measure_cr=False, timeout_s=240, json_path=out / "tta.json",
                               plot_dir=out, docs_path=docs, command="pytest", log=lambda message: None)
    return record, out, docs


def test_every_variant_is_evaluated_on_the_same_schedule(run):
    record, _, _ = run
    variants = record["runs"]["0"]["variants"]
    assert list(variants) == list(VARIANTS)
    for name, value in variants.items():
        evals = value["evals"]
        assert [e["step"] for e in evals] == [0, 4, 8], name
        times = [e["time_s"] for e in evals]
        assert times[0] == 0.0 and all(b > a for a, b in itertools.pairwise(times)), (name, times)
        assert all(math.isfinite(e["val_loss"]) for e in evals)
        assert len(value["step_s"]) == len(value["train_loss"]) == STEPS
        assert value["train_s"] >= times[-1] - 1e-9
    assert variants["ddp"]["evals"][-1]["val_loss"] < variants["ddp"]["evals"][0]["val_loss"]  # it trained


def test_all_variants_start_from_the_same_weights(run):
    record, _, _ = run
    first = {name: v["evals"][0]["val_loss"] for name, v in record["runs"]["0"]["variants"].items()}
    assert len(set(first.values())) == 1, first
    assert first["ddp"] == pytest.approx(math.log(256), rel=0.05)  # random init: about uniform over bytes


def test_a_synchronous_deft_plan_trains_exactly_like_ddp(run):
    """Same weights, same batches, same schedule: a plan without delays or periods must reproduce DDP's
    validation losses (AdamW, aten graphs: round-off only). Fails if batches, schedule or flushes differ."""
    record, _, _ = run
    variants = record["runs"]["0"]["variants"]
    sync = variants["deft-sync"]
    assert all(h["delayed_items"] == 0 and h["max_period"] == 1 for h in sync["plan_history"])
    ddp_losses = [e["val_loss"] for e in variants["ddp"]["evals"]]
    assert [e["val_loss"] for e in sync["evals"]] == pytest.approx(ddp_losses, rel=1e-4)
    assert sync["train_loss"] == pytest.approx(variants["ddp"]["train_loss"], rel=1e-4)


def test_summary_and_overheads(run):
    record, _, _ = run
    summary = record["summary"]
    rows = summary["per_seed"][0]
    ddp_final = record["runs"]["0"]["variants"]["ddp"]["evals"][-1]["val_loss"]
    assert rows["ddp"]["target"] == ddp_final and rows["ddp"]["speedup"] == pytest.approx(1.0)
    assert rows["deft-sync"]["final_vs_ddp"] == pytest.approx(0.0, abs=1e-4)
    for name, row in rows.items():
        over = row["overheads"]
        for key in ("first_step", "retrace", "probe", "flush", "chunk_sync", "runtime"):
            assert 0.0 <= over[f"{key}_share"] <= 1.0, (name, key, over)
        parts = over["runtime_s"] + over["flush_s"] + over["chunk_sync_s"]
        assert parts <= over["train_s"] * 1.001, (name, over)
        if name != "ddp":
            assert over["first_step_s"] > 0  # profiling + planning + the first trace
            assert row["trace_count"] >= 1
    assert summary["targets"] is not None and isinstance(summary["targets"]["speedup_met"], bool)


def test_outputs_written(run):
    record, out, docs = run
    saved = json.loads((out / "tta.json").read_text())
    assert saved["summary"]["aggregate"].keys() == set(VARIANTS)
    assert sorted(p.split("/")[-1] for p in record["pngs"]) in ([], ["time_to_accuracy_steps.png",
                                                                     "time_to_accuracy_time.png"])
    for png in record["pngs"]:
        assert (out / png.split("/")[-1]).stat().st_size > 1000
    text = docs.read_text()
    assert "Not yet run" not in text and "| variant | final val loss |" in text
    assert text.startswith("# Title\n\nintro\n") and text.endswith("<!-- tta:end -->\n\ntail text\n")
    assert text.count(tta.BEGIN) == 1 and text.count(tta.END) == 1
    # the saved results render again, their summary computed afresh from the runs
    import time_to_accuracy

    again = out / "again.md"
    assert time_to_accuracy.main(["--render", str(out / "tta.json"), "--docs", str(again)]) == 0
    assert "| deft-sync |" in again.read_text() and "| gpt2 tiny | - |" in again.read_text()


# --------------------------------------------------------------------------- pure


def test_time_to_target_interpolates_linearly():
    curve = [(0.0, 5.0), (10.0, 3.0), (20.0, 2.0), (30.0, 1.5)]
    assert tta.time_to_target(curve, 2.5) == pytest.approx(15.0)
    assert tta.time_to_target(curve, 2.0) == pytest.approx(20.0)
    assert tta.time_to_target(curve, 1.5) == pytest.approx(30.0)
    assert tta.time_to_target(curve, 1.49) is None
    assert tta.time_to_target(curve, 6.0) == 0.0
    # first crossing, not the last point: a curve that dips, rises and falls again
    assert tta.time_to_target([(0, 5.0), (10, 2.0), (20, 3.0), (30, 1.0)], 2.5) == pytest.approx(25 / 3)
    # a round-off miss (a synchronous plan vs DDP) reaches it; a real one does not
    assert tta.time_to_target([(0, 5.0), (10, 2.0 * (1 + 2e-5))], 2.0) == pytest.approx(10.0)
    assert tta.time_to_target([(0, 5.0), (10, 2.0 * (1 + 1e-3))], 2.0) is None


def _variant(times, losses, step_s, *, traced=None, probed=None, trace_s=None, flush_s=0.0, sync_s=0.0):
    steps = [0, *range(10, 10 * len(times), 10)]
    return {"evals": [{"step": s, "time_s": t, "val_loss": v} for s, t, v in zip(steps, times, losses)],
            "step_s": step_s, "traced": traced or [0.0] * len(step_s), "probed": probed or [0.0] * len(step_s),
            "trace_s": trace_s or [0.0] * len(step_s), "flush_s": flush_s, "sync_s": sync_s, "train_s": times[-1]}


def test_summarise_hand_made_run():
    plain = [0.5] * 20
    run = {"variants": {
        "ddp": _variant([0.0, 10.0, 20.0], [5.0, 3.0, 2.0], [1.0] * 20),
        "deft": _variant([0.0, 5.0, 10.0], [5.0, 2.5, 1.9], plain),
        "slow": _variant([0.0, 30.0, 60.0], [5.0, 2.6, 2.1], [3.0] * 20),
    }}
    summary = tta.summarise({0: run})
    rows = summary["per_seed"][0]
    assert rows["ddp"]["time_to_target_s"] == pytest.approx(20.0)
    assert rows["deft"]["time_to_target_s"] == pytest.approx(5 + 5 * 0.5 / 0.6)
    assert rows["deft"]["speedup"] == pytest.approx(20.0 / (5 + 5 * 0.5 / 0.6))
    assert rows["deft"]["final_vs_ddp"] == pytest.approx(-0.05)
    assert rows["deft"]["step_speedup"] == pytest.approx(2.0)
    assert rows["deft"]["steps_to_target"] == pytest.approx(10 + 10 * 0.5 / 0.6)
    assert rows["slow"]["time_to_target_s"] is None and rows["slow"]["speedup"] is None
    # within 1 % of DDP's final 2.0 (2.02): DDP at 10 + 10 * 0.98, deft at 5 + 5 * 0.48 / 0.6; slow ends at 2.1
    assert rows["deft"]["speedup_near"] == pytest.approx((10 + 10 * 0.98) / (5 + 5 * 0.48 / 0.6))
    assert rows["slow"]["speedup_near"] is None
    assert summary["aggregate"]["slow"]["reached"] == 0 and summary["aggregate"]["deft"]["reached"] == 1
    targets = summary["targets"]
    assert targets["speedup_met"] and targets["final_met"]
    table = tta.markdown_table(summary)
    assert "| slow |" in table and "never" in table.split("| slow |")[1]


def test_overheads_split_first_step_retraces_and_probes():
    step_s = [2.1, 0.1, 0.1, 0.6, 0.4, 0.1, 0.9]
    value = {"step_s": step_s, "traced": [1, 0, 0, 1, 0, 0, 1], "probed": [0, 0, 0, 0, 1, 0, 1],
             "trace_s": [2.0, 0, 0, 0.5, 0, 0, 0.3], "flush_s": 0.2, "sync_s": 0.1, "train_s": 5.0}
    over = tta.overheads(value)
    assert over["base_step_s"] == pytest.approx(0.1)
    assert over["first_step_s"] == pytest.approx(2.0)
    assert over["retrace_s"] == pytest.approx(0.5 + 0.3)  # the last call: its trace's 0.3 s ...
    assert over["probe_s"] == pytest.approx(0.3 + 0.5)  # ... and the rest of its 0.8 s excess
    assert over["runtime_share"] == pytest.approx((2.0 + 0.8 + 0.8) / 5.0)
    assert over["flush_share"] == pytest.approx(0.04) and over["chunk_sync_share"] == pytest.approx(0.02)


def test_batches_are_deterministic_and_split_across_ranks():
    corpus = torch.arange(10_000, dtype=torch.int64) % 251
    common = {"context": 16, "batch": 3, "steps": 5, "seed": 7, "world_size": 2, "val_windows": 6}
    r0, r1 = tta.TextBatches(corpus, rank=0, **common), tta.TextBatches(corpus, rank=1, **common)
    again = tta.TextBatches(corpus, rank=0, **common)
    assert torch.equal(r0.batch_at(3)[0], again.batch_at(3)[0])  # same seed: same samples, whatever variant
    assert not torch.equal(r0.batch_at(3)[0], r1.batch_at(3)[0])
    assert torch.equal(r0.batch_at(2)[0], r0.batch_at(2)[1])  # labels are the inputs (the model shifts them)
    assert (r0.starts + 16 <= r0.train.numel()).all()  # training windows stay in the training split
    assert sum(v[0].shape[0] for v in r0.validation()) + sum(v[0].shape[0] for v in r1.validation()) == 6
    other = tta.TextBatches(corpus, rank=0, **{**common, "seed": 8})
    assert not torch.equal(r0.batch_at(0)[0], other.batch_at(0)[0])


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    factor = tta.lr_lambda(100, 10, 0.1)
    assert factor(0) == pytest.approx(0.1) and factor(9) == pytest.approx(1.0)
    assert factor(10) == pytest.approx(1.0) and factor(100) == pytest.approx(0.1)
    assert all(factor(t) >= factor(t + 1) for t in range(10, 100))


def test_docs_section_is_replaced_between_markers(tmp_path):
    path = tmp_path / "doc.md"
    path.write_text(DOCS)
    tta.write_docs_section(path, "new body")
    tta.write_docs_section(path, "newer body")
    assert path.read_text() == DOCS.replace("Not yet run.", "newer body")


def test_cli_dispatches_to_the_benchmark(monkeypatch):
    seen = {}

    def fake(cfg, seeds, **kwargs):
        seen.update(cfg=cfg, seeds=seeds, **kwargs)
        return {}

    monkeypatch.setattr(tta, "run_benchmark", fake)
    code = cli.main(["bench", "--time-to-accuracy", "--size", "tiny", "--steps", "12", "--eval-every", "4",
                     "--seeds", "3", "4", "--bandwidth", "none", "--no-progress"])
    assert code == 0
    assert seen["cfg"].size == "tiny" and seen["cfg"].steps == 12 and seen["cfg"].eval_every == 4
    assert seen["seeds"] == [3, 4] and seen["bandwidth"] is None
    code = cli.main(["bench", "--time-to-accuracy", "--size", "tiny", "--no-progress"])
    assert code == 0 and seen["bandwidth"] == "calibrate" and seen["cfg"].steps == tta.TTAConfig.steps


def test_script_runs_one_set_per_workload_and_coverage_rate(monkeypatch, tmp_path):
    import time_to_accuracy  # benchmarks/time_to_accuracy.py

    calls = []

    def fake(cfg, seeds, **kwargs):
        calls.append((cfg.workload, kwargs["coverage"], kwargs["plot_stem"], str(kwargs["json_path"])))
        return {"config": {"workload": cfg.workload, "size": cfg.size}, "coverage_rate": kwargs["coverage"],
                "coverage_target": kwargs["coverage"], "summary": {"aggregate": {}, "targets": None}}

    monkeypatch.setattr(tta, "run_benchmark", fake)
    monkeypatch.setattr(tta, "results_section", lambda record, docs_dir=None: f"section {record['config']['workload']}")
    docs = tmp_path / "TTA.md"
    docs.write_text(DOCS)
    code = time_to_accuracy.main(["--workload", "gpt2", "cnn", "--coverage", "2", "3", "--size", "tiny",
                                  "--out", str(tmp_path), "--docs", str(docs), "--no-progress"])
    assert code == 0
    assert [c[:3] for c in calls] == [("gpt2", 2.0, "tta_gpt2_tiny_cr2"), ("gpt2", 3.0, "tta_gpt2_tiny_cr3"),
                                      ("cnn", 2.0, "tta_cnn_tiny_cr2"), ("cnn", 3.0, "tta_cnn_tiny_cr3")]
    assert all(c[3].endswith(f"{c[2]}.json") for c in calls)
    text = docs.read_text()
    assert text.count("section gpt2") == 2 and text.count("section cnn") == 2 and "| workload | DDP's CR |" in text
    with pytest.raises(SystemExit):  # one results file cannot hold four sets
        time_to_accuracy.main(["--workload", "gpt2", "cnn", "--json", str(tmp_path / "x.json")])
    # --render rebuilds the section from saved results without running anything
    saved = tmp_path / "saved.json"
    saved.write_text(json.dumps(fake(tta.TTAConfig(workload="cnn", size="tiny"), [0], coverage=3.0,
                                     plot_stem="s", json_path="j")))
    docs.write_text(DOCS)
    assert time_to_accuracy.main(["--render", str(saved), "--docs", str(docs)]) == 0
    assert docs.read_text().count("section cnn") == 1 and "cnn tiny, DDP's coverage rate 3.00 (calibrated to 3)" in docs.read_text()
    packed = tmp_path / "saved.json.gz"
    packed.write_bytes(gzip.compress(saved.read_bytes()))
    docs.write_text(DOCS)
    assert time_to_accuracy.main(["--render", str(packed), str(saved), "--docs", str(docs)]) == 0
    assert docs.read_text().count("section cnn") == 2


# --------------------------------------------------------------------------- the CNN workload


@pytest.fixture(scope="module")
def cnn_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("tta-cnn")
    cfg = tta.TTAConfig(workload="cnn", size="tiny", steps=6, eval_every=3, chunk=2, batch=4, val_windows=32,
                        buckets="scaled", variants=("ddp", "ddp-compiled", "deft-sync", "ddp-fp16", "ddp-powersgd"),
                        progress=False)
    return tta.run_benchmark(cfg, [0], bandwidth=None, measure_cr=False, timeout_s=240, json_path=out / "cnn.json",
                             plot_dir=None, command="pytest", log=lambda message: None)


def test_cnn_workload_trains_and_synchronous_variants_match_ddp(cnn_run):
    """BatchNorm ResNet, SGD momentum, cosine schedule: deft's synchronous plan and torch.compile(DDP) give DDP's
    validation and training losses (round-off); DDP's validation loss falls on the teacher task."""
    variants = cnn_run["runs"]["0"]["variants"]
    ddp = variants["ddp"]
    assert len({v["evals"][0]["val_loss"] for v in variants.values()}) == 1
    assert ddp["evals"][-1]["val_loss"] < ddp["evals"][0]["val_loss"]
    for name in ("ddp-compiled", "deft-sync"):
        assert [e["val_loss"] for e in variants[name]["evals"]] == pytest.approx(
            [e["val_loss"] for e in ddp["evals"]], rel=1e-4), name
        assert variants[name]["train_loss"] == pytest.approx(ddp["train_loss"], rel=1e-4), name
    assert variants["ddp-compiled"]["torch_compile"] and not ddp["torch_compile"]
    for name in ("ddp-fp16", "ddp-powersgd"):  # the compression peers train, and not with DDP's exact numbers
        losses = [e["val_loss"] for e in variants[name]["evals"]]
        assert losses[-1] < losses[0] and losses != [e["val_loss"] for e in ddp["evals"]], name
    assert cnn_run["provenance"]["command"] == "pytest" and "commit" in cnn_run["provenance"]
    # scaled caps: DDP (and every variant) in several buckets; PowerSGD in one (its callbacks would race in gloo)
    assert cnn_run["ddp_buckets"] >= 4 and variants["ddp-powersgd"]["ddp_buckets"] == 1, cnn_run["ddp_buckets"]
    assert variants["deft-sync"]["delayed_update"] == "compensated"
    assert "DDP buckets: bucket cap" in tta.results_section(cnn_run)
    rows = cnn_run["summary"]["per_seed"][0]
    assert rows["ddp-compiled"]["compile_s"] > 0.0 and rows["ddp"]["compile_s"] == 0.0
    assert "ResNet `tiny`" in tta.results_section(cnn_run)


def test_image_batches_are_deterministic_split_across_ranks_and_teacher_labelled():
    import tta_cnn

    common = {"size": "tiny", "batch": 4, "seed": 3, "world_size": 2, "val_images": 10}
    r0, r1 = tta_cnn.ImageBatches(rank=0, **common), tta_cnn.ImageBatches(rank=1, **common)
    again = tta_cnn.ImageBatches(rank=0, **common)
    assert torch.equal(r0.batch_at(5)[0], again.batch_at(5)[0]) and not torch.equal(r0.batch_at(5)[0], r1.batch_at(5)[0])
    assert not torch.equal(r0.batch_at(5)[0], tta_cnn.ImageBatches(rank=0, **{**common, "seed": 4}).batch_at(5)[0])
    images, labels = r0.batch_at(0)
    assert images.shape == (4, 3, 16, 16) and labels.dtype == torch.int64
    assert sum(b[0].shape[0] for b in r0.validation()) + sum(b[0].shape[0] for b in r1.validation()) == 10
    # one teacher: the labels are a function of the pooled pixels (the same image gets the same label)
    x, y = tta_cnn.teacher_images(64, 16, torch.Generator().manual_seed(1))
    _, again_y = tta_cnn.teacher_images(64, 16, torch.Generator().manual_seed(1))
    assert torch.equal(y, again_y) and len(set(y.tolist())) > 3


def test_targets_follow_the_coverage_rate_and_the_overview_names_every_variant():
    assert tta.target_speedup(None) == 1.0 and tta.target_speedup(1.1) == 1.0
    assert tta.target_speedup(2.2) == 2.0 and tta.target_speedup(2.9) == 2.5
    run = {"variants": {"ddp": _variant([0.0, 10.0, 20.0], [5.0, 3.0, 2.0], [1.0] * 20),
                        "deft": _variant([0.0, 8.0, 16.0], [5.0, 2.5, 1.98], [0.8] * 20)}}
    summary = tta.summarise({0: run}, coverage=2.0)
    speedup = summary["per_seed"][0]["deft"]["speedup"]
    assert summary["targets"]["speedup_target"] == 2.0 and summary["targets"]["speedup_met"] == (speedup >= 2.0)
    record = {"config": {"workload": "cnn", "size": "small"}, "coverage_rate": 2.04, "summary": summary}
    table = tta.overview_table([record])
    assert "| cnn small | 2.04 |" in table and "`deft`" in table and f"{speedup:.2f}x" in table


def test_speedup_without_compile_takes_the_compile_off_the_clock():
    ddp = _variant([0.0, 10.0, 20.0], [5.0, 3.0, 2.0], [1.0] * 20)
    compiled = {**_variant([0.0, 40.0, 50.0], [5.0, 3.0, 2.0], [31.0] + [1.0] * 19), "torch_compile": True}
    rows = tta.summarise({0: {"variants": {"ddp": ddp, "compiled": compiled}}})["per_seed"][0]
    assert rows["compiled"]["compile_s"] == pytest.approx(30.0)
    assert rows["compiled"]["speedup"] == pytest.approx(20.0 / 50.0)
    assert rows["compiled"]["speedup_without_compile"] == pytest.approx(1.0)


def test_scaled_buckets_give_a_few_million_parameters_about_as_many_buckets_as_gpt2_124m():
    """``buckets="scaled"``: DDP's 25 MiB cap scaled by the gradient bytes over GPT-2 124M's. GPT-2 124M under DDP's
    defaults and the 1.8 M-parameter ``mini`` GPT-2 under the scaled cap get about 20 buckets each; the default cap
    would give the small model two."""
    from deft_compile.planner.bucketing import assign_buckets

    model = tta.build_model("mini")
    sizes = [p.numel() * p.element_size() for p in reversed(list(model.parameters())) if p.requires_grad]
    cap = tta.scaled_bucket_cap_mb(sum(sizes))
    assert cap == pytest.approx(25.0 * sum(sizes) / tta.REFERENCE_GRADIENT_BYTES)
    cfg = tta.TTAConfig(size="mini", buckets="scaled")
    assert tta.bucket_cap_of(cfg, model) == pytest.approx(cap) and tta.bucket_cap_of(tta.TTAConfig(), model) is None
    scaled = assign_buckets(sizes, first_bucket_bytes=int(cap * 2 ** 20), bucket_cap_bytes=int(cap * 2 ** 20))
    default = assign_buckets(sizes)
    assert 12 <= len(scaled) <= 30 and len(default) <= 2, (len(scaled), len(default))
    with pytest.raises(ValueError, match="scaled"):
        tta.TTAConfig(buckets="scaled", bucket_cap_mb=1.0)
    with pytest.raises(ValueError, match="label_noise"):
        tta.TTAConfig(workload="gpt2", label_noise=0.2)


def test_rows_name_the_coverage_rate_they_measured_and_their_buckets():
    record = {"config": {"workload": "gpt2", "size": "small", "buckets": "scaled"}, "ddp_buckets": 21,
              "coverage_rate": 2.86, "coverage_target": 2.0}
    assert tta.coverage_cell(record) == "2.86 (target 2, outside ±15%)"
    assert tta.coverage_cell({**record, "coverage_rate": 2.2}) == "2.20"
    assert tta.workload_label(record) == "gpt2 small (21 buckets)"
    noisy = {"config": {"workload": "cnn", "size": "small", "label_noise": 0.3}}
    assert tta.workload_label(noisy) == "cnn small (label noise 0.3)"
    assert tta.run_stem(tta.TTAConfig(size="small", buckets="scaled"), 2.0) == "tta_gpt2_small_scaled_cr2"
    assert tta.run_stem(tta.TTAConfig(workload="cnn", size="small", label_noise=0.3), 3) == \
        "tta_cnn_small_noise0.3_cr3"


def test_label_noise_replaces_that_share_of_labels_with_random_classes():
    import tta_cnn

    clean = tta_cnn.teacher_images(4000, 16, torch.Generator().manual_seed(1))[1]
    noisy = tta_cnn.teacher_images(4000, 16, torch.Generator().manual_seed(1), label_noise=0.3)[1]
    changed = float((clean != noisy).float().mean())
    assert 0.3 * 0.9 * 0.85 < changed < 0.3 * 0.9 * 1.15, changed  # a random class is the teacher's 1 time in 10
    common = {"size": "tiny", "batch": 4, "seed": 3, "world_size": 2, "val_images": 10, "rank": 0}
    assert torch.equal(tta_cnn.ImageBatches(label_noise=0.3, **common).batch_at(2)[1],
                       tta_cnn.ImageBatches(label_noise=0.3, **common).batch_at(2)[1])
