"""Workers of the default-route lane (tests/test_default_route.py), in 2 gloo processes.

``on_default_route`` runs any worker of the suite as a user's process runs it: without ``$DEFT_COMPILER`` (the
suite's aten default, tests/conftest.py, taken out), so every ``DeftConfig()`` takes the default compiler, regional
Inductor; it reports what lowered the step graphs' regions.

Every comparison is bounded by ``torch.compile``'s own difference from eager on the same model, data and steps,
measured in the same launch (tests/bounds.py): ``compile_beside_ddp`` measures it (DDP around ``torch.compile(model)``
with the same eager optimizer, learning-rate schedule, clipping, accumulation and loss scaling, against plain DDP),
``with_yardstick`` runs it after any worker of the suite, ``delayed_beside_compile`` measures it for the eager
reference of the delayed semantics beside deft, ``trainer_beside_plain`` for ``transformers.Trainer``
(``torch_compile=True``) beside ``DeftTrainer``.
"""

from __future__ import annotations

import copy
import os

import torch
from torch.nn.parallel import DistributedDataParallel

from deft_compile import DeftConfig, deft_compile
from models import CASES
from workers import POLICY_OPTIONS, _compare, _ddp_pair, _named_state, _step_beside_ddp, synthetic_profile


def on_default_route(rank: int, world_size: int, fn, *args) -> dict:
    """``fn(rank, world_size, *args)`` with ``$DEFT_COMPILER`` unset: ``{"value": its result, "default": the compiler a
    ``DeftConfig()`` takes, "lowered": how many step-graph regions Inductor compiled ("inductor") and how many fell
    back to aten ("aten")}``."""
    from deft_compile.compilers import ENV_COMPILER
    from deft_compile.step import lowering

    os.environ.pop(ENV_COMPILER, None)
    lowering.lowered_counts.clear()
    value = fn(rank, world_size, *args)
    return {"value": value, "default": DeftConfig().compiler, "lowered": dict(lowering.lowered_counts)}


def _draw_dropout_like_eager() -> None:
    """Inductor draws Dropout masks from ATen's generator, as deft's lowering does (``lowering.PINNED_ORDER_CONFIG``),
    so a compiled model and eager see the same masks under the same seed."""
    import torch._inductor.config as inductor_config

    inductor_config.fallback_random = True


