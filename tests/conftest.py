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

Lanes. ``python -m pytest -q`` runs every test (CI: .ci/run). ``python -m pytest -q -m "not slow"`` is the fast local
lane: it leaves out the tests marked ``slow`` (pyproject.toml): cold Inductor compiles, package installs, long
training runs.

Workers. The suite launches about a hundred pairs of gloo workers. Spawned, each worker starts an interpreter and
imports torch, deft_compile and the test helpers (3-4 s a launch on the 2-core CI host); forked from one server that
imported them once (``launcher.use_forkserver``), a launch costs well under a second. ``DEFT_TEST_SPAWN=1`` runs the
suite with spawned workers, as the benchmarks and the demo start theirs.

The benchmark harnesses the tests run (``benchmarks/tta.py``, ``benchmarks/lm_models.py``) and the examples'
corpus (``examples/corpus.py``) are imported by module name: both folders are appended to ``sys.path``.
"""

import os
import sys
from pathlib import Path

os.environ.setdefault("DEFT_COMPILER", "aten")
_ROOT = Path(__file__).resolve().parents[1]
for _folder in (_ROOT / "benchmarks", _ROOT / "examples"):
    if str(_folder) not in sys.path:
        sys.path.append(str(_folder))

if os.environ.get("DEFT_TEST_SPAWN", "") in ("", "0"):
    from deft_compile.tools import launcher

    launcher.use_forkserver([
        "workers", "loop_workers", "inductor_workers", "default_route_workers", "backend_workers", "integration_workers",
        "trainer_workers", "hf_models", "models", "shape_workers", "shapes", "transformers", "deft_compile.integrations.transformers", "deft_compile.tools.bench",
        "deft_compile.tools.demo", "tta",
    ])
