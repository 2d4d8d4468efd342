"""Workers for the ``transformers.Trainer`` integration (``DeftTrainer``) and the accelerate recipe, in 2 gloo processes.

The Trainer finds the process group the launcher made (accelerate's ``MULTI_CPU``) from torchrun's variables,
set here per rank. Models are ``tests/hf_models.py``'s tiny GPT-2 from a config (random weights, nothing
downloaded); every run of one worker starts from the same copy of it.
"""

from __future__ import annotations

import copy
import dataclasses
import os

import torch

from integration_workers import count_collectives  # noqa: F401  (re-exported for the tests)

VOCAB, SEQ = 64, 16


def _as_torchrun(rank: int, world_size: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))


def gpt2(layers: int):
    """A seeded tiny GPT-2 (Dropout on) and 64 samples of 16 tokens as Trainer's dataset."""
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=layers, n_head=4,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (64, SEQ), generator=generator)
    return model, [{"input_ids": row, "labels": row.clone()} for row in ids]


class TinyLM(torch.nn.Module):
    """An embedding and a linear head with a transformers-style forward (``input_ids``, ``labels`` -> ``{"loss"}``):
    what Trainer trains, in a few kernels (Dynamo compiles it in a fraction of GPT-2's time)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 32)
        self.head = torch.nn.Linear(32, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor,
                num_items_in_batch: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        logits = self.head(torch.tanh(self.embed(input_ids)))
        if num_items_in_batch is None:
            return {"loss": torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())}
        total = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
        return {"loss": total / num_items_in_batch}


def training_arguments(output_dir: str, **overrides):
    import transformers

    settings = dict(output_dir=output_dir, use_cpu=True, per_device_train_batch_size=2, max_steps=4, logging_steps=1,
                    report_to=[], save_strategy="no", seed=0, disable_tqdm=True, dataloader_num_workers=0)
    settings.update(overrides)
    return transformers.TrainingArguments(**settings)


class Recorder:
    """A ``TrainerCallback`` (built lazily: transformers is imported in the worker) recording, per optimizer update,
    the parameters after it, and gloo's collectives during the last one (from ``on_step_begin`` to ``on_step_end``:
    the steady state; profiling costs time, and the first updates trace and check the step)."""

    def __new__(cls, trainer_ref: list):
        import transformers

        class _Recorder(transformers.TrainerCallback):
            def __init__(self) -> None:
                self.params: list[dict[str, torch.Tensor]] = []
                self.collectives: list[dict[str, int]] = []
                self._profiler = None

            def on_step_begin(self, args, state, control, **kwargs):
                self._profiler = None
                if state.global_step == state.max_steps - 1:
                    self._profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                    self._profiler.start()

            def on_step_end(self, args, state, control, **kwargs):
                self.params.append({n: p.detach().clone() for n, p in trainer_ref[0].model.named_parameters()})
                if self._profiler is None:
                    return
                self._profiler.stop()
                events = [e.name for e in self._profiler.events() if e.name.startswith("gloo:")]
                counts: dict[str, int] = {}
                for name in events:
                    counts[name.split(":", 1)[1]] = counts.get(name.split(":", 1)[1], 0) + 1
                self.collectives.append(counts)

        return _Recorder()


def _train(trainer_cls, model, data, args, **kwargs) -> dict:
    import time; t0 = time.time()
    trainer_ref: list = []
    recorder = Recorder(trainer_ref)
    trainer = trainer_cls(model=model, args=args, train_dataset=data, callbacks=[recorder], **kwargs)
    trainer_ref.append(trainer)
    t1 = time.time()
    trainer.train()
    print("TIMING", trainer_cls.__name__, args.output_dir, t1 - t0, time.time() - t1, flush=True)
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    return {"trainer": trainer, "losses": [entry["loss"] for entry in logs],
            "grad_norms": [entry.get("grad_norm") for entry in logs], "params": recorder.params,
            "collectives": recorder.collectives}


def _compare_params(actual: list[dict], expected: list[dict]) -> list[dict]:
    """Per update: the worst relative difference (over each tensor's largest magnitude) outside GPT-2's attention
    key bias, and the worst absolute difference of the key bias (``workers._split_key_bias``: its gradient is
    round-off, which Adam turns into steps of size lr, differently in any two implementations)."""
    from workers import _split_key_bias

    report = []
    for a, e in zip(actual, expected):
        width = e["transformer.wte.weight"].shape[1]
        (rest_a, key_a), (rest_e, key_e) = _split_key_bias(a, width), _split_key_bias(e, width)
        rels = {n: float((rest_a[n] - rest_e[n]).abs().max() / rest_e[n].abs().max().clamp_min(1e-30)) for n in rest_e}
        worst = max(rels, key=rels.get)
        key = max((float((key_a[n] - key_e[n]).abs().max()) for n in key_e), default=0.0)
        report.append({"max_rel": rels[worst], "worst": worst, "key_bias_abs": key, "compared": len(rest_e) + len(key_e),
                       "missing": sorted(set(e) - set(a))})
    return report


def trainer_against_ddp(rank: int, world_size: int, output_dir: str) -> dict:
    """Plain ``Trainer`` (DDP) against ``DeftTrainer(policy="wfbp")``, same GPT-2, data and seeds: gradient
    accumulation 2, bf16 autocast, clipping at 1.0, the default AdamW (fused) and linear LR decay; then the plain
    Trainer around ``torch.compile(TinyLM(), backend="deft")`` (DDP(compiled)), against a plain run."""
    _as_torchrun(rank, world_size)
    import transformers

    from deft_compile import DeftConfig
    from deft_compile.integrations.transformers import DeftTrainer

    transformers.logging.set_verbosity_error()
    base, data = gpt2(layers=1)
    args = dict(gradient_accumulation_steps=2, bf16=True, max_steps=4)
    plain = _train(transformers.Trainer, copy.deepcopy(base), data, training_arguments(f"{output_dir}/plain", **args))
    deft = _train(DeftTrainer, copy.deepcopy(base), data, training_arguments(f"{output_dir}/deft", **args),
                  policy="wfbp", deft_config=DeftConfig(first_bucket_mb=0.01, bucket_cap_mb=0.05))
    step = deft["trainer"].deft_step
    report = {"plain": {k: plain[k] for k in ("losses", "grad_norms", "collectives")},
              "deft": {k: deft[k] for k in ("losses", "grad_norms", "collectives")},
              "params": _compare_params(deft["params"], plain["params"]),
              "buckets": len(step.items), "accumulation_steps": step.config.accumulation_steps,
              "max_grad_norm": step.config.max_grad_norm, "updates": deft["trainer"].state.global_step,
              "ddp_wrapped": type(plain["trainer"].model_wrapped).__name__,
              "deft_wrapped": type(deft["trainer"].model_wrapped).__name__}

    # DDP(compiled) under the plain Trainer: the backend's all-reduce only (no accumulation: the backend averages
    # every backward, also inside no_sync)
    torch.manual_seed(0)
    small = TinyLM()
    single = dict(max_steps=2, remove_unused_columns=False)
    reference = _train(transformers.Trainer, copy.deepcopy(small), data,
                       training_arguments(f"{output_dir}/plain1", **single))
    compiled = torch.compile(copy.deepcopy(small), backend="deft", options={"compiler": "aten"})
    workaround = _train(transformers.Trainer, compiled, data, training_arguments(f"{output_dir}/compiled", **single))
    report["ddp_of_compiled"] = {"losses": workaround["losses"], "reference_losses": reference["losses"],
                                 "collectives": workaround["collectives"],
                                 "reference_collectives": reference["collectives"],
                                 "wrapped": type(workaround["trainer"].model_wrapped).__name__}
    return report


def delaying_profile(model, batch: dict, world_size: int):
    """A deterministic profile of ``model`` whose DeFT plan delays buckets (as ``workers.synthetic_profile``; its
    sizes captured once per test session: ``workers._sizes_profile``)."""
    from deft_compile.planner.plan import LinkCost
    from workers import _sizes_profile

    scratch = copy.deepcopy(model)
    profile = _sizes_profile(scratch, torch.optim.AdamW(scratch.parameters()), None, batch, keyword=True)
    params = [dataclasses.replace(p, forward_ms=0.2 + p.numel * 1e-4, backward_ms=0.4 + p.numel * 2e-4, update_ms=0.01)
              for p in profile.params]
    compute = sum(p.forward_ms + p.backward_ms for p in params)
    beta = 0.9 * compute / sum(p.nbytes for p in params)
    return dataclasses.replace(profile, params=params, links=[LinkCost("synthetic", 0.05, beta)], world_size=world_size)


def trainer_checkpoint_run(rank: int, world_size: int, output_dir: str, resume: str | None,
                           profile_json: str | None = None) -> dict:
    """``DeftTrainer(policy="deft")`` with a delaying plan and the Preserver on, 6 updates with a checkpoint every
    3; with ``resume``, continued from that checkpoint folder. ``profile_json``: the profile to plan from (default:
    ``delaying_profile``)."""
    _as_torchrun(rank, world_size)
    import transformers

    from deft_compile import DeftConfig, step_state
    from deft_compile.integrations.transformers import DeftTrainer

    transformers.logging.set_verbosity_error()
    from deft_compile.planner.plan import Profile

    base, data = gpt2(layers=1)
    profile = (Profile.from_json(profile_json) if profile_json is not None else
               delaying_profile(base, {k: torch.stack([d[k] for d in data[:2]]) for k in data[0]}, world_size))
    args = training_arguments(output_dir, max_steps=6, save_strategy="steps", save_steps=3)
    trainer_ref: list = []
    recorder = Recorder(trainer_ref)
    trainer = DeftTrainer(model=base, args=args, train_dataset=data, callbacks=[recorder], policy="deft",
                          profile=profile, deft_config=DeftConfig(first_bucket_mb=0.01, bucket_cap_mb=0.05))
    trainer_ref.append(trainer)
    trainer.train(resume_from_checkpoint=resume)
    step = trainer.deft_step
    path = os.path.join(output_dir, "checkpoint-3", f"deft_step_rank{rank}.pt")  # written by a run from the start
    saved = step_state.read(path, path) if os.path.exists(path) else {"pending": {}, "step_count": None}
    logs = {entry["step"]: entry["loss"] for entry in trainer.state.log_history if "loss" in entry}
    return {"losses": logs, "params": {n: p.detach().clone() for n, p in base.named_parameters()},
            "optimizer": {f"{i}:{k}": v.clone() for i, s in enumerate(step.optimizer.state.values())
                          for k, v in s.items()},
            "delayed": sum(1 for item in step.plan.items if item.delay), "saved_pending": len(saved["pending"]),
            "saved_step_count": saved["step_count"], "step_count": step.step_count, "pending_at_end": step.pending,
            "preserver": step.state_dict()["preserver"], "global_step": trainer.state.global_step,
            "profile": profile.to_json()}


def trainer_refusals(rank: int, world_size: int, output_dir: str) -> dict:
    """The ``TrainingArguments`` DeftTrainer refuses, each with the message it raises (one process)."""
    _as_torchrun(rank, world_size)
    import transformers

    from deft_compile import DeftConfig
    from deft_compile.integrations.transformers import DeftTrainer

    transformers.logging.set_verbosity_error()
    model, data = gpt2(layers=1)
    cases = {"torch_compile": dict(torch_compile=True), "torch_compile_backend": dict(torch_compile_backend="deft"),
             "fsdp": dict(fsdp="full_shard")}
    messages = {}
    for name, overrides in cases.items():
        try:
            args = training_arguments(f"{output_dir}/{name}", **overrides)
            DeftTrainer(model=model, args=args, train_dataset=data)
            messages[name] = None
        except Exception as error:  # noqa: BLE001 - reported: type and message are what the test checks
            messages[name] = f"{type(error).__name__}: {error}"
    args = training_arguments(f"{output_dir}/deepspeed")
    args.deepspeed = {"train_micro_batch_size_per_gpu": 2}  # the config a user passes; deepspeed is not installed
    try:
        DeftTrainer(model=model, args=args, train_dataset=data)
        messages["deepspeed"] = None
    except Exception as error:  # noqa: BLE001
        messages["deepspeed"] = f"{type(error).__name__}: {error}"
    try:
        trainer = DeftTrainer(model=model, args=training_arguments(f"{output_dir}/clip", max_grad_norm=1.0),
                              train_dataset=data, deft_config=DeftConfig(max_grad_norm=0.5))
        trainer.train()
        messages["conflict"] = None
    except Exception as error:  # noqa: BLE001
        messages["conflict"] = f"{type(error).__name__}: {error}"
    try:
        trainer = DeftTrainer(model=model, args=training_arguments(f"{output_dir}/sgd", optim="adafactor"),
                              train_dataset=data)
        trainer.train()
        messages["optimizer"] = None
    except Exception as error:  # noqa: BLE001
        messages["optimizer"] = f"{type(error).__name__}: {error}"
    return messages


def accelerate_recipe(rank: int, world_size: int, steps: int = 4) -> dict:
    """The accelerate recipe (docs/INTEGRATIONS.md) against accelerate's own loop (``prepare(model, optimizer,
    loader)``, ``accumulate``, ``backward``, ``clip_grad_norm_``), same model, data and seeds: bf16, accumulation 2,
    clipping at 1.0, AdamW, ``policy="wfbp"``."""
    _as_torchrun(rank, world_size)
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    from deft_compile import DeftConfig, deft_compile

    base, data = gpt2(layers=1)
    accumulation = 2
    accelerator = Accelerator(mixed_precision="bf16", gradient_accumulation_steps=accumulation, cpu=True)

    # accelerate's loop: DDP, accumulate(), backward(), clip_grad_norm_()
    model = copy.deepcopy(base)
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5)
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(data, batch_size=2))
    reference_type = type(model).__name__
    reference, reference_losses = [], []
    for index, batch in enumerate(loader):
        if index == steps * accumulation:
            break
        with accelerator.accumulate(model):
            torch.manual_seed(100 * rank + index)
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
        reference_losses.append(float(loss.detach()))
        if accelerator.sync_gradients:
            reference.append({n: p.detach().clone() for n, p in model.module.named_parameters()})

    # the recipe: the loader prepared, the model prepared for evaluation only, the optimizer not at all
    model = accelerator.prepare_model(copy.deepcopy(base), evaluation_mode=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5)
    loader = accelerator.prepare(DataLoader(data, batch_size=2))
    step = deft_compile(model, optimizer, policy="wfbp",
                        config=DeftConfig(max_grad_norm=1.0, accumulation_steps=accumulation, first_bucket_mb=0.01,
                                          bucket_cap_mb=0.05))
    deft, deft_losses = [], []
    for index, batch in enumerate(loader):
        if index == steps * accumulation:
            break
        torch.manual_seed(100 * rank + index)
        deft_losses.append(float(step(**batch)))
        if step.last_call_updated:
            deft.append({n: p.detach().clone() for n, p in model.named_parameters()})
    collectives = count_collectives(lambda: [step(**batch) for _ in range(accumulation)])
    return {"losses": deft_losses, "reference_losses": reference_losses, "params": _compare_params(deft, reference),
            "updates": len(deft), "reference_type": reference_type,
            "collectives": collectives, "buckets": len(step.items)}
