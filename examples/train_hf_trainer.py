"""Train a ``transformers`` GPT-2 with ``transformers.Trainer``, deft_compile's step underneath (``DeftTrainer``).

The script is a plain Trainer script; the one deft line is ``DeftTrainer(..., policy=..., deft_config=...)`` in
place of ``Trainer(...)``. Trainer keeps what it does (data sharding, AdamW with decay groups, warm-up then cosine,
clipping, bf16, gradient accumulation, logging, evaluation, checkpoints every ``--save-steps``, resuming); each
training step is one compiled graph: forward, Trainer's loss, backward, the policy's all-reduces and the update.

    torchrun --standalone --nproc-per-node 2 examples/train_hf_trainer.py --tiny --steps 6 --save-steps 3
    torchrun --standalone --nproc-per-node 2 examples/train_hf_trainer.py --tiny --steps 6 --save-steps 3 \
        --resume hf-trainer-out/checkpoint-3          # updates 4-6 again, from the checkpoint: the same numbers
    python examples/train_hf_trainer.py --steps 50                                          # one process

``DEFT_COMPILER=aten`` in front runs the step graphs without Inductor (a smoke test in seconds; Inductor compiles
the step's regions in the first two calls, seconds per region on a 2-core CPU, and nothing after).

Text: this Python's standard-library sources as bytes (``examples/corpus.py``; offline, the last 10 % held
out), cut into windows of ``--context`` bytes. The model is built from a ``GPT2Config``: nothing is downloaded.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch


def windows(data: torch.Tensor, context: int) -> list[dict[str, torch.Tensor]]:
    """Consecutive windows of ``context`` bytes: Trainer's dataset (it shards and shuffles them)."""
    count = data.numel() // context
    rows = data[: count * context].view(count, context).long()
    return [{"input_ids": row, "labels": row} for row in rows]


def shut_down() -> None:
    """Stop the process groups' threads while the interpreter is whole: ``destroy_process_group``, then collect the
    objects that held the groups (the Trainer and its deft step, freed once ``train`` returned, but only by the
    garbage collector: the Trainer's callbacks refer back to it), so that each gloo group's destructor joins its
    worker threads now.

    Why: a gloo worker thread frees a finished collective's tensors just after the caller's wait returns. If that
    happens while the interpreter finalizes, freeing their Python objects needs the GIL, Python 3.11 ends the thread
    inside a destructor instead, and the process aborts (SIGABRT, "terminate called without an active exception").
    ``destroy_process_group`` alone does not stop gloo's threads: they stop when the last reference to the group goes.
    """
    import gc

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="optimizer updates (Trainer's max_steps)")
    parser.add_argument("--policy", default="deft", help="deft, wfbp (DDP's schedule), bytescheduler, usbyte")
    parser.add_argument("--tiny", action="store_true", help="a very small model and corpus (smoke tests, CI)")
    parser.add_argument("--accumulation", type=int, default=2, help="gradient_accumulation_steps")
    parser.add_argument("--save-steps", type=int, default=100, help="a checkpoint every this many updates")
    parser.add_argument("--eval-steps", type=int, default=None, help="an evaluation every this many updates")
    parser.add_argument("--output-dir", default="hf-trainer-out")
    parser.add_argument("--resume", default=None, help="a checkpoint folder to continue from (Trainer's "
                                                             "resume_from_checkpoint)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    train(args)
    shut_down()
    return 0


def train(args: argparse.Namespace) -> None:
    """Train, evaluate, and print the result on rank 0 (nothing it creates outlives the call but through cycles)."""
    import transformers

    from deft_compile import DeftConfig
    from deft_compile.integrations.transformers import DeftTrainer
    from corpus import load_stdlib_corpus  # examples/corpus.py, beside this script

    size = (dict(batch=4, context=32, layers=2, dim=32, max_bytes=1 << 17, eval_steps=3)
            if args.tiny else dict(batch=8, context=128, layers=4, dim=128, max_bytes=8 << 20, eval_steps=50))
    if args.eval_steps is None:
        args.eval_steps = size["eval_steps"]
    corpus = load_stdlib_corpus(size["max_bytes"])
    split = int(0.9 * corpus.numel())
    train, held_out = windows(corpus[:split], size["context"]), windows(corpus[split:], size["context"])
    held_out = held_out[: 8 * size["batch"]]

    transformers.set_seed(args.seed)
    config = transformers.GPT2Config(vocab_size=256, n_positions=size["context"], n_embd=size["dim"],
                                     n_layer=size["layers"], n_head=4, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    cuda = torch.cuda.is_available()
    training = transformers.TrainingArguments(
        output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=size["batch"],
        per_device_eval_batch_size=size["batch"], gradient_accumulation_steps=args.accumulation,
        learning_rate=1e-3, weight_decay=0.1, adam_beta2=0.95, warmup_steps=max(1, args.steps // 10),
        lr_scheduler_type="cosine", max_grad_norm=1.0, bf16=True, use_cpu=not cuda,
        logging_steps=1, eval_strategy="steps", eval_steps=args.eval_steps, save_strategy="steps",
        save_steps=args.save_steps, report_to=[], seed=args.seed, disable_tqdm=True)
    trainer = DeftTrainer(model=model, args=training, train_dataset=train, eval_dataset=held_out,
                          policy=args.policy, deft_config=DeftConfig())
    if trainer.is_world_process_zero():
        print(f"GPT-2 {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters, world size "
              f"{training.world_size}, policy {args.policy}, accumulation {args.accumulation}, bf16, clip 1.0",
              flush=True)
    trainer.train(resume_from_checkpoint=args.resume)
    metrics = trainer.evaluate()
    if trainer.is_world_process_zero():
        step = trainer.deft_step
        plans = ", ".join(entry["reason"] for entry in step.plan_history) or "local training"
        print(f"final eval loss {metrics['eval_loss']:.4f} after {trainer.state.global_step} updates; "
              f"{step.trace_count} step graphs; plans: {plans}", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
