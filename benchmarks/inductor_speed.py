"""Step time of the Inductor-lowered step against eager and the aten step, one process, no communication.

    python benchmarks/inductor_speed.py [--presets transformer cnn] [--steps 20] [--repeats 5] [--json out.json]
                                        [--profile]

Per preset (``deft_compile.tools.presets``: ``transformer`` = GPT-2-style with AdamW, ``cnn`` = VGG-style
with SGD momentum), three copies of the same model train on the same batch: eager (``zero_grad``,
forward, ``backward``, ``optimizer.step``), ``deft_compile(compiler="aten")`` and
``deft_compile(compiler="inductor")``. After warm-up they run in interleaved blocks of ``--steps``
steps, ``--repeats`` times, in the order rotated per repeat; the per-repeat ratio inductor/eager
is reported as median with min-max spread. Compile times: the first Inductor compile of the steady
step graph, then a fresh model/optimizer compiled again in the same process (Inductor's FX graph
cache hit; a second process hits the on-disk cache the same way). One intra-op thread.

``--profile`` adds where the time goes: ``torch.profiler`` self CPU time per step of eager and of a
fourth copy compiled with Inductor's kernel profiling (``cpp.enable_kernel_profile``: each generated
C++ kernel is a profiler event), grouped into GEMM/convolution, attention (ATen's SDPA kernels),
Inductor's kernels, other ATen operators, and the rest of the wall time (Python: autograd and
optimizer loops for eager, the generated wrapper and the runtime for Inductor; profiler overhead
inflates the eager side, whose ATen operators are many and small).
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time
from typing import Any, Callable

import torch

from deft_compile import DeftConfig, deft_compile
from deft_compile.tools.presets import get_preset


def _eager_step(model, optimizer, loss_fn) -> Callable[..., Any]:
    def step(*args, **kwargs):
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(args[0]), args[1]) if loss_fn is not None else model(*args, **kwargs)
        loss.backward()
        optimizer.step()
        return loss

    return step


def _compiled(preset, compiler: str, args, kwargs) -> tuple[Any, float, list]:
    model, optimizer, loss_fn, _, _ = preset.make(seed=0)
    step = deft_compile(model, optimizer, loss_fn, config=DeftConfig(compiler=compiler))
    for _ in range(3):  # first-step graph, steady graph as aten, steady graph lowered
        step(*args, **kwargs)
    seconds = sum(h["seconds"] for h in step.lowering.history)
    hits = [h["cache_hit"] for h in step.lowering.history]
    return step, seconds, hits


GEMM_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::convolution", "aten::_convolution",
            "aten::mkldnn_convolution", "aten::convolution_backward", "aten::_mkldnn_convolution"}


def _category(name: str) -> str:
    if name in GEMM_OPS:
        return "gemm/conv"
    if "scaled_dot_product" in name:
        return "attention (ATen SDPA)"
    if "cpp_fused" in name:
        return "inductor kernels"
    if name.startswith(("aten::", "mkldnn::", "_c10d_functional::")):
        return "other ATen ops"
    return "python/other"  # e.g. "## Call CompiledFxGraph ##", "Optimizer.step#AdamW.step": their self time


def profile_breakdown(fn: Callable[..., Any], args, kwargs, steps: int) -> dict[str, float]:
    """Milliseconds per step by category (self CPU time), plus the wall time and what no operator covers."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn(*args, **kwargs)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        begin = time.perf_counter()
        for _ in range(steps):
            fn(*args, **kwargs)
        wall = time.perf_counter() - begin
    totals: collections.Counter[str] = collections.Counter()
    for event in prof.key_averages():
        totals[_category(event.key)] += event.self_cpu_time_total / 1e3 / steps
    out = {k: round(v, 3) for k, v in sorted(totals.items())}
    out["wall (profiled)"] = round(wall * 1e3 / steps, 3)
    out["not in any event"] = round(out["wall (profiled)"] - sum(totals.values()), 3)
    return out


