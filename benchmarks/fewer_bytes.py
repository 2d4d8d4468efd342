"""What sending fewer bytes costs the final loss of the time-to-accuracy LM, with nothing else changed.

    python benchmarks/fewer_bytes.py --out benchmarks/results/tta/fewer-bytes-<commit>.json

Where the link bounds the step (DESIGN.md §3, the bandwidth floor), only fewer bytes per step make it shorter:
an update period K (DESIGN.md §4: a bucket accumulates the mean of K steps' gradients and applies one update with
it, its parameters unchanged in between; K = 2 halves its bytes) or a narrower wire. This script measures their
convergence cost alone, without timing: GPT-2 ``mini`` of ``benchmarks/time_to_accuracy.py`` (the same model,
data, AdamW, warm-up and cosine schedule, seed), its two ranks' half-batches run in one process, the gradient
averaged as DDP averages it. Variants (``--variants``):

* ``sync``: every step updates every parameter with the float32 mean (DDP's numbers);
* ``k2@S``: from 0-based step ``S`` on, every parameter has an update period of 2 (the learning rate of the step
  that updates);
* ``float16``: each rank's gradient divided by the world size and rounded to float16, the sum rounded to float16
  (DDP's ``fp16_compress_hook``; the 16-bit wire deft chooses by default);
* ``int8``, ``int8-ef``: each rank's gradient sent as 8 bits per element, a quarter of float32's bytes: per block
  of 256 elements of each parameter, the integers round(g / s) in [-127, 127] with s = max|g| / 127 (one float32
  scale per block, 1.6 % more bytes); the receivers dequantize both ranks' and average: deft's 8-bit wire
  (``wire_dtype="int8"``, docs/POLICIES.md), whose round trip ``wire_error.int8_round_trip`` is. ``int8-ef`` keeps
  each rank's rounding residual and adds it to its next gradient (error feedback, one float32 copy of the
  gradients per rank).

``--link RATE`` times instead what each wire costs on a loopback shaped to ``RATE`` (root and iproute2), two gloo
workers, the model's gradient elements in ``--buckets`` equal buckets, ``--repeats`` rounds with the wires
interleaved: float32 and float16 all-reduces, and the int8 form as the 8-bit wire would have to send it (gloo
cannot sum int8 without overflow): an all-gather of each rank's int8 integers and float32 block scales, then a
local dequantize and sum.

Reported per variant: the final validation loss and its excess over ``sync``'s (the time-to-accuracy target is
``sync``'s final loss, and a deft plan must end within 1 % of it), and every ``--noise-every`` steps the gradient
noise ratio b = tr(Σ)/‖G‖² of the two ranks' step (``deft_compile.preserver.pricing.noise_ratios`` summed over
parameters), with the share of progress the Preserver's model says a period of 2 loses at it,
``skipped_share(2, b)`` = 1 / (2 + b).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


WIRES = ("float16", "int8", "int8-ef")


def wire_mean(kind: str, grads: list, residuals: list | None) -> list:
    """The mean gradient the ranks apply when each rank's gradient crosses the ``kind`` wire."""
    import torch

    from deft_compile.preserver.wire_error import int8_round_trip

    if kind == "float16":  # divided by the world size, rounded, summed in float16 (fp16_compress_hook)
        return [(a.div(2).half() + b.div(2).half()).float() for a, b in zip(*grads)]
    sent = []
    for r, rank_grads in enumerate(grads):
        row = []
        for i, g in enumerate(rank_grads):
            if residuals is not None:
                g = g + residuals[r][i]
            q = int8_round_trip(g)
            if residuals is not None:
                residuals[r][i] = g - q
            row.append(q)
        sent.append(row)
    return [torch.stack(pair).mean(0) for pair in zip(*sent)]


