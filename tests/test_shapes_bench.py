"""``benchmarks/shapes.py``'s trainer part: a warm run is measured on the Inductor cache an unmeasured run of the same
variant filled just before it; a cold run on a cache of its own (the launcher is replaced by a recorder: no
processes start)."""

from __future__ import annotations

from types import SimpleNamespace

import shapes

import deft_compile.tools.launcher as launcher


def _recording(monkeypatch) -> list[tuple[str, str]]:
    calls: list[tuple[str, str]] = []

    def run_local_workers(worker, world_size, args, **kwargs):
        variant = args[0]
        calls.append((variant, kwargs["env"]["TORCHINDUCTOR_CACHE_DIR"]))
        return [SimpleNamespace(value={"variant": variant, "train_s": float(len(calls)), "losses": [1.0]})
                for _ in range(world_size)]

    monkeypatch.setattr(launcher, "run_local_workers", run_local_workers)
    return calls


def test_a_warm_run_is_measured_on_the_cache_its_unmeasured_twin_filled(monkeypatch):
    calls = _recording(monkeypatch)
    runs = shapes.run_trainer(2, 3, ("trainer", "deft"), warm=True)
    assert [r["variant"] for r in runs] == ["trainer", "deft", "deft", "trainer"]  # order rotates per launch
    assert len(calls) == 8 and all(r["cache"] == "warm" for r in runs)
    for first, second in zip(calls[::2], calls[1::2]):
        assert first == second  # the same variant, the same cache folder: filled, then measured
    assert len({cache for _, cache in calls[::2]}) == 4  # each measured run has a cache of its own
    assert [r["train_s"] for r in runs] == [2.0, 4.0, 6.0, 8.0]  # the second (measured) run's numbers


def test_a_cold_run_starts_on_an_empty_cache_of_its_own(monkeypatch):
    calls = _recording(monkeypatch)
    runs = shapes.run_trainer(1, 3, ("trainer", "deft"))
    assert len(calls) == 2 and len({cache for _, cache in calls}) == 2
    assert all(r["cache"] == "cold" for r in runs)
    summary = shapes.summarise_trainer(runs)
    assert summary["deft"]["train_s_median"] == 2.0 and summary["deft"]["worst_loss_rel_vs_trainer"] == 0.0
