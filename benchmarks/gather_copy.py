"""What the copy of each gradient into its bucket costs, against the step it sits in.

    python benchmarks/gather_copy.py --out benchmarks/results/gather-copy-<commit>.json

The schedule pass writes every gradient once into its bucket's flat buffer (``cat.out`` into a kept buffer on the
aten route; a fresh ``cat`` on Inductor's, where Inductor writes the gradients its own kernels reduce straight into
the bucket and copies those that extern kernels such as ``mm`` and convolutions produce). Having the backward write
every gradient into the bucket would save at most one copy of all gradient bytes per step. This script times that
bound on the models of ``benchmarks/first_steps.py``, in one process on one intra-op thread (as every worker runs):

* ``cat_out_ms``: ``torch.cat(gradients, out=bucket)`` into a kept buffer (the aten route);
* ``cat_fresh_ms``: ``torch.cat(gradients)`` into a buffer allocated per call, as Inductor's region allocates it
  (the Inductor route, before it writes its own reductions in place; the allocator may hand back the pages of the
  previous call's buffer);
* ``step_ms``: the model's eager forward, backward and optimizer step on the same batch (no communication), the
  floor of any data-parallel step;
* ``share``: ``max(cat_out_ms, cat_fresh_ms) / step_ms``.

Each figure is the median of ``--repeats`` blocks, the variants interleaved block by block; ``spread``: the
smallest and largest block of each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def _timed(fn, calls: int) -> float:
    begun = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - begun) / calls * 1e3


def measure(model: str, repeats: int) -> dict:
    import torch

    from first_steps import build

    net, optimizer, loss_fn, batches = build(model, 0, 1)
    args = batches[0]

    def step() -> None:
        optimizer.zero_grad(set_to_none=False)
        loss = loss_fn(net(args[0]), args[1]) if loss_fn is not None else net(*args)
        loss.backward()
        optimizer.step()

    step()
    grads = [p.grad.reshape(-1) for p in net.parameters() if p.grad is not None]
    numel = sum(g.numel() for g in grads)
    bucket = torch.empty(numel, dtype=grads[0].dtype)

    def cat_out() -> None:
        torch.cat(grads, out=bucket)

    def cat_fresh() -> None:
        torch.cat(grads)

    samples: dict[str, list[float]] = {"cat_out_ms": [], "cat_fresh_ms": [], "step_ms": []}
    for fn in (cat_out, cat_fresh):
        fn()
    for _ in range(repeats):
        samples["cat_out_ms"].append(_timed(cat_out, 20))
        samples["cat_fresh_ms"].append(_timed(cat_fresh, 20))
        samples["step_ms"].append(_timed(step, 3))
    medians = {key: statistics.median(values) for key, values in samples.items()}
    return {"gradient_mib": numel * grads[0].element_size() / 2**20, "gradients": len(grads), **medians,
            "share": max(medians["cat_out_ms"], medians["cat_fresh_ms"]) / medians["step_ms"],
            "spread": {key: [min(values), max(values)] for key, values in samples.items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="transformer,cnn,bert")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    import torch

    from deft_compile.tools.provenance import provenance, script_command

    torch.set_num_threads(1)
    command = script_command(__file__, argv)
    report = {"provenance": provenance(command=command), "models": {}}
    for model in args.models.split(","):
        row = measure(model, args.repeats)
        report["models"][model] = row
        print(f"{model}: {row['gradient_mib']:.1f} MiB of gradients in {row['gradients']} tensors; copy into a kept "
              f"bucket {row['cat_out_ms']:.2f} ms, into a fresh one {row['cat_fresh_ms']:.2f} ms; eager step "
              f"{row['step_ms']:.0f} ms; share {row['share']:.2%}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
