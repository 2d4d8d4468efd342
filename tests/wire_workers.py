"""Workers of tests/test_wire_precision.py: a plan whose items cross the link in 16 bits beside torch DDP with the
compression hook of the same dtype (2 gloo processes; module level so spawned and forked workers import them)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from deft_compile import DeftConfig, deft_compile
from deft_compile.planner.plan import INT8_BLOCK, WIRE_DTYPES
from models import CASES, TinyTransformerLM
from lm_models import lm_loss
from workers import POLICY_OPTIONS, _compare, _ddp_pair, _named_state, _step_beside_ddp, case_setup, synthetic_profile

#: the test bucket caps of ``workers.compare_with_ddp``: several buckets on the small models
BUCKETS = {"first_bucket_mb": 0.0002, "bucket_cap_mb": 0.004}

#: the models the wire tests train, as ``models.CASES`` lists them: the Dropout MLP with SGD (Nesterov momentum,
#: weight decay), and the tied-embedding transformer with SGD and momentum, whose LayerNorm, softmax and GELU
#: Inductor fuses, so ``torch.compile`` differs from eager by float32 round-off from the first step
WIRE_CASES = {
    "mlp_dropout_sgd": CASES["mlp_dropout_sgd"],
    "transformer_sgd": (
        TinyTransformerLM,
        lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
        lambda g: (torch.randint(0, 50, (4, 16), generator=g), torch.randint(0, 50, (4, 16), generator=g)),
        lm_loss,
        {},
        True,
    ),
}


def bf16_hook(state, bucket):  # no annotations: DDP compares them with its types, and this module's are strings
    """``default_hooks.bf16_compress_hook`` itself, under another name: ``DistributedDataParallel.register_comm_hook``
    refuses a hook by that name unless torch is a CUDA build with NCCL 2.10+ (or XPU with XCCL), whatever the
    backend (docs/POLICIES.md); gloo on a CPU build all-reduces bfloat16."""
    return default_hooks.bf16_compress_hook(state, bucket)


def int8_bytes(flat: torch.Tensor) -> torch.Tensor:
    """The 8-bit wire's bytes of one parameter's flat gradient share (docs/POLICIES.md, "Wire precision"): padded
    to whole blocks of ``INT8_BLOCK``, per block round(g / s) clamped to [-127, 127] with s = max|g| / 127 (1 for a
    zero block), then the scales, as ``uint8``."""
    blocks = torch.nn.functional.pad(flat, (0, (-flat.numel()) % INT8_BLOCK)).view(-1, INT8_BLOCK)
    scale = blocks.abs().amax(dim=1, keepdim=True) / 127.0
    safe = torch.where(scale > 0, scale, 1.0)
    ints = torch.clamp(torch.round(blocks / safe), -127.0, 127.0).to(torch.int8)
    return torch.cat([ints.view(-1).view(torch.uint8), scale.view(-1).view(torch.uint8)])


def int8_sum(rows: torch.Tensor, numel: int) -> torch.Tensor:
    """The float32 sum over the ranks' rows of ``int8_bytes`` (``[world, bytes]``), without the padding."""
    blocks = rows.shape[1] // (INT8_BLOCK + 4)
    ints = rows[:, :blocks * INT8_BLOCK].view(torch.int8).float().view(rows.shape[0], blocks, INT8_BLOCK)
    scales = rows[:, blocks * INT8_BLOCK:].view(torch.float32).view(rows.shape[0], blocks, 1)
    return (ints * scales).sum(0).view(-1)[:numel]


def int8_hook(state, bucket):  # no annotations, as ``bf16_hook``
    """A DDP hook with the 8-bit wire's arithmetic, per parameter: each rank's gradient divided by the world size
    and sent as ``int8_bytes`` (an all-gather: 8-bit sums overflow), every rank's rows dequantized and summed."""
    world = dist.get_world_size()
    grads = bucket.gradients()
    rows = [int8_bytes(g.reshape(-1) * (1.0 / world)) for g in grads]
    packed = torch.cat(rows)
    gathered = torch.empty(world * packed.numel(), dtype=torch.uint8)
    dist.all_gather_into_tensor(gathered, packed)
    table = gathered.view(world, -1)
    out, at = [], 0
    for g, row in zip(grads, rows):
        out.append(int8_sum(table[:, at:at + row.numel()], g.numel()))
        at += row.numel()
    bucket.buffer().copy_(torch.cat(out))
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


#: the DDP communication hook that sends each wire dtype (the arithmetic a narrowed plan item must match)
HOOKS = {"float16": default_hooks.fp16_compress_hook, "bfloat16": bf16_hook, "int8": int8_hook}