def compile_beside_ddp(rank: int, world_size: int, case: str, steps: int, autocast: str | None = None,
                       overflow_at: int | None = None, max_grad_norm: float | None = None, accumulation: int = 1,
                       lr_schedule: bool = False) -> list[dict]:
    """``torch.compile``'s own difference from eager: ``case``'s seeded model under torch DDP (eager) and a copy
    compiled with ``torch.compile`` (Inductor) under DDP, each with the case's eager optimizer, on the per-rank batches
    and Dropout seeds of ``workers.compare_with_ddp``. With ``autocast`` (``"float16"``, ``"bfloat16"``) both run
    forward and loss under CPU autocast with a ``GradScaler`` each, unscale, clip at ``max_grad_norm`` and step through
    it, as ``loop_workers.loss_scaling_with_ddp``'s DDP side does (both scales jump to 2**40 at step ``overflow_at``);
    with ``max_grad_norm`` alone both clip as ``loop_workers.clip_with_ddp``'s DDP side does; with ``accumulation`` N
    both accumulate N micro-batches (``no_sync()`` on the first N-1, the loss over N) per update, as
    ``loop_workers.accumulation_with_ddp``'s DDP side does; with ``lr_schedule`` both step the warm-up of
    ``workers.policy_with_lr_schedule_beside_ddp`` (``LambdaLR``, ``(t + 1) / steps``) after every step. After every
    update, the compiled copy against eager (``workers._compare``; gradients left out under a scaler, as there), with
    the difference of the losses (``loss_diff``), the relative difference of the norms the clip measured (``norm_diff``;
    with ``max_grad_norm``) and whether the compiled side's scaler skipped the update."""
    import contextlib

    from torch.optim.lr_scheduler import LambdaLR

    _draw_dropout_like_eager()
    make_optimizer, make_batch, loss_fn, base, ddp_model, ddp, ddp_optimizer, _, _ = _ddp_pair(case)
    compiled_model = copy.deepcopy(base)
    compiled = DistributedDataParallel(torch.compile(compiled_model), **CASES[case][4])
    sides = [(ddp_model, ddp, ddp_optimizer), (compiled_model, compiled, make_optimizer(compiled_model))]
    scalers = [torch.amp.GradScaler("cpu", growth_interval=3) for _ in sides] if autocast else [None, None]
    schedulers = [LambdaLR(optimizer, lambda t: (t + 1) / steps) for _, _, optimizer in sides] if lr_schedule else []
    region = (lambda: torch.autocast("cpu", dtype=getattr(torch, autocast))) if autocast else contextlib.nullcontext
    data = torch.Generator().manual_seed(1234 + rank)
    report = []
    for t in range(steps):
        inputs, targets = make_batch(data)
        last = t % accumulation == accumulation - 1
        losses, norms, skipped = [], [], False
        for (model, module, optimizer), scaler in zip(sides, scalers):
            if scaler is not None and t == overflow_at:
                scaler._scale.fill_(2.0**40)
            torch.manual_seed(100 * rank + t)
            if t % accumulation == 0:
                optimizer.zero_grad(set_to_none=True)
            with contextlib.nullcontext() if last else module.no_sync():
                with region():
                    loss = loss_fn(module(inputs), targets)
                losses.append(float(loss.detach()))
                (scaler.scale(loss / accumulation) if scaler is not None else loss / accumulation).backward()
            if not last:
                continue
            if scaler is not None:
                scaler.unscale_(optimizer)
            if max_grad_norm is not None:
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)))
            if scaler is not None:
                before = scaler.get_scale()
                scaler.step(optimizer)
                scaler.update()
                skipped = scaler.get_scale() < before
            else:
                optimizer.step()
        for scheduler in schedulers:
            scheduler.step()
        if not last:
            continue
        states = [_named_state(model, optimizer) for model, _, optimizer in sides]
        if autocast:
            states = [{k: v for k, v in state.items() if not k.startswith("grad:")} for state in states]
        entry = _compare(states[1], states[0])
        entry.update(step=t, loss_diff=abs(losses[1] - losses[0]), skipped=skipped)
        if norms:
            entry["norm_diff"] = abs(norms[1] - norms[0]) / norms[0]
        report.append(entry)
    return report


def with_yardstick(rank: int, world_size: int, fn, args: tuple, case: str, steps: int,
                   options: dict | None = None) -> dict:
    """``fn(rank, world_size, *args)`` (a worker returning a dict), then in the same process its bound,
    ``compile_beside_ddp(rank, world_size, case, steps, **options)`` on the reference ``fn`` compares with: ``fn``'s
    result with the yardstick's report under ``"compiled"``."""
    result = fn(rank, world_size, *args)
    return {**result, "compiled": compile_beside_ddp(rank, world_size, case, steps, **(options or {}))}


def loss_scaling_beside_compile(rank: int, world_size: int, steps: int, overflow_at: int, autocast: str) -> dict:
    """``loop_workers.loss_scaling_with_ddp`` (deft's wfbp with a ``GradScaler`` and clipping at 5.0 against DDP's
    recipe), then ``compile_beside_ddp`` on the same case, batches and scale schedule: its bound."""
    from loop_workers import loss_scaling_with_ddp

    deft = loss_scaling_with_ddp(rank, world_size, steps, overflow_at, autocast)
    compiled = compile_beside_ddp(rank, world_size, "mlp_dropout_sgd", steps, autocast, overflow_at, 5.0)
    return {"deft": deft["steps"], "compiled": compiled}


