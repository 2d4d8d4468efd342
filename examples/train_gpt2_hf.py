"""Train a ``transformers`` GPT-2 (random init, byte vocabulary) the way a GPT-2 trainer does, with deft underneath.

The loop people write: AdamW with decay / no-decay groups, linear warm-up then cosine decay,
gradient clipping at 1.0, bf16 autocast, gradient accumulation, periodic evaluation and
checkpoint / resume. ``deft_compile`` replaces ``loss.backward(); clip; optimizer.step()`` and
DDP's all-reduce with one compiled step; the rest of the loop is unchanged.

    torchrun --standalone --nproc-per-node 2 examples/train_gpt2_hf.py               # 2 workers
    torchrun --standalone --nproc-per-node 2 examples/train_gpt2_hf.py --tiny --steps 4   # smoke test
    python examples/train_gpt2_hf.py --steps 50                                      # one process

Text: this Python's standard-library sources as bytes (``examples/corpus.py``; offline,
the last 10 % held out). The model is built from a ``GPT2Config``: nothing is downloaded.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch
import torch.distributed as dist

from corpus import load_stdlib_corpus, random_windows  # examples/corpus.py, beside this script
from deft_compile import DeftConfig, deft_compile, step_state
from deft_compile.tools.launcher import init_from_torchrun


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    import transformers

    config = transformers.GPT2Config(vocab_size=256, n_positions=args.context, n_embd=args.dim, n_layer=args.layers,
                                     n_head=4, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def optimizer_for(model: torch.nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    """AdamW, weight decay on matrices only (GPT-2's recipe)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=args.lr, betas=(0.9, 0.95))


def warmup_cosine(args: argparse.Namespace):
    """Learning-rate factor per optimizer update: linear warm-up, then cosine decay to 10 %."""
    def factor(update: int) -> float:
        if update < args.warmup:
            return (update + 1) / args.warmup
        progress = min(1.0, (update - args.warmup) / max(1, args.updates - args.warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: torch.Tensor, args: argparse.Namespace, device: torch.device) -> float:
    model.eval()
    generator = torch.Generator().manual_seed(1234)  # the same batches everywhere, every time
    total = torch.zeros((), dtype=torch.float64, device=device)
    for _ in range(args.eval_batches):
        tokens, _ = random_windows(data, args.batch, args.context, generator, device)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            total += model(input_ids=tokens, labels=tokens).loss.double()
    model.train()
    if dist.is_initialized():
        dist.all_reduce(total)
        total /= dist.get_world_size()
    return float(total) / args.eval_batches


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="optimizer updates in this run")
    parser.add_argument("--accumulation", type=int, default=2, help="micro-batches per update")
    parser.add_argument("--tiny", action="store_true", help="a very small model and corpus (smoke tests, CI)")
    parser.add_argument("--policy", default="deft")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=None, help="warm-up updates")
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--eval-every", type=int, default=None, help="updates between evaluations")
    parser.add_argument("--checkpoint", default=None, help="save here after the run (rank 0)")
    parser.add_argument("--resume", default=None, help="continue from a --checkpoint file")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    size = (dict(batch=4, context=32, layers=2, dim=32, max_bytes=1 << 18, eval_batches=2, warmup=2, eval_every=2)
            if args.tiny else dict(batch=8, context=128, layers=4, dim=128, max_bytes=8 << 20, eval_batches=8,
                                   warmup=20, eval_every=50))
    for key, value in size.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)

    worker = init_from_torchrun()
    distributed, device, rank, log = worker.distributed, worker.device, worker.rank, worker.log

    corpus = load_stdlib_corpus(args.max_bytes)
    split = int(0.9 * corpus.numel())
    train_data, val_data = corpus[:split], corpus[split:]
    torch.manual_seed(args.seed)
    model = build_model(args).to(device)
    optimizer = optimizer_for(model, args)
    start = 0
    args.updates = args.steps
    if args.resume:
        # tensors and plain data only: loading a checkpoint runs no code from it
        state = torch.load(args.resume, map_location=device, weights_only=True)
        start = state["update"]
        args.updates = start + args.steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(args))
    step = deft_compile(model, optimizer, policy=args.policy,
                        config=DeftConfig(max_grad_norm=args.max_grad_norm, accumulation_steps=args.accumulation))
    if args.resume:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        step.load_state_dict(step_state.from_plain(state["step"]))
        log(f"resumed from {args.resume} at update {start}")
    log(f"GPT-2 {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters, world size "
        f"{dist.get_world_size() if distributed else 1} ({dist.get_backend() if distributed else 'local'}), "
        f"policy {args.policy}, accumulation {args.accumulation}, bf16 autocast, clip {args.max_grad_norm}")

    generator = torch.Generator().manual_seed(args.seed * 1000 + rank + 1 + start)
    started = time.perf_counter()
    for update in range(start, start + args.steps):
        losses = []
        for _ in range(args.accumulation):  # each call is one micro-batch; the last one updates
            tokens, _ = random_windows(train_data, args.batch, args.context, generator, device)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                losses.append(float(step(input_ids=tokens, labels=tokens)))
        scheduler.step()  # the lr is a graph input: a new value reuses the compiled step
        # the latest clipped update's norm (none yet while every bucket's first gradient is still delayed)
        norm = f"{float(step.last_grad_norm):.3f}" if step.last_grad_norm is not None else "-"
        log(f"update {update + 1} loss {sum(losses) / len(losses):.4f} grad-norm {norm} "
            f"lr {scheduler.get_last_lr()[0]:.2e} ({(time.perf_counter() - started) / (update + 1 - start):.2f} s/update)")
        if args.eval_every and (update + 1) % args.eval_every == 0:
            step.flush()  # delayed gradients are applied before evaluating
            log(f"update {update + 1} eval loss {evaluate(model, val_data, args, device):.4f}")
    step.flush()
    log(f"final eval loss {evaluate(model, val_data, args, device):.4f} after {start + args.steps} updates")
    if args.checkpoint:
        worker.save_checkpoint(args.checkpoint, {
            "model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
            "step": step_state.to_plain(step.state_dict()), "update": start + args.steps})
    worker.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