def run(preset_name: str, steps: int, repeats: int, profile: bool = False) -> dict[str, Any]:
    preset = get_preset(preset_name)
    model, optimizer, loss_fn, args, kwargs = preset.make(seed=0)
    variants: dict[str, Callable[..., Any]] = {"eager": _eager_step(model, optimizer, loss_fn)}
    started = time.perf_counter()
    variants["inductor"], first_compile_s, first_hits = _compiled(preset, "inductor", args, kwargs)
    first_wall_s = time.perf_counter() - started
    _, cached_compile_s, cached_hits = _compiled(preset, "inductor", args, kwargs)
    variants["aten"], _, _ = _compiled(preset, "aten", args, kwargs)
    if variants["inductor"].compiler != "inductor":
        raise RuntimeError(f"Inductor did not run: {variants['inductor'].lowering.history}")
    for fn in variants.values():
        for _ in range(3):
            fn(*args, **kwargs)
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(repeats):
        for name in names[r % len(names):] + names[: r % len(names)]:
            fn = variants[name]
            begin = time.perf_counter()
            for _ in range(steps):
                fn(*args, **kwargs)
            times[name].append((time.perf_counter() - begin) * 1e3 / steps)
    ratios = [i / e for i, e in zip(times["inductor"], times["eager"])]
    aten_ratios = [a / e for a, e in zip(times["aten"], times["eager"])]
    breakdown = None
    if profile:
        from torch._inductor import config as inductor_config

        with inductor_config.patch({"cpp.enable_kernel_profile": True}):
            profiled, _, _ = _compiled(preset, "inductor", args, kwargs)
        breakdown = {"eager": profile_breakdown(variants["eager"], args, kwargs, steps),
                     "inductor": profile_breakdown(profiled, args, kwargs, steps)}
    return {
        "preset": preset_name,
        "description": preset.description,
        "step_ms": {k: statistics.median(v) for k, v in times.items()},
        "step_ms_all": times,
        "inductor_over_eager": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)},
        "aten_over_eager": {"median": statistics.median(aten_ratios), "min": min(aten_ratios), "max": max(aten_ratios)},
        "first_compile_s": first_compile_s,
        "first_compile_cache_hits": first_hits,
        "first_three_steps_wall_s": first_wall_s,
        "cached_compile_s": cached_compile_s,
        "cached_compile_cache_hits": cached_hits,
        "graph_nodes": len(variants["inductor"].graph.graph_module.graph.nodes),
        "profile_ms_per_step": breakdown,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["transformer", "cnn"])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None)
    parser.add_argument("--profile", action="store_true", help="also print where each step's time goes")
    a = parser.parse_args()
    torch.set_num_threads(a.threads)
    results = [run(name, a.steps, a.repeats, a.profile) for name in a.presets]
    for r in results:
        q = r["inductor_over_eager"]
        print(f"{r['preset']:12s} eager {r['step_ms']['eager']:7.2f} ms  aten {r['step_ms']['aten']:7.2f} ms  "
              f"inductor {r['step_ms']['inductor']:7.2f} ms  inductor/eager {q['median']:.3f} "
              f"[{q['min']:.3f}-{q['max']:.3f}]  aten/eager {r['aten_over_eager']['median']:.3f}  "
              f"compile first {r['first_compile_s']:.1f} s (hits {r['first_compile_cache_hits']}), "
              f"again {r['cached_compile_s']:.1f} s (hits {r['cached_compile_cache_hits']})  nodes {r['graph_nodes']}")
        for variant, parts in (r["profile_ms_per_step"] or {}).items():
            print(f"    {variant:9s} " + "  ".join(f"{k} {v:.2f}" for k, v in parts.items()))
    if a.json:
        from deft_compile.tools.provenance import provenance

        with open(a.json, "w") as f:
            json.dump({"provenance": provenance(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
