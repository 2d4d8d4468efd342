"""Compiled regions are cached per CPU vector instruction set (``deft_compile.step.isa_key``).

Inductor writes its C++ loops for one vector ISA (8 floats a vector under AVX2, 16 under AVX-512, none under
``ATEN_CPU_CAPABILITY=default``) and torch's compile caches do not key on it: a compile cached under one ISA and
replayed under another either fails to build or, from AVX-512 to AVX2, leaves half of every output unwritten.
Each test runs ``tests/isa_cache_probe.py`` in fresh interpreters that share one Inductor cache folder, one ISA
after the other, over the kernel sets this CPU runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

PROBE = Path(__file__).with_name("isa_cache_probe.py")


def _kernel_sets() -> list[str]:
    """The ``ATEN_CPU_CAPABILITY`` values this CPU runs, scalar first (every x86 CPU runs ``default``)."""
    best = torch.backends.cpu.get_cpu_capability().lower()
    order = ["default", "avx2", "avx512"]
    return order[: order.index(best) + 1] if best in order else ["default", best]


def _probe(route: str, capability: str, cache: Path) -> dict:
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability, "TORCHINDUCTOR_CACHE_DIR": str(cache)}
    done = subprocess.run([sys.executable, str(PROBE), route], env=env, capture_output=True, text=True, timeout=600,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_this_cpu_runs_two_kernel_sets():
    """Every x86-64 CPU torch runs on has AVX2 or better beside the scalar set, so the test below compares two."""
    assert len(_kernel_sets()) >= 2, f"kernel sets on this CPU: {_kernel_sets()}"


def test_a_region_compiled_under_one_kernel_set_is_not_replayed_under_another(tmp_path):
    """Under each kernel set in turn, one cache folder: each interpreter compiles its own kernels (a cache miss,
    vectorized exactly when its ISA is) and gets ``fn``'s numbers to float32 round-off; a second round hits each
    set's own entry and computes the same."""
    sets = _kernel_sets()
    cold = [_probe("deft", capability, tmp_path) for capability in sets]
    warm = [_probe("deft", capability, tmp_path) for capability in reversed(sets)][::-1]
    for capability, first, again in zip(sets, cold, warm):
        for report in (first, again):
            assert report["error"] is None, (capability, report)
            assert report["max_abs"] <= report["bound"], (capability, report)
        assert not first["hit"], (capability, first)
        assert first["vectorized"] == (capability != "default"), (capability, first)
        assert again["hit"] and again["max_abs"] == first["max_abs"], (capability, again)
    assert len({report["isa"] for report in cold}) == len(sets)


def test_plain_torch_compile_replays_across_kernel_sets(tmp_path):
    """The reproduction of torch's missing key, with plain ``torch.compile`` (no deft_compile): code cached under
    the vector ISA fails to build under the scalar one, or hits a stale entry. When this fails, torch keys its
    caches by ISA itself and ``deft_compile.step.isa_key`` can go."""
    vector = _kernel_sets()[-1]
    cold = _probe("torch", vector, tmp_path)
    assert cold["error"] is None and not cold["hit"], cold
    replay = _probe("torch", "default", tmp_path)
    assert replay["error"] is not None or replay["hit"], replay


def test_plain_torch_compile_replays_avx512_code_under_avx2(tmp_path):
    """On a CPU with AVX-512: plain ``torch.compile``'s entry written for AVX-512 is replayed under
    ``ATEN_CPU_CAPABILITY=avx2`` (a cache hit); its vector loops step 16 floats while AVX2's vectors hold 8, so part
    of the output is never written (docs/DEBUGGING.md: this function's output off by 31.5 and 7.7e34 in two replays;
    not asserted, as unwritten memory may hold anything). When this fails, torch keys its caches by ISA itself."""
    if "avx512" not in _kernel_sets():
        pytest.skip(f"this CPU runs no AVX-512 kernels ({_kernel_sets()})")
    cold = _probe("torch", "avx512", tmp_path)
    assert cold["error"] is None and not cold["hit"] and cold["max_abs"] <= cold["bound"], cold
    replay = _probe("torch", "avx2", tmp_path)
    assert replay["isa"] == "avx2" and replay["hit"], replay