def delayed_beside_compile(rank: int, world_size: int, case: str, steps: int, delayed_update: str,
                           compiler: str | None = None) -> dict:
    """deft with a plan that delays buckets (``POLICY_OPTIONS["deft"]`` on ``workers.synthetic_profile``, the Preserver
    on, ``delayed_update``), as ``workers.compare_deft_with_delayed_reference`` runs it, beside two eager references of
    the plan's semantics (``workers.PlanReference``): one with the model eager, one with it compiled in place by
    ``torch.compile`` (``nn.Module.compile``: same parameter names), on the same batches and Dropout seeds. Per step and
    after ``flush``: deft against the eager reference (``steps``, ``final``), and the compiled reference against it
    (``compiled``: torch.compile's own difference from eager on these steps and semantics). ``compiler``: deft's
    (default: ``DeftConfig()``'s)."""
    from deft_compile.preserver import PreserverConfig
    from workers import PlanReference, plan_schedule_by_name, reference_case

    _draw_dropout_like_eager()
    loss_fn, ref_model, ref_optimizer, deft_model, deft_optimizer, batches, profile = reference_case(
        case, rank, world_size, steps)
    compiled_model = copy.deepcopy(ref_model)
    compiled_optimizer = CASES[case][1](compiled_model)
    compiled_model.compile()
    step = deft_compile(deft_model, deft_optimizer, loss_fn, policy="deft", profile=profile,
                        config=DeftConfig(plan_options=POLICY_OPTIONS["deft"], preserver=PreserverConfig(),
                                          delayed_update=delayed_update,
                                          **({"compiler": compiler} if compiler else {})))
    references, report, compiled_report = [], [], []
    for t, (inputs, targets) in enumerate(batches):
        torch.manual_seed(100 * rank + t)
        step(inputs, targets)
        if not references:  # the plan exists once the first step ran
            references = [PlanReference(model, optimizer, loss_fn, plan_schedule_by_name(step), world_size,
                                        local=step.config.delayed_update == "local",
                                        compensated=step.config.delayed_update == "compensated")
                          for model, optimizer in ((ref_model, ref_optimizer), (compiled_model, compiled_optimizer))]
        for reference in references:
            torch.manual_seed(100 * rank + t)
            reference.step(inputs, targets)
        eager = _named_state(ref_model, ref_optimizer)
        entry = _compare(_named_state(deft_model, deft_optimizer), eager)
        entry.update(step=t, pending=len(step.pending))
        report.append(entry)
        compiled_report.append({**_compare(_named_state(compiled_model, compiled_optimizer), eager), "step": t})
    delayed = sorted({step.profile.params[s.param].name for item in step.plan.items if item.delay for s in item.slices})
    step.flush()
    for reference in references:
        reference.flush()
    eager = _named_state(ref_model, ref_optimizer)
    final = _compare(_named_state(deft_model, deft_optimizer), eager)
    compiled_report.append({**_compare(_named_state(compiled_model, compiled_optimizer), eager), "step": "flush"})
    return {"steps": report, "final": final, "compiled": compiled_report, "delayed": delayed,
            "all_params": len(list(deft_model.parameters())), "pending_after_flush": step.pending,
            "semantics": step.config.delayed_update, "lowering_history": step.lowering.history,
            "final_params": {n: p.detach().clone() for n, p in deft_model.named_parameters()}}


def policy_beside_ddp(rank: int, world_size: int, case: str, steps: int, policy: str) -> dict:
    """deft's ``policy`` beside torch DDP on ``case`` (``wfbp`` with the test bucket caps of ``compare_with_ddp``; the
    other policies plan from ``workers.synthetic_profile``, so they reorder and defer updates, as in
    ``compare_policy_with_ddp``). Per step the comparison (a parameter whose update the plan moved to the next
    forward against DDP's previous step); after ``flush`` against DDP's last state."""
    (make_optimizer, make_batch, loss_fn, base,
     ddp_model, ddp, ddp_optimizer, deft_model, deft_optimizer) = _ddp_pair(case)
    data = torch.Generator().manual_seed(1234 + rank)
    batches = [make_batch(data) for _ in range(steps)]
    if policy == "wfbp":
        step = deft_compile(deft_model, deft_optimizer, loss_fn, policy="wfbp",
                            config=DeftConfig(first_bucket_mb=0.0002, bucket_cap_mb=0.004))
    else:
        scratch = copy.deepcopy(base)
        profile = synthetic_profile(scratch, make_optimizer(scratch), loss_fn, batches[0], world_size)
        step = deft_compile(deft_model, deft_optimizer, loss_fn, policy="deft" if policy == "deft-sync" else policy,
                            profile=profile, config=DeftConfig(plan_options=POLICY_OPTIONS[policy]))
    report = []
    for t, (inputs, targets) in enumerate(batches):
        entry, deferred = _step_beside_ddp(step, rank, t, inputs, targets, loss_fn, ddp, ddp_model, ddp_optimizer,
                                           deft_model, deft_optimizer)
        entry.update(step=t, deferred=len(deferred))
        report.append(entry)
    step.flush()
    final = _compare(_named_state(deft_model, deft_optimizer), _named_state(ddp_model, ddp_optimizer))
    return {"steps": report, "final": final, "pending_after_flush": step.pending, "compiler": step.compiler}


