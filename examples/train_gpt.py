"""Train a byte-level GPT-2-style model on Python's own standard library sources with deft_compile.

Runs the same under one process, ``torchrun --standalone --nproc-per-node N`` and
multi-node ``torchrun`` (see examples/README.md): gloo on CPU, NCCL on GPUs.

    python examples/train_gpt.py --steps 200                        # one process (local training)
    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py  # 2 workers on this machine
    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py --steps 3 --tiny   # smoke test

The corpus is offline and the same on every machine with the same Python: the
``.py`` files under ``sysconfig.get_paths()["stdlib"]`` in sorted order, read as
bytes (vocabulary 256), the last 10 % held out for evaluation. Every rank draws
its own random windows (its own generator), so the data-parallel ranks see
different batches, as with a ``DistributedSampler``.
"""

from __future__ import annotations

import argparse
import math
import sys
import sysconfig
import time

import torch
import torch.distributed as dist

from corpus import load_stdlib_corpus as load_corpus  # examples/corpus.py, beside this script
from corpus import random_windows as batch
from deft_compile import DeftConfig, deft_compile, step_state
from deft_compile.tools.launcher import init_from_torchrun
from deft_compile.tools.presets import GPT2Style


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: torch.Tensor, args: argparse.Namespace, device: torch.device) -> float:
    """Mean validation loss over ``--eval-batches`` fixed batches, averaged over ranks."""
    model.eval()
    generator = torch.Generator().manual_seed(1234)  # the same batches on every rank and every evaluation
    total = torch.zeros((), dtype=torch.float64, device=device)
    for _ in range(args.eval_batches):
        tokens, targets = batch(data, args.batch, args.context, generator, device)
        total += model(tokens, targets=targets).double()
    model.train()
    if dist.is_initialized():
        dist.all_reduce(total)
        total /= dist.get_world_size()
    return float(total) / args.eval_batches


@torch.no_grad()
def sample(model: torch.nn.Module, prompt: bytes, length: int, context: int, device: torch.device) -> str:
    """Greedy continuation of ``prompt`` (bytes), decoded leniently."""
    model.eval()
    tokens = torch.tensor(list(prompt), dtype=torch.long, device=device)[None]
    for _ in range(length):
        logits = model(tokens[:, -context:])
        tokens = torch.cat([tokens, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    model.train()
    return bytes(tokens[0].tolist()).decode("utf-8", errors="replace")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--tiny", action="store_true", help="a very small model and corpus (smoke tests, CI)")
    parser.add_argument("--policy", default="deft", help="deft (default), wfbp, bytescheduler, usbyte, dssync")
    parser.add_argument("--batch", type=int, default=None, help="sequences per rank and step")
    parser.add_argument("--context", type=int, default=None)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--dim", type=int, default=None)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--max-bytes", type=int, default=None, help="corpus size (bytes of stdlib sources)")
    parser.add_argument("--log-every", type=int, default=None)
    parser.add_argument("--eval-every", type=int, default=None)
    parser.add_argument("--eval-batches", type=int, default=None)
    parser.add_argument("--checkpoint", default=None, help="save model, optimizer and step state here at the end")
    parser.add_argument("--resume", default=None, help="load a --checkpoint file before training")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    size = dict(batch=8, context=64, layers=2, dim=64, max_bytes=1 << 19, log_every=1, eval_every=0,
                eval_batches=2) if args.tiny else dict(batch=16, context=128, layers=4, dim=192,
                                                       max_bytes=8 << 20, log_every=10, eval_every=100, eval_batches=8)
    for key, value in size.items():
        if getattr(args, key) is None:
            setattr(args, key, value)

    # torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT; without them we train alone.
    worker = init_from_torchrun()
    distributed, device, rank, world, log = worker.distributed, worker.device, worker.rank, worker.world_size, worker.log

    corpus = load_corpus(args.max_bytes)
    split = int(0.9 * corpus.numel())
    train_data, val_data = corpus[:split], corpus[split:]
    torch.manual_seed(args.seed)  # the same initial model everywhere (deft_compile also broadcasts rank 0's)
    model = GPT2Style(vocab=256, dim=args.dim, heads=4, layers=args.layers, context=args.context).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    step = deft_compile(model, optimizer, policy=args.policy, config=DeftConfig())
    start = 0
    if args.resume:
        # tensors and plain data only: loading a checkpoint runs no code from it
        state = torch.load(args.resume, map_location=device, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step.load_state_dict(step_state.from_plain(state["step"]))
        start = state["iteration"]
        log(f"resumed from {args.resume} at step {start}")
    log(f"corpus: {corpus.numel() / 1e6:.2f} MB of Python stdlib sources ({sysconfig.get_paths()['stdlib']}); "
        f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters; world size {world} "
        f"({dist.get_backend() if distributed else 'no process group'}), device {device}, policy {args.policy}")

    generator = torch.Generator().manual_seed(args.seed * 1000 + rank + 1)
    started = time.perf_counter()
    for iteration in range(start, start + args.steps):
        tokens, targets = batch(train_data, args.batch, args.context, generator, device)
        loss = step(tokens, targets=targets)
        if (iteration + 1) % args.log_every == 0 or iteration == start:
            log(f"step {iteration + 1} loss {float(loss):.4f} ({(time.perf_counter() - started) / (iteration + 1 - start):.3f} s/step)")
        if args.eval_every and (iteration + 1) % args.eval_every == 0:
            step.flush()  # apply delayed gradients before evaluating
            log(f"step {iteration + 1} eval loss {evaluate(model, val_data, args, device):.4f}")
    step.flush()
    final = evaluate(model, val_data, args, device)
    log(f"final eval loss {final:.4f} ({final / math.log(2):.3f} bits/byte) after {start + args.steps} steps, "
        f"{time.perf_counter() - started:.1f} s")
    if not args.tiny:
        log("sample: " + repr(sample(model, b"def ", 80, args.context, device)))
    if args.checkpoint:
        worker.save_checkpoint(args.checkpoint, {
            "model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "step": step_state.to_plain(step.state_dict()), "iteration": start + args.steps, "args": vars(args)})
    worker.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