def train(variant: str, steps: int, seed: int, noise_every: int) -> dict:
    import torch

    import tta
    from deft_compile.planner.solvers.deft import skipped_share

    kind, _, start_text = variant.partition("@")
    if kind not in ("sync", "k2", *WIRES) or (kind == "k2" and not start_text.isdigit()):
        raise ValueError(f"unknown variant {variant!r}: sync, k2@<step>, {', '.join(WIRES)}")
    start = int(start_text) if kind == "k2" else steps
    corpus = tta.load_corpus(6_000_000)
    ranks = [tta.TextBatches(corpus, context=tta.context_of("mini"), batch=8, steps=steps, seed=seed, rank=r,
                             world_size=2, val_windows=128) for r in range(2)]
    torch.manual_seed(seed)
    model = tta.build_model("mini")
    optimizer = tta.make_optimizer(model)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, tta.lr_lambda(steps, steps // 10, 0.1))
    params = [p for p in model.parameters() if p.requires_grad]
    pending, noise, begun = None, [], time.perf_counter()
    residuals = [[torch.zeros_like(p) for p in params] for _ in ranks] if kind == "int8-ef" else None
    for t in range(steps):
        grads = []
        for batches in ranks:
            ids, labels = batches.batch_at(t)
            model.zero_grad(set_to_none=True)
            model(ids, labels).backward()
            grads.append([p.grad.detach().clone() for p in params])
        exact = [(a + b) / 2 for a, b in zip(*grads)]
        mean = exact if kind not in WIRES else wire_mean(kind, grads, residuals)
        if noise_every and t % noise_every == 0:
            s = sum(float((a * a).sum() + (b * b).sum()) / 2 for a, b in zip(*grads))
            m = sum(float((g * g).sum()) for g in exact)
            b = (s - m) / (2 * m - s) if 2 * m - s > 0 else None
            noise.append({"step": t, "b": b, "period2_loses": skipped_share(2, b) if b is not None else 0.0})
        if t >= start and pending is None:  # the first step of a period of 2 only accumulates
            pending = mean
        else:
            if pending is not None:
                mean, pending = [(a + g) / 2 for a, g in zip(pending, mean)], None
            for p, g in zip(params, mean):
                p.grad = g
            optimizer.step()
        schedule.step()
    model.eval()
    total = count = 0.0
    with torch.no_grad():
        for batches in ranks:
            for ids, labels in batches.validation():
                total += float(model(ids, labels)) * ids.shape[0]
                count += ids.shape[0]
    return {"final_loss": total / count, "noise": noise, "seconds": time.perf_counter() - begun}


def link_worker(rank: int, world_size: int, numel: int, buckets: int, repeats: int) -> dict:
    """One rank of ``--link``: per wire, each round's time for all buckets, issued back to back and waited."""
    import torch
    import torch.distributed as dist

    from deft_compile.planner.plan import INT8_BLOCK

    size = numel // buckets
    scales = -(-size // INT8_BLOCK)
    tensors = {"float32": [torch.randn(size) for _ in range(buckets)],
               "float16": [torch.randn(size).half() for _ in range(buckets)],
               "int8": [(torch.randint(-127, 128, (size,), dtype=torch.int8), torch.rand(scales)) for _ in range(buckets)]}

    def run(wire: str) -> float:
        dist.barrier()
        begun = time.perf_counter()
        if wire == "int8":
            works = []
            for q, s in tensors[wire]:
                gathered_q = torch.empty(world_size * size, dtype=torch.int8)
                gathered_s = torch.empty(world_size * scales)
                works.append(dist.all_gather_into_tensor(gathered_q, q, async_op=True))
                works.append(dist.all_gather_into_tensor(gathered_s, s, async_op=True))
        else:
            works = [dist.all_reduce(t, async_op=True) for t in tensors[wire]]
        for work in works:
            work.wait()
        return time.perf_counter() - begun

    times: dict[str, list[float]] = {wire: [] for wire in tensors}
    for wire in tensors:  # warm-up: connections and buffers
        run(wire)
    for round_ in range(repeats):
        order = list(tensors)[round_ % 3:] + list(tensors)[:round_ % 3]
        for wire in order:
            times[wire].append(run(wire))
    return times


def link_report(rate: str, numel: int, buckets: int, repeats: int) -> dict:
    """``--link``: the slower rank's time per round of each wire on the shaped loopback, median and range."""
    import statistics

    from deft_compile.tools.bench import network
    from deft_compile.tools.launcher import run_local_workers

    with network(rate, 1, 2, prefix="deftbytes") as net:
        results = run_local_workers(link_worker, 2, (numel, buckets, repeats), **net["launch"], timeout_s=1800)
    slowest = {wire: [max(r.value[wire][i] for r in results) for i in range(repeats)] for wire in results[0].value}
    base = statistics.median(slowest["float32"])
    return {"network": net["description"], "numel": numel, "buckets": buckets, "repeats": repeats,
            "wires": {wire: {"median_ms": statistics.median(t) * 1e3, "min_ms": min(t) * 1e3, "max_ms": max(t) * 1e3,
                             "vs_float32": statistics.median(t) / base} for wire, t in slowest.items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", default=["sync", "k2@0", "k2@400", "k2@600", "float16", "int8", "int8-ef"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--noise-every", type=int, default=50)
    parser.add_argument("--link", metavar="RATE", help="time the wires on a loopback shaped to RATE instead")
    parser.add_argument("--buckets", type=int, default=13)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    import torch

    from deft_compile.tools.provenance import provenance, script_command

    torch.set_num_threads(2)
    if args.link:
        import tta

        numel = sum(p.numel() for p in tta.build_model("mini").parameters())
        report = {"provenance": provenance(command=script_command(__file__, argv)),
                  "link": link_report(args.link, numel, args.buckets, args.repeats)}
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
        for wire, row in report["link"]["wires"].items():
            print(f"{wire}: {row['median_ms']:.1f} ms [{row['min_ms']:.1f}-{row['max_ms']:.1f}], "
                  f"{row['vs_float32']:.2f}x float32")
        return 0
    report = {"provenance": provenance(command=script_command(__file__, argv)), "steps": args.steps, "seeds": {}}
    for seed in args.seeds:
        rows = report["seeds"][str(seed)] = {}
        for variant in args.variants:
            rows[variant] = train(variant, args.steps, seed, args.noise_every)
            base = rows.get("sync", {}).get("final_loss")
            if base:
                rows[variant]["vs_sync"] = rows[variant]["final_loss"] / base - 1.0
            print(f"seed {seed} {variant}: final {rows[variant]['final_loss']:.4f}"
                  + (f" ({rows[variant]['vs_sync']:+.2%} against sync)" if base else ""), flush=True)
            Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