def register_hook_by_name(rank: int, world_size: int, wire_dtype: str) -> str:
    """Register DDP's own compression hook for ``wire_dtype`` on a gloo DDP model and run one backward: ``"ok"`` or
    the error's type and message."""
    torch.manual_seed(0)
    ddp = DistributedDataParallel(torch.nn.Linear(4, 3))
    hook = {"float16": default_hooks.fp16_compress_hook, "bfloat16": default_hooks.bf16_compress_hook}[wire_dtype]
    try:
        ddp.register_comm_hook(None, hook)
        ddp(torch.randn(2, 4)).sum().backward()
    except Exception as exc:  # noqa: BLE001 - the test reads the type and message
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def plain_all_reduce(rank: int, world_size: int, wire_dtype: str) -> dict:
    """``dist.all_reduce`` of a ``wire_dtype`` tensor on gloo: its dtype and values after the sum."""
    dtype = getattr(torch, wire_dtype)
    tensor = torch.tensor([1.0 + rank, 0.1, 1000.0], dtype=dtype)
    dist.all_reduce(tensor)
    return {"dtype": str(tensor.dtype), "values": tensor.tolist(),
            "expected": (torch.tensor([1.0, 0.1, 1000.0], dtype=dtype) + torch.tensor([2.0, 0.1, 1000.0], dtype=dtype)).tolist()}


def _steps(rank: int, steps: int, make_batch, loss_fn, sides, step) -> list[dict]:
    """``steps`` steps of each DDP side and of the deft ``step`` on the rank's batches and Dropout seeds (those of
    ``workers.compare_with_ddp``); per step, deft against the first side and each further side against the first."""
    data = torch.Generator().manual_seed(1234 + rank)
    deft_model, deft_optimizer = step.model, step.optimizer
    report = []
    for t in range(steps):
        inputs, targets = make_batch(data)
        losses = []
        for model, module, optimizer in sides:
            torch.manual_seed(100 * rank + t)  # each rank its own Dropout stream, as in DDP
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(module(inputs), targets)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        torch.manual_seed(100 * rank + t)
        deft_loss = step(inputs, targets).item()
        reference = _named_state(sides[0][0], sides[0][2])
        entry = _compare(_named_state(deft_model, deft_optimizer), reference)
        entry.update(step=t, loss_diff=abs(deft_loss - losses[0]),
                     sides=[_compare(_named_state(model, optimizer), reference) for model, _, optimizer in sides[1:]])
        report.append(entry)
    return report


def wire_beside_ddp(rank: int, world_size: int, case: str, steps: int, wire_dtype: str,
                    compiler: str | None = None) -> dict:
    """``wfbp`` with every bucket sent as ``wire_dtype`` (``plan_options={"wire_dtype": ...}``) beside DDP with the
    compression hook of that dtype, and a plain DDP (no hook) as the second side, so the test sees that the wire
    changed the numbers. With ``compiler="inductor"`` a third side, DDP with the hook around ``torch.compile(model)``,
    gives the yardstick of Inductor's own difference from eager (tests/bounds.py). Per step the comparisons
    (``workers._compare``), the plan's wire dtypes, the step graph's code and the compiler that ran it."""
    make_model, make_optimizer, make_batch, loss_fn, ddp_kwargs, _exact = WIRE_CASES[case]
    torch.manual_seed(0)
    base = make_model()
    ddp_model, plain_model, deft_model = (copy.deepcopy(base) for _ in range(3))
    ddp = DistributedDataParallel(ddp_model, **ddp_kwargs)
    ddp.register_comm_hook(None, HOOKS[wire_dtype])
    sides = [(ddp_model, ddp, make_optimizer(ddp_model)),
             (plain_model, DistributedDataParallel(plain_model, **ddp_kwargs), make_optimizer(plain_model))]
    if compiler == "inductor":
        import torch._inductor.config as inductor_config

        inductor_config.fallback_random = True  # Dropout from ATen's generator, as deft's lowering draws it
        compiled_model = copy.deepcopy(base)
        compiled = DistributedDataParallel(torch.compile(compiled_model), **ddp_kwargs)
        compiled.register_comm_hook(None, HOOKS[wire_dtype])
        sides.append((compiled_model, compiled, make_optimizer(compiled_model)))
    config = DeftConfig(plan_options={"wire_dtype": wire_dtype}, **BUCKETS, wire_dtypes=WIRE_DTYPES,
                        **({"compiler": compiler} if compiler else {}))
    step = deft_compile(deft_model, make_optimizer(deft_model), loss_fn, policy="wfbp", config=config)
    report = _steps(rank, steps, make_batch, loss_fn, sides, step)
    return {"steps": report, "wire": sorted({item.wire_dtype for item in step.plan.items}),
            "items": len(step.plan.items), "compiler": step.compiler, "code": step.graph.graph_module.code,
            "table": step.plan.table(step.profile)}


