"""What one update of delay costs in convergence, with the averaged and the compensated semantics, eagerly.

    python benchmarks/compensated_eager.py --model gpt --optimizer adamw --lr 3e-3 --steps 600 --seeds 0 1
    python benchmarks/compensated_eager.py --model cnn --optimizer sgd --lr 0.05 --steps 600 --seeds 0 1

One process, no deft_compile runtime: ``tests/workers.py``'s ``PlanReference`` (the eager reference every
semantics is tested against) trains with every parameter delayed by one update (``delayed``: docs/POLICIES.md's averaged semantics,
w_{t+1} = U(w_t, ḡ_{t-1}); ``compensated``: the same gradient through the Nesterov form of the first moment, the
forward and backward at the predicted weights; ``CompensatedUpdate``; ``predict-only`` and ``nesterov-only``: one
half of it) or none (``sync``), on the same batches from
the same initial weights, with a linear warm-up over 10 % of the steps and cosine decay. Prints and writes the
validation loss at each quarter of the run. Every parameter delayed is the worst case: a DeFT plan delays only
the buckets whose communication it hides, and the Preserver prices what each costs.

Models: ``gpt``: GPT-2 layout 4 x 128 on this Python's standard-library sources (bytes, context 64, batch 16);
``cnn``: the ResNet preset (4 stages x 2 basic blocks, BatchNorm) on 32x32 images labelled by a fixed teacher
(batch 32).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]
sys.path.append(str(ROOT / "examples"))  # corpus.py


def run(model_name: str, optimizer_name: str, lr: float, steps: int, seed: int, mode: str) -> dict:
    import torch
    import torch.nn.functional as F

    from deft_compile.tools.bench_models import _teacher_images
    from corpus import load_stdlib_corpus, random_windows
    from deft_compile.tools.presets import GPT2Style, ResNetStyle
    from lm_models import lm_loss
    from workers import PlanReference

    torch.manual_seed(seed)
    if model_name == "gpt":
        model, loss_fn = GPT2Style(vocab=256, dim=128, heads=4, layers=4, context=64), lm_loss
        corpus = load_stdlib_corpus(2_000_000)
        split = int(corpus.numel() * 0.9)
        g = torch.Generator().manual_seed(seed)
        batches = [random_windows(corpus[:split], 16, 64, g) for _ in range(steps)]
        validation = [random_windows(corpus[split:], 32, 64, torch.Generator().manual_seed(9 + i)) for i in range(4)]
    else:
        model, loss_fn = ResNetStyle(), F.cross_entropy
        g = torch.Generator().manual_seed(seed)
        batches = [_teacher_images(32, g)[0] for _ in range(steps)]
        validation = [_teacher_images(64, torch.Generator().manual_seed(9 + i))[0] for i in range(4)]
    if optimizer_name == "adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)
    warm = max(1, steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: (t + 1) / warm if t < warm else
                                                 0.5 * (1 + math.cos(math.pi * (t - warm) / max(1, steps - warm))))
    delays = {name: (0 if mode == "sync" else 1, 1, 0) for name, _ in model.named_parameters()}
    compensated = mode if mode in ("predict-only", "nesterov-only") else mode == "compensated"
    reference = PlanReference(model, optimizer, loss_fn, delays, 1, compensated=compensated)

    def validate() -> float:
        model.eval()
        with torch.no_grad():
            value = statistics.fmean(float(loss_fn(model(x), y)) for x, y in validation)
        model.train()
        return value

    curve = []
    started = time.perf_counter()
    for t, (x, y) in enumerate(batches):
        reference.step(x, y)
        schedule.step()
        if (t + 1) % max(1, steps // 4) == 0 and t + 1 < steps:
            curve.append(round(validate(), 4))
    reference.flush()
    curve.append(round(validate(), 4))
    return {"curve": curve, "final": curve[-1], "seconds": round(time.perf_counter() - started, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("gpt", "cnn"), default="gpt")
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--modes", default="sync,delayed,compensated")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())  # PlanReference's all-reduces
    from deft_compile.tools.provenance import provenance, script_command
    results: dict = {"command": script_command(__file__, argv or None), "runs": {}}

    results["provenance"] = provenance(command=results["command"])
    for seed in args.seeds:
        for mode in args.modes.split(","):
            result = run(args.model, args.optimizer, args.lr, args.steps, seed, mode)
            results["runs"][f"{mode}/{seed}"] = result
            print(f"seed {seed} {mode:12s} validation {result['curve']} ({result['seconds']} s)", flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps(results, indent=1))
    for mode in args.modes.split(","):
        finals = [results["runs"][f"{mode}/{s}"]["final"] for s in args.seeds]
        print(f"{mode:12s} final validation loss, mean over seeds {statistics.fmean(finals):.4f} {finals}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