def dlcp_beside_ddp(rank: int, world_size: int, steps: int) -> dict:
    """DLCP without a deadline (nothing chunked or dropped) beside torch DDP, as ``workers.dlcp_run`` plans it, with
    the per-tensor comparison of ``workers._compare`` every step and after ``flush``."""
    make_optimizer, make_batch, loss_fn, base, ddp_model, ddp, ddp_optimizer, deft_model, deft_optimizer = _ddp_pair(
        "mlp_dropout_sgd")
    data = torch.Generator().manual_seed(1234 + rank)
    batches = [make_batch(data) for _ in range(steps)]
    scratch = copy.deepcopy(base)
    profile = synthetic_profile(scratch, make_optimizer(scratch), loss_fn, batches[0], world_size,
                                comm_over_compute=2.0)
    step = deft_compile(deft_model, deft_optimizer, loss_fn, policy="dlcp", profile=profile,
                        config=DeftConfig(plan_options={"deadline_ms": None, "max_loss": 0.1, "chunk_bytes": 256}))
    report = []
    for t, (inputs, targets) in enumerate(batches):
        entry, _ = _step_beside_ddp(step, rank, t, inputs, targets, loss_fn, ddp, ddp_model, ddp_optimizer,
                                    deft_model, deft_optimizer)
        entry.update(step=t, stats=step.last_stats.get("stats:0"))
        report.append(entry)
    step.flush()
    final = _compare(_named_state(deft_model, deft_optimizer), _named_state(ddp_model, ddp_optimizer))
    return {"steps": report, "final": final, "compiler": step.compiler}


def trainer_beside_plain(rank: int, world_size: int, output_dir: str) -> dict:
    """``trainer_workers.trainer_against_ddp``'s first comparison on the compiler a ``DeftConfig()`` takes, in float32,
    and its bound: the plain ``Trainer`` (DDP), the plain ``Trainer`` with ``torch_compile=True`` (``torch.compile``'s
    own difference from eager) and ``DeftTrainer(policy="wfbp")`` on the same one-layer GPT-2, data and seeds:
    gradient accumulation 2, clipping at 1.0, the default fused AdamW and linear decay. Per update, each against the
    plain Trainer (``trainer_workers._compare_params``: GPT-2's attention key bias apart)."""
    from trainer_workers import _as_torchrun, _compare_params, _train, gpt2, training_arguments

    _as_torchrun(rank, world_size)
    import transformers

    from deft_compile.integrations.transformers import DeftTrainer

    transformers.logging.set_verbosity_error()
    _draw_dropout_like_eager()
    base, data = gpt2(layers=1)
    args = dict(gradient_accumulation_steps=2, max_steps=4)
    plain = _train(transformers.Trainer, copy.deepcopy(base), data, training_arguments(f"{output_dir}/plain", **args))
    compiled = _train(transformers.Trainer, copy.deepcopy(base), data,
                      training_arguments(f"{output_dir}/compiled", torch_compile=True, **args))
    deft = _train(DeftTrainer, copy.deepcopy(base), data, training_arguments(f"{output_dir}/deft", **args),
                  policy="wfbp", deft_config=DeftConfig(first_bucket_mb=0.01, bucket_cap_mb=0.05))
    return {"losses": {name: run["losses"] for name, run in (("plain", plain), ("compiled", compiled), ("deft", deft))},
            "grad_norms": {name: run["grad_norms"] for name, run in (("plain", plain), ("compiled", compiled),
                                                                       ("deft", deft))},
            "deft": _compare_params(deft["params"], plain["params"]),
            "compiled": _compare_params(compiled["params"], plain["params"]),
            "updates": deft["trainer"].state.global_step, "compiler": deft["trainer"].deft_step.compiler}