def priority_wire_beside_ddp(rank: int, world_size: int, case: str, steps: int, policy: str, wire_dtype: str) -> dict:
    """ByteScheduler's or US-Byte's plan with every item sent as ``wire_dtype`` (a synthetic profile, so the plan
    partitions, reorders and moves updates into the next forward, whose pending all-reduces cross the call) beside
    DDP with the compression hook; parameters whose update is deferred compared with DDP's previous step, and all
    with DDP's last after ``flush()`` (``workers.compare_policy_with_ddp``'s comparison)."""
    make_optimizer, make_batch, loss_fn, base, ddp_model, ddp, ddp_optimizer, deft_model, deft_optimizer = _ddp_pair(case)
    ddp.register_comm_hook(None, HOOKS[wire_dtype])
    data = torch.Generator().manual_seed(1234 + rank)
    batches = [make_batch(data) for _ in range(steps)]
    scratch = copy.deepcopy(base)
    profile = synthetic_profile(scratch, make_optimizer(scratch), loss_fn, batches[0], world_size)
    step = deft_compile(deft_model, deft_optimizer, loss_fn, policy=policy, profile=profile,
                        config=DeftConfig(plan_options={**POLICY_OPTIONS[policy], "wire_dtype": wire_dtype},
                                          wire_dtypes=WIRE_DTYPES))
    report, carried = [], set()
    for t, (inputs, targets) in enumerate(batches):
        entry, deferred = _step_beside_ddp(step, rank, t, inputs, targets, loss_fn, ddp, ddp_model, ddp_optimizer,
                                           deft_model, deft_optimizer)
        entry.update(step=t, deferred=len(deferred))
        report.append(entry)
        carried |= {str(value.dtype) for key, value in step.carry.items() if key.startswith("pending:")}
    step.flush()
    final = _compare(_named_state(deft_model, deft_optimizer), _named_state(ddp_model, ddp_optimizer))
    return {"steps": report, "final": final, "wire": sorted({item.wire_dtype for item in step.plan.items}),
            "pending_dtypes": sorted(carried), "pending_after_flush": step.pending}


def delayed_wire_run(rank: int, world_size: int, case: str, steps: int, wire_dtype: str,
                     accumulation_steps: int = 1, delayed_update: str = "auto") -> dict:
    """``deft`` with delayed buckets (a synthetic profile whose link is slow) and every item sent as ``wire_dtype``,
    ``accumulation_steps`` micro-batches per update, ``DeftConfig.delayed_update``'s semantics: the dtypes of the carried pending tensors, whether the
    parameters are finite, and their sums after ``flush()`` (equal on every rank when every rank applied the same
    averages)."""
    model, optimizer, loss_fn, batches, profile = case_setup(case, rank, world_size, steps)
    step = deft_compile(model, optimizer, loss_fn, policy="deft", profile=profile,
                        config=DeftConfig(plan_options={**POLICY_OPTIONS["deft"], "wire_dtype": wire_dtype},
                                          wire_dtypes=WIRE_DTYPES,
                                          accumulation_steps=accumulation_steps, delayed_update=delayed_update))
    carried = set()
    for t, (inputs, targets) in enumerate(batches):
        torch.manual_seed(100 * rank + t)
        step(inputs, targets)
        carried |= {str(value.dtype) for key, value in step.carry.items() if key.startswith("pending:")}
    step.flush()
    params = [p.detach() for p in model.parameters()]
    return {"delayed": sum(1 for item in step.plan.items if item.delay), "pending_dtypes": sorted(carried),
            "wire": sorted({item.wire_dtype for item in step.plan.items}),
            "finite": all(bool(torch.isfinite(p).all()) for p in params),
            "sums": [float(p.double().sum()) for p in params], "pending_after_flush": step.pending}


def deft_chooses_wire(rank: int, world_size: int, case: str, steps: int, config: dict | None = None,
                      gradient_scale: float = 1.0, fp16_hook: bool = False) -> dict:
    """``policy="deft"`` on ``case``'s model with ``DeftConfig(**config)``, profiled by the step itself (the aten
    route unless ``config`` says otherwise), beside DDP (with ``fp16_compress_hook`` if ``fp16_hook``) on the same
    batches: the measured wire prices, the last plan's wire dtypes, its table, and per step the
    comparison with DDP (``workers._compare``). ``gradient_scale`` multiplies the loss (1e-9 puts the gradients
    below float16's range)."""
    make_optimizer, make_batch, loss_fn, base, ddp_model, ddp, ddp_optimizer, _, _ = _ddp_pair(case)
    if fp16_hook:
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    model = copy.deepcopy(base)
    optimizer = make_optimizer(model)
    scaled = (lambda out, target: loss_fn(out, target) * gradient_scale) if gradient_scale != 1.0 else loss_fn
    step = deft_compile(model, optimizer, scaled, policy="deft", config=DeftConfig(**(config or {})))
    data = torch.Generator().manual_seed(1234 + rank)
    report = []
    for t in range(steps):
        inputs, targets = make_batch(data)
        entry, _ = _step_beside_ddp(step, rank, t, inputs, targets, scaled, ddp, ddp_model, ddp_optimizer, model,
                                    optimizer)
        report.append({**entry, "step": t})
    step.flush()
    return {"prices": step.planning.wire_prices, "wire": [item.wire_dtype for item in step.plan.items],
            "table": step.plan.table(step.profile), "steps": report,
            "wire_seconds": step.planning.wire_seconds, "names": [p.name for p in step.profile.params],
            "overheads": dict(step.overheads), "history": [entry["reason"] for entry in step.plan_history]}
