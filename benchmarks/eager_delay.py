"""Plain-eager check of the delayed-update semantics on the char-LM (no deft_compile involved).

    python benchmarks/eager_delay.py --mode sync|half|all [--steps 300] [--lr 3e-3]

One process trains the char-LM of ``benchmarks/convergence.py`` on the same global batches as the
2-worker runs (both ranks' halves, averaged), with AdamW. ``half`` applies the *previous* step's
gradient to the parameters deft's ``deft-delay`` plan delays (docs/POLICIES.md, "DeFT's delayed semantics": w_{t+1} = U(w_t, ḡ_{t-1});
no update in the first step); ``all`` does it for every parameter. Prints the final validation loss.
Used in docs/CONVERGENCE.md §1 to show that the char-LM gap comes from the semantics, not from deft.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import convergence  # noqa: E402

HALF = {  # the parameters of the 6 buckets the deft-delay plan delays (docs/CONVERGENCE.md plan table)
    "blocks.layers.0.linear2.weight", "blocks.layers.1.norm1.weight", "blocks.layers.0.norm2.weight",
    "blocks.layers.0.self_attn.out_proj.weight", "blocks.layers.0.self_attn.in_proj_weight", "embed.weight",
    "blocks.layers.0.linear1.weight", "blocks.layers.0.norm1.weight", "position",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["sync", "half", "all"], required=True)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--compensation", type=float, default=0.0,
                        help="DC-ASGD delay compensation λ: apply g + λ·g⊙g⊙(w_t − w_{t−1}) instead of the stale g "
                             "(an experiment outside the delayed semantics of docs/POLICIES.md; 0 = off)")
    parser.add_argument("--delayed-beta1", type=float, default=None,
                        help="AdamW β1 for the delayed parameters only (an experiment: less momentum to offset "
                             "the momentum that staleness adds); default: the same as the others (0.9)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    task = convergence.CharLMTask(lr=args.lr)
    torch.manual_seed(0)
    model = task.make_model()
    halves = [task.batches(0, rank, 2, args.steps) for rank in (0, 1)]
    names = {p: n for n, p in model.named_parameters()}
    delayed = [p for p in model.parameters() if args.mode == "all" or (args.mode == "half" and names[p] in HALF)]
    if args.delayed_beta1 is None:
        optimizer = task.make_optimizer(model)
    else:
        others = [p for p in model.parameters() if all(p is not d for d in delayed)]
        optimizer = torch.optim.AdamW([{"params": others}, {"params": delayed, "betas": (args.delayed_beta1, 0.999)}],
                                      lr=args.lr, weight_decay=0.01)
    pending: dict[torch.Tensor, torch.Tensor] = {}
    weights_then: dict[torch.Tensor, torch.Tensor] = {}  # w_{t-1}: the weights the pending gradient was computed at
    for t in range(args.steps):
        optimizer.zero_grad()
        for inputs, targets in (halves[0][t], halves[1][t]):
            (task.loss_fn(model(inputs), targets) / 2).backward()
        fresh = {p: p.grad.clone() for p in delayed}
        for p in delayed:
            if p not in pending:
                p.grad = None
            elif args.compensation:
                stale = pending[p]
                p.grad = stale + args.compensation * stale * stale * (p.detach() - weights_then[p])
            else:
                p.grad = pending[p].clone()
        pending = fresh
        weights_then = {p: p.detach().clone() for p in delayed}
        optimizer.step()
    print(args.mode, args.lr, f"compensation {args.compensation:g}", f"delayed beta1 {args.delayed_beta1}",
          task.evaluate(model))


if __name__ == "__main__":
    main()
