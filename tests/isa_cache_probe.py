"""Run by tests/test_isa_cache_key.py in a fresh interpreter (``ATEN_CPU_CAPABILITY`` is read once, when torch
first dispatches, and the Inductor cache folder comes from the environment): compile one small aten graph and
print a JSON report on stdout.

``python isa_cache_probe.py deft``: through ``deft_compile.step.lowering.compile_with_inductor`` with the region
caches on, as a step's regions compile. ``python isa_cache_probe.py torch``: plain ``torch.compile`` of the same
function, torch's own cache keys.
"""

from __future__ import annotations

import json
import sys

import torch


def fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Element-wise work and a reduction over sizes that are no multiple of any vector width: every loop has a
    vector body and a tail."""
    return (x * 2.0 + y.sin()).sum(0) + x.mean()


def round_off_bound(x: torch.Tensor, y: torch.Tensor) -> float:
    """What float32 round-off allows between any two evaluation orders of :func:`fn`: a sum of ``n`` terms, each
    computed to within a few units of round-off ``u = 2**-24``, is within ``(n + 2) u sum|terms|`` of the exact
    sum in any order (Higham, Accuracy and Stability, 4.2); the column sums have 37 terms and the mean 1665."""
    u = 2.0 ** -24
    rows, numel = x.shape[0], x.numel()
    columns = (2.0 * x.double().abs() + y.double().sin().abs()).sum(0).max().item()
    return 2 * ((rows + 2) * u * columns + (numel + 2) * u * x.double().abs().mean().item())


def main(route: str) -> dict:
    from torch._dynamo.utils import counters
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(37, 45, generator=g), torch.randn(37, 45, generator=g)
    expected = fn(x, y)
    report = {"isa": str(pick_vec_isa()), "route": route}
    try:
        if route == "deft":
            from torch.fx.experimental.proxy_tensor import make_fx

            from deft_compile.step.lowering import compile_with_inductor

            gm = make_fx(fn)(x, y)
            compiled, source, hit = compile_with_inductor(gm, [x, y], caches=True)
            out = compiled(x, y)
            out = out[0] if isinstance(out, (list, tuple)) else out
            report.update(hit=bool(hit), vectorized="at::vec" in source if source else None)
        else:
            out = torch.compile(fn)(x, y)
            report.update(hit=counters["inductor"]["fxgraph_cache_hit"] > 0)
        report.update(error=None, max_abs=float((out - expected).abs().max()), bound=round_off_bound(x, y))
    except Exception as exc:  # noqa: BLE001 - the report says what failed
        report.update(error=f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}")
    return report


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
