"""A model wrapped in DistributedDataParallel never communicates twice (2 gloo processes, collectives counted with
the torch profiler, SGD with Nesterov momentum and Dropout, ranks starting from different weights):

- ``deft_compile(DDP(model))`` trains ``model``, bit-identical to DDP alone, with one all-reduce per bucket per step
  and none from DDP; the DDP object communicates nothing afterwards. ``DDP(torch.compile(model))`` too.
- ``DDP(torch.compile(model, backend="deft"))`` (what ``transformers.Trainer`` builds around a compiled model):
  the backend's one all-reduce per bucket per backward, DDP's own none (also inside ``no_sync()``, which restores
  DDP's flag on exit), bit-identical to DDP alone. Without the rule it ran both (two all-reduces here).
- A DDP submodule, a parameter used outside the compiled graphs under ``DDP(compiled)`` and an optimizer inside a
  wrapper each raise a clear error naming the fix.
"""

from __future__ import annotations

import pytest

from deft_compile.tools.launcher import run_local_workers
from integration_workers import ddp_wrapped_scenarios


@pytest.fixture(scope="module")
def reports() -> list[dict]:
    return [r.value for r in run_local_workers(ddp_wrapped_scenarios, 2, timeout_s=240)]


def test_deft_compile_unwraps_ddp(reports):
    for rank, report in enumerate(reports):
        result = report["unwrapped"]
        assert result["trained"], "the step must train the module inside DDP"
        assert result["buckets"] >= 2
        for t, entry in enumerate(result["steps"]):
            assert entry["max_abs"] == 0.0 and not entry["missing"], f"rank {rank} step {t}: {entry}"
            assert entry["counts"].get("all_reduce") == result["buckets"], f"rank {rank} step {t}: {entry['counts']}"
            assert entry["ddp_counts"].get("all_reduce") == 1  # DDP alone: one bucket at its 25 MiB cap
        assert result["ddp_after"] == {}, "the unwrapped DDP object must not communicate"


def test_deft_compile_unwraps_a_compiled_module_inside_ddp(reports):
    for report in reports:
        assert report["compiled"]["trained"] and report["compiled"]["finite"]


def test_ddp_of_compiled_communicates_once(reports):
    for rank, report in enumerate(reports):
        result = report["ddp_of_compiled"]
        assert result["backend_buckets"] == 1
        for t, entry in enumerate(result["steps"]):
            assert entry["max_abs"] == 0.0 and not entry["missing"], f"rank {rank} step {t}: {entry}"
            assert entry["counts"].get("all_reduce") == 1, f"rank {rank} step {t}: {entry['counts']}"
        # the first backward also carries the backend's broadcast of rank 0's parameters, once
        assert [entry["counts"].get("broadcast", 0) for entry in result["steps"]] == [1, 0, 0]


def test_wrappers_that_cannot_work_raise(reports):
    for report in reports:
        assert "DistributedDataParallel submodule(s) '0'" in report["inner"] and ".module" in report["inner"]
        assert "'_orig_mod.b.bias'" in report["eager_param"] or "'_orig_mod.b.weight'" in report["eager_param"]
        assert "outside the graphs backend 'deft' compiled" in report["eager_param"]
        assert "pass `optimizer.optimizer`" in report["optimizer_wrapper"]
