"""Test-suite defaults: the compiler, the lanes, how workers start.

Compilers. Most tests check scheduling, numerics against DDP or error behaviour, not the compiler, so they run the
step graph as aten (no Inductor compile per graph, bit-identical to DDP with SGD): ``DEFT_COMPILER=aten`` unless
the environment already says otherwise. Spawned workers inherit it. The route a user gets, ``DeftConfig()``'s
default (regional Inductor), runs where a test asks for it: tests/test_default_route.py runs the tests that pin
numerics there (policies against DDP, delayed and compensated semantics against their eager references, resume,
clipping, accumulation, loss scaling, ``DeftTrainer``; its workers take ``DEFT_COMPILER`` out); the Inductor
lowering's own tests (tests/test_inductor.py, tests/test_regions.py, tests/test_hf_inductor_regions.py), the demo
(tests/test_readme_demo.py) and the tests elsewhere that name ``compiler="inductor"`` run it too.
``DEFT_COMPILER=inductor python -m pytest`` runs every test through Inductor (slow: seconds of compile per region).

Lanes. ``python -m pytest -q`` runs every test (CI: .ci/run), in two pytest-xdist workers, a test file per worker at
a time (``-n 2 --dist loadfile`` in pyproject.toml: a file's module fixtures are built once; xdist hands out the
files with the most tests first; ``-n 0`` runs in this process). ``python -m pytest -q -m "not slow"`` is the fast
local lane: it leaves out the tests marked ``slow`` (``SLOW_MODULES`` and every test whose id names ``inductor`` or
the ``default_route``): Inductor compiles, package installs, torchrun launches, benchmark scripts run end to end and
the fault matrix's timeouts.

Kernel sets. ``TORCH_COMPILE_CACHE_KEY_TAG`` names the ``ATEN_CPU_CAPABILITY`` the suite runs under, so the plain
``torch.compile`` yardsticks never replay code cached under another kernel set (torch's cache key leaves it out).

Workers. The suite launches about a hundred pairs of gloo workers. Spawned, each worker starts an interpreter and
imports torch, deft_compile and the test helpers (3-4 s a launch on the 2-core CI host); forked from one server that
imported them once (``launcher.use_forkserver``), a launch costs well under a second. ``DEFT_TEST_SPAWN=1`` runs the
suite with spawned workers, as the benchmarks and the demo start theirs. Most files run their many small 2-process
cases in one pair, one case after another (tests/batched.py): a module fixture launches the cases the selected tests
read, and each test asserts its own case's outcome. The test processes compute with one intra-op thread, as every
worker does.

The benchmark harnesses the tests run (``benchmarks/tta.py``, ``benchmarks/lm_models.py``) and the examples'
corpus (``examples/corpus.py``) are imported by module name: both folders are appended to ``sys.path``.
"""

import os
import sys
from pathlib import Path

os.environ.setdefault("DEFT_COMPILER", "aten")
# The yardsticks' plain ``torch.compile`` calls share the Inductor cache with deft's compiles; torch does not key its
# cache by the CPU kernel set (deft_compile/step/isa_key.py), so the suite tags every torch compile with the
# ``ATEN_CPU_CAPABILITY`` it runs under (workers inherit the tag; a test that changes the kernel set sets both).
os.environ.setdefault("TORCH_COMPILE_CACHE_KEY_TAG", f"aten-cpu-capability={os.environ.get('ATEN_CPU_CAPABILITY', '')}")

# One intra-op thread in the test processes too, as in every gloo worker (``launcher``): two pytest-xdist workers
# share the host's cores with each other's gloo workers, and a test that computes in its own process with a thread per
# core would wait on busy cores at every parallel region instead of running on one.
import torch  # noqa: E402

torch.set_num_threads(1)

_ROOT = Path(__file__).resolve().parents[1]
for _folder in (_ROOT / "benchmarks", _ROOT / "examples"):
    if str(_folder) not in sys.path:
        sys.path.append(str(_folder))

# one folder per run for tests/workers.synthetic_profile's profiles (the xdist workers and their gloo workers inherit
# it): a case's profile is captured once per run, not once per rank and launch; the process that made the folder
# removes it when it exits
if not os.environ.get("DEFT_TEST_PROFILE_CACHE"):
    import atexit
    import shutil
    import tempfile

    os.environ["DEFT_TEST_PROFILE_CACHE"] = tempfile.mkdtemp(prefix="deft-test-profiles-")
    atexit.register(shutil.rmtree, os.environ["DEFT_TEST_PROFILE_CACHE"], ignore_errors=True)

if os.environ.get("DEFT_TEST_SPAWN", "") in ("", "0"):
    from deft_compile.tools import launcher

    launcher.use_forkserver([
        "workers", "loop_workers", "inductor_workers", "default_route_workers", "backend_workers", "integration_workers",
        "trainer_workers", "hf_models", "models", "shape_workers", "shapes", "transformers", "deft_compile.integrations.transformers", "deft_compile.tools.bench",
        "deft_compile.tools.demo", "tta", "capture_warmup",
    ])


#: test files the fast lane leaves out: they compile with Inductor, launch torchrun, run a benchmark script end to
#: end or wait out peers' timeouts (the fault matrix)
SLOW_MODULES = {"test_default_route.py", "test_examples.py", "test_inductor.py", "test_regions.py",
                "test_flat_updates.py", "test_readme_demo.py", "test_gpu_check.py", "test_bf16_tracks_eager.py",
                "test_hf_inductor_regions.py", "test_shapes.py", "test_bench.py", "test_suite_quick.py",
                "test_overhead_bench.py", "test_dssync_dlcp_bench.py", "test_time_to_accuracy.py", "test_faults.py",
                "test_isa_cache_key.py"}


def pytest_collection_modifyitems(config, items):
    """Mark ``slow`` what compiles with Inductor: the files in ``SLOW_MODULES`` and every test whose id names
    ``inductor`` or the ``default_route``."""
    import pytest

    for item in items:
        name = item.nodeid.split("::", 1)[-1].lower()
        if item.path.name in SLOW_MODULES or "inductor" in name or "default_route" in name:
            item.add_marker(pytest.mark.slow)
