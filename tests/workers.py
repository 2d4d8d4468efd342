"""Worker functions the distributed tests run in spawned processes (module level so spawn can import them)."""

from __future__ import annotations

import copy
import os
import re
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel

from deft_compile import DeftConfig, deft_compile
from deft_compile.planner.closed_loop import ClosedLoopConfig
from deft_compile.planner.plan import WIRE_DTYPES
from models import CASES


def _max_errors(actual: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    """(max absolute difference, that divided by the largest magnitude of ``expected``)."""
    actual, expected = actual.double(), expected.double()
    absolute = (actual - expected).abs().max().item() if actual.numel() else 0.0
    scale = expected.abs().max().item() if expected.numel() else 0.0
    return absolute, absolute / scale if scale > 0 else absolute


def _named_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    tensors = {f"param:{n}": p.detach() for n, p in model.named_parameters()}
    tensors.update({f"grad:{n}": p.grad for n, p in model.named_parameters() if p.grad is not None})
    tensors.update({f"buffer:{n}": b for n, b in model.named_buffers()})
    names = {p: n for n, p in model.named_parameters()}
    for p, state in optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state:{names[p]}:{key}"] = value
    return tensors



def _ddp_pair(case: str) -> tuple:
    """``reference_and_deft(case)`` with the reference wrapped in torch DDP: (make_optimizer, make_batch, loss_fn,
    base, ddp_model, ddp, ddp_optimizer, deft_model, deft_optimizer)."""
    (make_optimizer, make_batch, loss_fn, base,
     ddp_model, ddp_optimizer, deft_model, deft_optimizer) = reference_and_deft(case)
    ddp = DistributedDataParallel(ddp_model, **CASES[case][4])
    return make_optimizer, make_batch, loss_fn, base, ddp_model, ddp, ddp_optimizer, deft_model, deft_optimizer


def compare_with_ddp(rank: int, world_size: int, case: str, steps: int, dump_dir: str | None = None, policy: str = "wfbp",
                     compiler: str | None = None) -> dict:
    """Train one model with torch DDP and one with deft_compile on the same per-rank data;
    report, per step, the worst difference over parameters, buffers and optimizer state (and which compiler
    ran the step; with ``compiler`` given, the last lowering's generated code and history too)."""
    _, make_batch, loss_fn, _, ddp_model, ddp, ddp_optimizer, deft_model, deft_optimizer = _ddp_pair(case)
    step = deft_compile(
        deft_model,
        deft_optimizer,
        loss_fn,
        policy=policy,
        config=DeftConfig(first_bucket_mb=0.0002, bucket_cap_mb=0.004, **({"compiler": compiler} if compiler else {})),
        dump_dir=f"{dump_dir}/rank{rank}" if dump_dir else None,
    )
    data = torch.Generator().manual_seed(1234 + rank)
    report, compilers = [], []
    for t in range(steps):
        inputs, targets = make_batch(data)
        torch.manual_seed(100 * rank + t)  # each rank its own Dropout stream, as in DDP
        ddp_optimizer.zero_grad(set_to_none=True)
        ddp_loss = loss_fn(ddp(inputs), targets)
        ddp_loss.backward()
        ddp_optimizer.step()
        torch.manual_seed(100 * rank + t)
        deft_loss = step(inputs, targets)
        entry = _compare(_named_state(deft_model, deft_optimizer), _named_state(ddp_model, ddp_optimizer))
        entry.update(step=t, loss_diff=abs(ddp_loss.item() - deft_loss.item()))
        report.append(entry)
        compilers.append(step.compiler)
    result = {
        "steps": report,
        "buckets": len(step.graph.items),
        "traces": step.trace_count,
        "code": step.graph.graph_module.code,
        "compilers": compilers,
    }
    if compiler is not None and step.lowering.last is not None:
        result.update(generated_code=step.lowering.last.source_code, lowering_history=step.lowering.history)
        if step.lowering.regions is not None:
            result["program_order"] = step.lowering.program(step.graph.graph_module).event_order()
    return result


def _tiny_step(hidden: int, **config):
    import torch.nn as nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    # wfbp: every step communicates (a deft plan with an update period may skip a step's collectives).
    step = deft_compile(model, optimizer, lambda out, y: ((out - y) ** 2).mean(), policy="wfbp", config=DeftConfig(**config))
    return step


def capture_counts(rank: int, world_size: int) -> list[int]:
    """How many times the step has been traced after each of 3 steps (SGD without momentum: no optimizer
    state, so one graph serves every step)."""
    import deft_compile.step.graph_cache as graph_cache

    calls = []
    original = graph_cache.capture_step

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    graph_cache.capture_step = counting
    try:
        step = _tiny_step(8)
        counts = []
        for _ in range(3):
            step(torch.randn(4, 4), torch.randn(4, 1))
            counts.append(len(calls))
        return counts
    finally:
        graph_cache.capture_step = original


def mismatched_models(rank: int, world_size: int) -> str:
    """Rank 1 builds a wider hidden layer; construction must refuse before any broadcast."""
    try:
        _tiny_step(8 if rank == 0 else 9)
    except Exception as exc:  # noqa: BLE001 - the test inspects the type and message
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def dead_peer(rank: int, world_size: int, mode: str, released: str | None = None) -> str:
    """Rank 1 dies (or hangs) after one step; rank 0's next step must fail and name rank 1. Hanging, rank 1 answers
    nothing until rank 0 has its error and creates the file ``released`` (12 s at most; without ``released``, 12 s)."""
    import os
    import time

    step = _tiny_step(8, peer_check_timeout_s=2.0)
    batch = (torch.randn(4, 4), torch.randn(4, 1))
    step(*batch)
    if rank == 1:
        if mode == "dies":
            os._exit(3)
        deadline = time.monotonic() + 12
        while time.monotonic() < deadline and not (released is not None and os.path.exists(released)):
            time.sleep(0.05)
        return "slept"
    try:
        step(*batch)
    except Exception as exc:  # noqa: BLE001 - the test inspects the type and message
        return f"{type(exc).__name__}: {exc}"
    finally:
        if released is not None:
            Path(released).touch()
    return "no error"


def compare_with_eager(case: str, steps: int, batches=None, optimizer_override=None) -> list[dict]:
    """World size 1: the compiled step against plain eager training, per step."""
    make_model, make_optimizer, make_batch, loss_fn, _ddp_kwargs, _exact = CASES[case]
    make_optimizer = optimizer_override or make_optimizer
    torch.manual_seed(0)
    base = make_model()
    eager_model, deft_model = copy.deepcopy(base), copy.deepcopy(base)
    eager_optimizer, deft_optimizer = make_optimizer(eager_model), make_optimizer(deft_model)
    step = deft_compile(deft_model, deft_optimizer, loss_fn)
    data = torch.Generator().manual_seed(7)
    report = []
    for t in range(steps):
        inputs, targets = batches[t] if batches is not None else make_batch(data)
        torch.manual_seed(t)
        eager_optimizer.zero_grad(set_to_none=True)
        eager_loss = loss_fn(eager_model(inputs), targets)
        eager_loss.backward()
        eager_optimizer.step()
        torch.manual_seed(t)
        deft_loss = step(inputs, targets)
        entry = _compare(_named_state(deft_model, deft_optimizer), _named_state(eager_model, eager_optimizer))
        report.append(
            {"max_abs": entry["max_abs"], "max_rel": entry["max_rel"], "same_keys": not entry["missing"],
             "loss_diff": abs(eager_loss.item() - deft_loss.item()), "traces": step.trace_count}
        )
    return report


def _profile_cache_file(model, optimizer, loss_fn, batch, keyword: bool = False):
    """Where ``synthetic_profile`` and ``delaying_profile`` keep the measured-free profile of this model's step for the rest of the session
    (``DEFT_TEST_PROFILE_CACHE``, a folder tests/conftest.py makes per run; None without it): the file is named by
    everything the capture's sizes and order depend on (the module tree, each parameter's and buffer's name, shape,
    dtype and whether it trains, the modes, the optimizer's and loss's types, the batch's shapes and dtypes), so
    the launches of one case capture it once instead of once per rank and test."""
    import hashlib

    folder = os.environ.get("DEFT_TEST_PROFILE_CACHE")
    if not folder:
        return None
    from torch.utils._pytree import tree_leaves

    tensors = [t for t in tree_leaves(batch) if isinstance(t, torch.Tensor)]
    key = repr((
        [(name, type(module).__qualname__, module.training) for name, module in model.named_modules()],
        [(n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in model.named_parameters()],
        [(n, tuple(b.shape), str(b.dtype)) for n, b in model.named_buffers()],
        type(optimizer).__qualname__, getattr(loss_fn, "__qualname__", repr(loss_fn)),
        [(tuple(t.shape), str(t.dtype)) for t in tensors], keyword,
    ))
    return Path(folder) / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"


def _sizes_profile(model, optimizer, loss_fn, batch, keyword: bool = False):
    """``profile_model(..., measure=False)`` of this step, read from the session's cache where a launch of the same
    model captured it already (``_profile_cache_file``), else captured and written there. ``keyword``: ``batch`` is a
    dict of the model's keyword inputs (no loss_fn: the model returns its loss)."""
    from deft_compile.planner.plan import Profile
    from deft_compile.step.profiler import profile_model

    cached = _profile_cache_file(model, optimizer, loss_fn, batch, keyword)
    if cached is not None and cached.exists():
        return Profile.from_json(cached.read_text())
    profile = (profile_model(model, optimizer, loss_fn, (), batch, measure=False) if keyword else
               profile_model(model, optimizer, loss_fn, batch, measure=False))
    if cached is not None:  # written whole, then renamed: a concurrent reader sees all of it or nothing
        partial = cached.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(profile.to_json())
        partial.replace(cached)
    return profile


def synthetic_profile(model, optimizer, loss_fn, batch, world_size: int = 2, comm_over_compute: float = 0.9,
                      links: int = 1):
    """A deterministic profile of ``model`` (same on every rank): compute grows with size and
    the link's all-reduce time totals ``comm_over_compute`` times the compute, so the solvers
    partition, reorder and delay as they would on a slow network."""
    import dataclasses

    from deft_compile.planner.plan import LinkCost

    profile = _sizes_profile(model, optimizer, loss_fn, batch)
    params = [
        dataclasses.replace(p, forward_ms=0.2 + p.numel * 1e-4, backward_ms=0.4 + p.numel * 2e-4, update_ms=0.01)
        for p in profile.params
    ]
    compute = sum(p.forward_ms + p.backward_ms for p in params)
    beta = comm_over_compute * compute / sum(p.nbytes for p in params)
    # A second link at half the bandwidth, like DESIGN.md's 1 Gbit/s + 500 Mbit/s pair.
    costs = [LinkCost("synthetic", 0.05, beta), LinkCost("synthetic-2", 0.05, 2 * beta)][:links]
    return dataclasses.replace(profile, params=params, links=costs, world_size=world_size)


POLICY_OPTIONS = {
    "bytescheduler": {},
    "usbyte": {},
    "deft": {"first_bucket_bytes": 1000, "bucket_cap_bytes": 4000, "allow_period": False},
    "deft-period": {"first_bucket_bytes": 1000, "bucket_cap_bytes": 4000},
    "deft-sync": {"first_bucket_bytes": 1000, "bucket_cap_bytes": 4000, "max_staleness": 0},
    "deft-int8": {"first_bucket_bytes": 1000, "bucket_cap_bytes": 4000, "allow_period": False, "wire_dtype": "int8"},
}


def _snapshot(model, optimizer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in _named_state(model, optimizer).items()}


def _owner(name: str) -> str:
    """The parameter a named tensor belongs to (``param:x``, ``grad:x``, ``state:x:key``)."""
    kind, rest = name.split(":", 1)
    return rest.rsplit(":", 1)[0] if kind == "state" else rest


def _compare(actual: dict, expected: dict) -> dict:
    missing = sorted(set(expected) ^ set(actual))
    worst_abs, worst_rel, worst_name = 0.0, 0.0, ""
    for name in expected.keys() & actual.keys():
        absolute, relative = _max_errors(actual[name], expected[name])
        if relative > worst_rel or (relative == worst_rel and absolute > worst_abs):
            worst_abs, worst_rel, worst_name = absolute, relative, name
    return {"max_abs": worst_abs, "max_rel": worst_rel, "worst": worst_name, "missing": missing,
            "compared": len(expected.keys() & actual.keys())}


def _pending_param_names(step) -> set[str]:
    pending = set(step.pending)
    return {step.profile.params[s.param].name for item in step.plan.items if item.id in pending for s in item.slices}


def _graph_collectives(step) -> list[str]:
    import re

    code = step.graph.graph_module.code
    # In-place variants (``all_reduce_``, ``broadcast_``) count as their collective.
    return [name.rstrip("_") for name in re.findall(r"_c10d_functional\.(all_reduce_?|wait_tensor|broadcast_?)\.default\(", code)]


def _collective_groups(step) -> dict[str, list[str]]:
    """The process groups the step graph's all-reduces and broadcasts run on (matched by op overload)."""
    c10d = torch.ops._c10d_functional
    kinds = {c10d.all_reduce.default: "all_reduce", c10d.all_reduce_.default: "all_reduce",
             c10d.broadcast.default: "broadcast", c10d.broadcast_.default: "broadcast"}
    groups: dict[str, set[str]] = {"all_reduce": set(), "broadcast": set()}
    for node in step.graph.graph_module.graph.nodes:
        if node.op == "call_function" and node.target in kinds:
            groups[kinds[node.target]].add(node.args[2])
    return {kind: sorted(names) for kind, names in groups.items()}


def _step_beside_ddp(step, rank: int, t: int, inputs, targets, loss_fn, ddp, ddp_model, ddp_optimizer, deft_model,
                     deft_optimizer, *, max_grad_norm: float | None = None, deferred_grads: bool = True):
    """One DDP step and one ``step`` call on the same batch and dropout seed; the comparison entry and the
    parameters whose update the plan deferred to the next forward (compared with DDP's previous step).
    ``deferred_grads=False`` leaves those parameters' ``.grad`` out of the comparison."""
    before = _snapshot(ddp_model, ddp_optimizer)
    torch.manual_seed(100 * rank + t)
    ddp_optimizer.zero_grad(set_to_none=True)
    loss_fn(ddp(inputs), targets).backward()
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), max_grad_norm)
    ddp_optimizer.step()
    after = _named_state(ddp_model, ddp_optimizer)
    torch.manual_seed(100 * rank + t)
    step(inputs, targets)
    deferred = _pending_param_names(step)
    return _compare_deferred(_named_state(deft_model, deft_optimizer), before, after, deferred, deferred_grads), deferred


def _compare_deferred(state: dict, before: dict, after: dict, deferred: set[str], deferred_grads: bool = True) -> dict:
    """``state`` against ``after``, except the tensors of ``deferred`` parameters (whose update waits for the next
    forward), against ``before``; ``deferred_grads=False`` leaves those parameters' ``.grad`` out."""
    expected = {k: (before if _owner(k) in deferred else after)[k] for k in after.keys() | before.keys()
                if k in (before if _owner(k) in deferred else after)}
    if not deferred_grads:
        kept = lambda k: not (k.startswith("grad:") and _owner(k) in deferred)  # noqa: E731
        expected = {k: v for k, v in expected.items() if kept(k)}
        state = {k: v for k, v in state.items() if kept(k)}
    return _compare(state, expected)


def _policy_beside_ddp(rank: int, world_size: int, case: str, steps: int, policy: str, **config) -> tuple:
    """``case``'s DDP pair, its batches, and ``policy``'s step (``deft-sync``: deft's solver with no delay or period)
    on a synthetic profile: ``(loss_fn, ddp_model, ddp, ddp_optimizer, deft_model, deft_optimizer, batches, step)``."""
    make_optimizer, make_batch, loss_fn, base, ddp_model, ddp, ddp_optimizer, deft_model, deft_optimizer = _ddp_pair(case)
    data = torch.Generator().manual_seed(1234 + rank)
    batches = [make_batch(data) for _ in range(steps)]
    scratch = copy.deepcopy(base)
    profile = synthetic_profile(scratch, make_optimizer(scratch), loss_fn, batches[0], world_size)
    solver_policy = "deft" if policy == "deft-sync" else policy
    step = deft_compile(deft_model, deft_optimizer, loss_fn, policy=solver_policy, profile=profile,
                        config=DeftConfig(plan_options=POLICY_OPTIONS[policy], **config))
    return loss_fn, ddp_model, ddp, ddp_optimizer, deft_model, deft_optimizer, batches, step


def compare_policy_with_ddp(rank: int, world_size: int, case: str, steps: int, policy: str,
                            max_grad_norm: float | None = None) -> dict:
    """A timing-only policy must give DDP's numbers. Parameters whose update the plan defers to
    the next step's forward are compared with DDP's previous step; after ``flush`` all with DDP's last.
    With ``max_grad_norm`` both clip (DDP with ``clip_grad_norm_`` before ``optimizer.step()``)."""
    loss_fn, ddp_model, ddp, ddp_optimizer, deft_model, deft_optimizer, batches, step = _policy_beside_ddp(
        rank, world_size, case, steps, policy, max_grad_norm=max_grad_norm)
    report = []
    for t, (inputs, targets) in enumerate(batches):
        entry, deferred = _step_beside_ddp(step, rank, t, inputs, targets, loss_fn, ddp, ddp_model, ddp_optimizer,
                                           deft_model, deft_optimizer, max_grad_norm=max_grad_norm)
        entry.update(step=t, deferred=len(deferred), collectives=_graph_collectives(step))
        report.append(entry)
    groups = _collective_groups(step)  # the steady-state graph's, before the flush graph replaces it
    step.flush()
    final = _compare(_named_state(deft_model, deft_optimizer), _named_state(ddp_model, ddp_optimizer))
    return {"steps": report, "final": final, "items": len(step.plan.items), "pending_after_flush": step.pending,
            "plan_hash": step.plan.hash(), "traces": step.trace_count, "groups": groups,
            "has_buffers": any(b.numel() for b in deft_model.buffers())}


def policy_with_lr_schedule_beside_ddp(rank: int, world_size: int, case: str, steps: int, policy: str,
                                       flush_after: tuple[int, ...] = (), compiler: str | None = None) -> dict:
    """``compare_policy_with_ddp`` with a learning rate that changes every step (a ``LambdaLR`` warm-up, stepped
    after every step on both sides, as training loops do) and ``flush()`` after the steps in ``flush_after``,
    training on after each. A plan that moves step t's update into call t+1 (or into a flush) must still apply
    it at step t's learning rate, as DDP does. ``compiler``: the step's (default: the suite's)."""
    from torch.optim.lr_scheduler import LambdaLR

    loss_fn, ddp_model, ddp, ddp_optimizer, deft_model, deft_optimizer, batches, step = _policy_beside_ddp(
        rank, world_size, case, steps, policy, **({"compiler": compiler} if compiler else {}))
    factor = lambda t: (t + 1) / steps  # noqa: E731  a different rate at every step
    schedulers = [LambdaLR(ddp_optimizer, factor), LambdaLR(deft_optimizer, factor)]
    report = []
    for t, (inputs, targets) in enumerate(batches):
        # the first call after a flush applies nothing, so its deferred parameters hold no ``.grad``
        entry, deferred = _step_beside_ddp(step, rank, t, inputs, targets, loss_fn, ddp, ddp_model, ddp_optimizer,
                                           deft_model, deft_optimizer, deferred_grads=t - 1 not in flush_after)
        for scheduler in schedulers:
            scheduler.step()
        entry.update(step=t, deferred=len(deferred))
        report.append(entry)
        if t in flush_after:
            step.flush()
            flushed = _compare(_named_state(deft_model, deft_optimizer), _named_state(ddp_model, ddp_optimizer))
            report.append({**flushed, "step": t, "flushed": True, "deferred": 0})
    step.flush()
    final = _compare(_named_state(deft_model, deft_optimizer), _named_state(ddp_model, ddp_optimizer))
    return {"steps": report, "final": final, "pending_after_flush": step.pending,
            "rates": [group["lr"] for group in deft_optimizer.param_groups]}


def synchronous_deft_beside_ddp(rank: int, world_size: int, steps: int, closed_loop: bool,
                                switches: dict[int, str] | None = None, flush_after: tuple[int, ...] = ()) -> dict:
    """``deft`` whose every plan is synchronous, beside torch DDP on the same batches, under AdamW with two param
    groups and a learning rate that changes every step: what must not change training does run. The Preserver
    measures staleness (its synchronous start, on a profile whose unpriced plan delays, with a price that keeps
    every delay out); with ``closed_loop`` the closed loop trials ByteScheduler's and US-Byte's plans and duels;
    ``switches`` forces ``switch_plan`` to a policy's plan before the given steps, and ``flush_after`` flushes
    after the given steps. Parameters whose update a plan defers to the next forward are compared with DDP's
    previous step, the rest with DDP's current one."""
    from torch.optim.lr_scheduler import LambdaLR

    from deft_compile.planner.solvers import solve
    from deft_compile.preserver import PreserverConfig

    case = "transformer_tied_adamw_groups"
    make_optimizer, make_batch, loss_fn, base, ddp_model, ddp, ddp_optimizer, deft_model, deft_optimizer = _ddp_pair(case)
    data = torch.Generator().manual_seed(1234 + rank)
    batches = [make_batch(data) for _ in range(steps)]
    scratch = copy.deepcopy(base)
    profile = synthetic_profile(scratch, make_optimizer(scratch), loss_fn, batches[0], world_size)
    loop = ClosedLoopConfig(enabled=closed_loop, warmup_steps=1, measure_steps=2, min_window_ms=0.0, duel_rounds=2,
                            duel_steps=1, duel_max_rounds=2)
    preserver = PreserverConfig(start_synchronous=True, staleness_every=10, staleness_price=1e9, check_every=5)
    step = deft_compile(deft_model, deft_optimizer, loss_fn, policy="deft", profile=profile,
                        config=DeftConfig(plan_options=POLICY_OPTIONS["deft"], preserver=preserver, closed_loop=loop))
    factor = lambda t: 0.2 + 0.8 * (t + 1) / steps  # noqa: E731  a different rate at every step
    schedulers = [LambdaLR(ddp_optimizer, factor), LambdaLR(deft_optimizer, factor)]
    report, delayed, policies = [], 0, set()
    for t, (inputs, targets) in enumerate(batches):
        if t in (switches or {}):
            step.switch_plan({}, f"forced: {switches[t]}", plan=solve(step.profile, switches[t]))
        ran = step.plan
        entry, deferred = _step_beside_ddp(step, rank, t, inputs, targets, loss_fn, ddp, ddp_model, ddp_optimizer,
                                           deft_model, deft_optimizer, deferred_grads=False)
        for plan in (ran or step.plan, step.plan):  # the plan this step ran, and the one a decision after it chose
            policies.add(plan.policy)
            delayed = max(delayed, sum(1 for item in plan.items if item.delay or item.period > 1))
        for scheduler in schedulers:
            scheduler.step()
        entry.update(step=t, deferred=len(deferred))
        report.append(entry)
        if t in flush_after:
            step.flush()
    step.flush()
    final = _compare(_named_state(deft_model, deft_optimizer), _named_state(ddp_model, ddp_optimizer))
    return {"steps": report, "final": final, "stale_items": delayed, "policies": sorted(policies),
            "probes": [s for s, _ in step.preserver.staleness_log],
            "largest_share": [max(shares.values()) for _, shares in step.preserver.staleness_log], "deferred_steps": sum(1 for e in report if e["deferred"]),
            "history": [(h["step"], h["reason"]) for h in step.plan_history], "switches": step.plan_switches}


def _delayed_names(step) -> set[str]:
    return {step.profile.params[s.param].name for item in step.plan.items if item.delay == 1 for s in item.slices}


class PlanReference:
    """Eager training with DeFT's delayed semantics (docs/POLICIES.md) for a given per-parameter schedule,
    written without deft_compile.

    ``schedule`` maps parameter name -> (delay d, period K, offset). A parameter
    accumulates its local gradient and communicates at steps t with
    t % K == offset, averaging over the accumulated count and the world; with
    d = 1 the averaged gradient is applied by the next step's update. A
    parameter with nothing to apply has no gradient, so the optimizer leaves it
    and its state alone. ``flush`` applies what is pending or accumulated.

    ``local=True`` is ``DeftConfig(delayed_update="local")``: a delayed parameter
    (period 1) applies g_t + (ḡ_{t-1} − g_{t-1}) at once (g_0 in its first
    step), and ``flush`` averages it and its optimizer state over the ranks.
    """

    def __init__(self, model, optimizer, loss_fn, schedule: dict[str, tuple[int, int, int]], world_size: int,
                 max_grad_norm: float | None = None, local: bool = False, compensated: bool | str = False) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self.schedule, self.world_size = schedule, world_size
        self.max_grad_norm = max_grad_norm  # clip what each update applies (docs/POLICIES.md)
        self.last_norm: torch.Tensor | None = None
        self.pending: dict[str, torch.Tensor] = {}
        self.accumulated: dict[str, tuple[torch.Tensor, int]] = {}
        self.local = local
        self.local_pending: dict[str, torch.Tensor] = {}  # g_{t-1} / W, all-reduced in the next step
        # delayed_update="compensated": CompensatedUpdate for the delayed parameters ("predict-only" / "nesterov-only":
        # one half of it, for experiments)
        self.compensated = compensated
        self._halves = {"predict": compensated != "nesterov-only", "nesterov": compensated != "predict-only"}
        self.t = 0

    def _average(self, total: torch.Tensor, count: int) -> torch.Tensor:
        averaged = total * (1.0 / (count * self.world_size))
        self.dist.all_reduce(averaged)
        return averaged

    def _compensated_names(self) -> set[str]:
        return {name for name, (delay, _period, _) in self.schedule.items() if delay} if self.compensated else set()

    def step(self, inputs, targets) -> None:
        for buffer in self.model.buffers():
            self.dist.broadcast(buffer, src=0)
        self.optimizer.zero_grad(set_to_none=True)
        compensated = CompensatedUpdate(self.optimizer, self.model, self._compensated_names(), **self._halves)
        with compensated.predicted_weights():  # forward and backward at ŵ (compensated only)
            self.loss_fn(self.model(inputs), targets).backward()
        for name, p in self.model.named_parameters():
            if p.grad is None:
                continue
            delay, period, offset = self.schedule.get(name, (0, 1, 0))
            if self.local and delay and period == 1:
                previous_scaled = self.local_pending.pop(name, None)
                apply = p.grad
                if previous_scaled is not None:
                    previous = previous_scaled * float(self.world_size)
                    self.dist.all_reduce(previous_scaled)
                    apply = p.grad + (previous_scaled - previous)
                self.local_pending[name] = p.grad * (1.0 / self.world_size)
                p.grad = apply
                continue
            apply = self.pending.pop(name, None)
            total, count = self.accumulated.pop(name, (None, 0))
            total = p.grad if total is None else total + p.grad
            count += 1
            if period == 1 or self.t % period == offset:
                averaged = self._average(total, count)
                if delay:
                    self.pending[name] = averaged
                else:
                    apply = averaged
            else:
                self.accumulated[name] = (total, count)
            p.grad = apply
        self._clip()
        compensated.step()
        self.t += 1

    def _clip(self) -> None:
        applied = [p for p in self.model.parameters() if p.grad is not None]
        if self.max_grad_norm is not None and applied:
            self.last_norm = torch.nn.utils.clip_grad_norm_(applied, self.max_grad_norm)

    def flush(self) -> None:
        for name, p in self.model.named_parameters():
            if self.local_pending.pop(name, None) is not None:  # replicas averaged, with their optimizer state
                tensors = [p.data] + [v for k, v in self.optimizer.state[p].items()
                                      if k != "step" and torch.is_tensor(v) and v.is_floating_point()]
                for tensor in tensors:
                    self.dist.all_reduce(tensor)
                    tensor.div_(self.world_size)
                p.grad = None
                continue
            p.grad = self.pending.pop(name, None)
            if name in self.accumulated:
                total, count = self.accumulated.pop(name)
                p.grad = self._average(total, count)
        self._clip()
        CompensatedUpdate(self.optimizer, self.model, self._compensated_names(), **self._halves).step()


class CompensatedUpdate:
    """The compensated semantics of the named parameters, written without deft_compile: their forward and backward
    at the predicted weights ŵ (SGD: w − lr·v; Adam, AdamW: w − lr·m̂/(√v̂ + ε) from the current state; w where there
    is no state yet), and their update in Nesterov form (SGD: w −= lr·(g + β v'); Adam, AdamW: the update divides
    β1 m' + (1 − β1) g). The optimizer updates every other parameter as usual."""

    def __init__(self, optimizer, model, names: set[str], *, predict: bool = True, nesterov: bool = True) -> None:
        self.optimizer, self.names = optimizer, names
        self.predict, self.nesterov = predict, nesterov  # each half alone: experiments (compensated_eager.py)
        self.params = {p: n for n, p in model.named_parameters() if n in names}
        self.group = {p: g for g in optimizer.param_groups for p in g["params"]}

    def _direction(self, p) -> torch.Tensor | None:
        state, group = self.optimizer.state.get(p, {}), self.group[p]
        if isinstance(self.optimizer, torch.optim.SGD):
            return state.get("momentum_buffer")
        if "exp_avg" not in state:
            return None
        step = float(state["step"])
        beta1, beta2 = group["betas"]
        moment = state["exp_avg"] / (1 - beta1 ** step)
        return moment / ((state["exp_avg_sq"] / (1 - beta2 ** step)).sqrt() + group["eps"])

    def predicted_weights(self):
        import contextlib

        @contextlib.contextmanager
        def swapped():
            saved = {}
            with torch.no_grad():
                for p in (self.params if self.predict else ()):
                    direction = self._direction(p)
                    if direction is not None:
                        saved[p] = p.detach().clone()
                        p.sub_(direction * self.group[p]["lr"])
            try:
                yield
            finally:
                with torch.no_grad():
                    for p, weights in saved.items():
                        p.copy_(weights)

        return swapped()

    def step(self) -> None:
        grads = {p: p.grad for p in self.params if p.grad is not None}
        for p in grads:
            p.grad = None
        self.optimizer.step()
        with torch.no_grad():
            for p, g in grads.items():
                (self._sgd if isinstance(self.optimizer, torch.optim.SGD) else self._adam)(p, g)
                p.grad = g

    def _sgd(self, p, g) -> None:
        group, state = self.group[p], self.optimizer.state[p]
        g = g.add(p, alpha=group["weight_decay"]) if group["weight_decay"] else g
        buf = state.get("momentum_buffer")
        buf = g.clone() if buf is None else buf.mul_(group["momentum"]).add_(g)
        state["momentum_buffer"] = buf
        p.add_(g.add(buf, alpha=group["momentum"]) if self.nesterov else buf, alpha=-group["lr"])

    def _adam(self, p, g) -> None:
        group, state = self.group[p], self.optimizer.state[p]
        beta1, beta2 = group["betas"]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
        if isinstance(self.optimizer, torch.optim.AdamW):
            p.mul_(1 - group["lr"] * group["weight_decay"])
        elif group["weight_decay"]:
            g = g.add(p, alpha=group["weight_decay"])
        state["step"] += 1
        step = float(state["step"])
        state["exp_avg"].lerp_(g, 1 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
        nesterov = state["exp_avg"].lerp(g, 1 - beta1) if self.nesterov else state["exp_avg"]
        denom = (state["exp_avg_sq"].sqrt() / (1 - beta2 ** step) ** 0.5).add_(group["eps"])
        p.addcdiv_(nesterov, denom, value=-group["lr"] / (1 - beta1 ** step))


def _lockstep_with_reference(step, deft, ref, loss_fn, batches, rank: int, world_size: int):
    """Run deft and the eager PlanReference of its plan side by side (same data, same RNG per step);
    returns the per-step comparison and the reference."""
    (deft_model, deft_optimizer), (ref_model, ref_optimizer) = deft, ref
    reference = None
    report = []
    for t, (inputs, targets) in enumerate(batches):
        torch.manual_seed(100 * rank + t)
        step(inputs, targets)
        if reference is None:  # the plan exists once the first step ran
            reference = PlanReference(ref_model, ref_optimizer, loss_fn, plan_schedule_by_name(step), world_size,
                                      local=step.config.delayed_update == "local",
                                      compensated=step.config.delayed_update == "compensated")
        torch.manual_seed(100 * rank + t)
        reference.step(inputs, targets)
        entry = _compare(_named_state(deft_model, deft_optimizer), _named_state(ref_model, ref_optimizer))
        entry.update(step=t, pending=len(step.pending))
        report.append(entry)
    return report, reference


def check_entry(entry: dict, exact: bool, where: str, tolerance: float = 1e-6) -> None:
    """Assert a comparison entry: same tensors on both sides; bit-identical, or within ``tolerance`` relative."""
    assert entry["missing"] == [], f"{where}: tensors on one side only: {entry['missing']}"
    assert entry["compared"] > 0
    if exact:
        assert entry["max_abs"] == 0.0, f"{where}: worst {entry['worst']} {entry['max_abs']}"
    else:
        assert entry["max_rel"] <= tolerance, f"{where}: worst {entry['worst']} {entry['max_rel']}"


def plan_schedule_by_name(step) -> dict[str, tuple[int, int, int]]:
    return {step.profile.params[index].name: value for index, value in step.plan.param_schedule().items()}


def reference_and_deft(case: str):
    """``CASES[case]``'s seeded model twice (a reference copy and a deft copy) with their optimizers:
    ``(make_optimizer, make_batch, loss_fn, base, ref_model, ref_optimizer, deft_model, deft_optimizer)``."""
    make_model, make_optimizer, make_batch, loss_fn, _ddp_kwargs, _exact = CASES[case]
    torch.manual_seed(0)
    base = make_model()
    ref_model, deft_model = copy.deepcopy(base), copy.deepcopy(base)
    return (make_optimizer, make_batch, loss_fn, base, ref_model, make_optimizer(ref_model), deft_model,
            make_optimizer(deft_model))


def reference_case(case: str, rank: int, world_size: int, steps: int, comm_over_compute: float = 0.9,
                   links: int = 1) -> tuple:
    """``reference_and_deft(case)`` with this rank's ``steps`` batches and a synthetic profile of the model:
    ``(loss_fn, ref_model, ref_optimizer, deft_model, deft_optimizer, batches, profile)``."""
    (make_optimizer, make_batch, loss_fn, base,
     ref_model, ref_optimizer, deft_model, deft_optimizer) = reference_and_deft(case)
    data = torch.Generator().manual_seed(1234 + rank)
    batches = [make_batch(data) for _ in range(steps)]
    scratch = copy.deepcopy(base)
    profile = synthetic_profile(scratch, make_optimizer(scratch), loss_fn, batches[0], world_size, comm_over_compute,
                                links=links)
    return loss_fn, ref_model, ref_optimizer, deft_model, deft_optimizer, batches, profile


def compare_deft_with_delayed_reference(
    rank: int, world_size: int, case: str, steps: int, options: str = "deft", comm_over_compute: float = 0.9,
    links: tuple[str, ...] = (), compiler: str | None = None, delayed_update: str = "averaged",
) -> dict:
    loss_fn, ref_model, ref_optimizer, deft_model, deft_optimizer, batches, profile = reference_case(
        case, rank, world_size, steps, comm_over_compute, links=1 + len(links))
    from deft_compile.preserver import PreserverConfig

    # the Preserver's prior prices the updates a period skips and may drop the period at this coverage rate;
    # the update-period test is about what a period does, so it plans without the Preserver
    preserver = PreserverConfig(enabled=options != "deft-period")
    step = deft_compile(deft_model, deft_optimizer, loss_fn, policy="deft", profile=profile,
                        config=DeftConfig(plan_options=POLICY_OPTIONS[options], links=links, preserver=preserver,
                                          delayed_update=delayed_update,
                                          **({"compiler": compiler} if compiler else {})))
    report, reference = _lockstep_with_reference(
        step, (deft_model, deft_optimizer), (ref_model, ref_optimizer), loss_fn, batches, rank, world_size
    )
    steady_collectives = _graph_collectives(step)
    steady_code = step.graph.graph_module.code
    params_before_flush = {n: p.detach().clone() for n, p in deft_model.named_parameters()}
    step.flush()
    reference.flush()
    final = _compare(_named_state(deft_model, deft_optimizer), _named_state(ref_model, ref_optimizer))
    return {"steps": report, "final": final, "delayed": sorted(_delayed_names(step)),
            "periods": sorted({item.period for item in step.plan.items}),
            "links_used": sorted({item.link for item in step.plan.items}),
            "split_params": sorted(p for p, items in step.plan.items_of_param().items() if len({i.link for i in items}) > 1),
            "groups_in_graph": sorted(set(re.findall(r"all_reduce_?\.default\([^,]+, 'sum', '([^']+)'", steady_code))),
            "final_params": {n: p.detach().clone() for n, p in deft_model.named_parameters()},
            "params_before_flush": params_before_flush,
            "all_params": len(list(deft_model.parameters())), "pending_after_flush": step.pending,
            "collectives": steady_collectives, "items": len(step.plan.items),
            "lowering_history": step.lowering.history}


def case_setup(case: str, rank: int, world_size: int, steps: int, *, profiled: bool = True):
    """(model, optimizer, loss_fn, batches, profile) of a ``CASES`` run on ``rank``: weights seeded alike on every
    rank, the rank's own batches, and a synthetic profile of a copy (None unless ``profiled``: the first call
    measures one)."""
    make_model, make_optimizer, make_batch, loss_fn, _ddp_kwargs, _exact = CASES[case]
    torch.manual_seed(0)
    model = make_model()
    optimizer = make_optimizer(model)
    data = torch.Generator().manual_seed(1234 + rank)
    batches = [make_batch(data) for _ in range(steps)]
    scratch = copy.deepcopy(model)
    profile = synthetic_profile(scratch, make_optimizer(scratch), loss_fn, batches[0], world_size) if profiled else None
    return model, optimizer, loss_fn, batches, profile


def checkpoint_run(rank: int, world_size: int, case: str, start: int, stop: int, load: str | None, save: str | None,
                   delayed_update: str = "averaged", options: str = "deft", compiler: str | None = None,
                   save_at: int | None = None) -> dict:
    """Train steps ``[start, stop)`` with deft (``POLICY_OPTIONS[options]``: delays by default), optionally resuming
    from / saving to a checkpoint (at the end, or after step ``save_at`` and training on); ``compiler`` as
    ``DeftConfig``'s (the suite's default when None)."""
    model, optimizer, loss_fn, batches, profile = case_setup(case, rank, world_size, stop)
    step = deft_compile(model, optimizer, loss_fn, policy="deft", profile=profile,
                        config=DeftConfig(plan_options=POLICY_OPTIONS[options], delayed_update=delayed_update,
                                          wire_dtypes=WIRE_DTYPES, **({"compiler": compiler} if compiler else {})))
    if load is not None:
        checkpoint = torch.load(f"{load}.rank{rank}", weights_only=True)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        step.load_state_dict(checkpoint["step"])
    def save_checkpoint() -> int:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step.state_dict()},
                   f"{save}.rank{rank}")
        return len(step.pending)

    pending_before_save = None
    for t in range(start, stop):
        torch.manual_seed(100 * rank + t)
        step(*batches[t])
        if save is not None and save_at == t + 1:
            pending_before_save = save_checkpoint()
    if save is not None and save_at is None:
        pending_before_save = save_checkpoint()
    state = {k: v.clone() for k, v in _named_state(model, optimizer).items()}
    pending = {k: v.clone() for k, v in step.state_dict()["pending"].items()}
    return {"state": state, "pending": pending, "step_count": step.step_count, "pending_before_save": pending_before_save,
            "preserver": step.state_dict()["preserver"], "compiler": step.compiler}


def measured_deft_run(rank: int, world_size: int, case: str, steps: int) -> dict:
    """deft with a profile measured on the first step (no profile given): every rank must end up
    with the same profile and plan, and training must follow the delayed semantics of that plan."""
    (make_optimizer, make_batch, loss_fn, base,
     ref_model, ref_optimizer, deft_model, deft_optimizer) = reference_and_deft(case)
    data = torch.Generator().manual_seed(1234 + rank)
    # The plan under test is the measured one: no closed-loop trials of other plans; a float32 wire, so the reference
    # of its delayed semantics is exact (the 16-bit wire: tests/test_wire_precision.py)
    step = deft_compile(deft_model, deft_optimizer, loss_fn, policy="deft",
                        config=DeftConfig(closed_loop=ClosedLoopConfig(enabled=False), wire_dtypes=("float32",)))
    batches = [make_batch(data) for _ in range(steps)]
    report, _reference = _lockstep_with_reference(
        step, (deft_model, deft_optimizer), (ref_model, ref_optimizer), loss_fn, batches, rank, world_size
    )
    assert all(entry["missing"] == [] for entry in report), report
    worst = max(entry["max_abs"] for entry in report)
    return {"profile": step.profile.to_json(), "plan_hash": step.plan.hash(), "worst_abs": worst,
            "table": step.plan.table(step.profile)}


def delaying_profile(model, optimizer, loss_fn, batch, world_size: int = 2):
    """A profile whose DeFT plan (one bucket per parameter) delays all but the first-ready bucket:
    3 ms forward and 1 ms backward per parameter, 2.5 ms per all-reduce."""
    import dataclasses

    from deft_compile.planner.plan import LinkCost

    profile = _sizes_profile(model, optimizer, loss_fn, batch)
    params = [dataclasses.replace(p, forward_ms=3.0, backward_ms=1.0, update_ms=0.01) for p in profile.params]
    return dataclasses.replace(profile, params=params, links=[LinkCost("slow", 2.5, 0.0)], world_size=world_size)


def _regression_deft(rank: int, world_size: int, lr: float, steps: int, plan_options: dict, preserver,
                     noisy_from: int | None = None):
    """A regression MLP under momentum SGD compiled with deft on ``delaying_profile`` (a plan that delays all but
    one bucket), and its batches: targets from a fixed linear teacher, with noise of std 3 from step
    ``noisy_from`` on. Returns (step, batches)."""
    import torch.nn as nn
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    data = torch.Generator().manual_seed(10 + rank)
    teacher = torch.randn(16, 1, generator=torch.Generator().manual_seed(0))
    batches = []
    for t in range(steps):
        x = torch.randn(64, 16, generator=data)
        noise = 3.0 * torch.randn(64, 1, generator=data) if noisy_from is not None and t >= noisy_from else 0.0
        batches.append((x, x @ teacher + noise))
    scratch = copy.deepcopy(model)
    profile = delaying_profile(scratch, torch.optim.SGD(scratch.parameters(), lr=lr), F.mse_loss, batches[0], world_size)
    config = DeftConfig(plan_options={"first_bucket_bytes": 1, "bucket_cap_bytes": 1, "allow_period": False,
                                      **plan_options}, preserver=preserver)
    return deft_compile(model, optimizer, F.mse_loss, policy="deft", profile=profile, config=config), batches


def preserver_run(rank: int, world_size: int, lr: float, enabled: bool, steps: int, check_every: int = 5,
                  synchronous: bool = False, trade: bool = True) -> dict:
    """Regression MLP, SGD with momentum at a learning rate near the edge of stability, DeFT with a plan that
    delays every bucket: staleness makes it diverge unless the Preserver backs off."""
    from deft_compile.preserver import PreserverConfig

    step, batches = _regression_deft(
        rank, world_size, lr, steps, {"max_staleness": 0} if synchronous else {},
        PreserverConfig(enabled=enabled, check_every=check_every, staleness_every=check_every, trade=trade))
    losses = [float(step(x, y)) for x, y in batches]
    step.flush()
    return {"losses": losses, "history": step.plan_history,
            "events": [str(e) for e in (step.preserver.history if step.preserver else [])],
            "metrics": [e.metrics for e in (step.preserver.history if step.preserver else [])],
            "overheads": step.overheads}


def attribution_run(rank: int, world_size: int, lr: float, steps: int, noisy_from: int | None,
                    synchronous: bool = False, preserver_options: dict | None = None) -> dict:
    """``preserver_run``'s model and delaying plan with the Preserver's loss rules only (no staleness
    measurements): from ``noisy_from`` the targets carry noise, so the loss jumps whatever the schedule (a hard
    stretch of data: the workload's own rise). Returns the losses, the plan history and the Preserver's
    decisions and dismissals."""
    from deft_compile.preserver import PreserverConfig

    step, batches = _regression_deft(rank, world_size, lr, steps, {"max_staleness": 0} if synchronous else {},
                                     PreserverConfig(check_every=5, staleness_every=0, trade=False,
                                                     **(preserver_options or {})), noisy_from)
    losses = [float(step(x, y)) for x, y in batches]
    step.flush()
    return {"losses": losses, "history": step.plan_history,
            "events": [str(e) for e in step.preserver.history],
            "dismissed": [e.reason for e in step.preserver.dismissed], "level": step.preserver.level,
            "delayed_now": sum(1 for item in step.plan.items if item.delay),
            "overheads": step.overheads}


def dumped_deft_run(rank: int, world_size: int, dump_dir: str, steps: int) -> dict:
    """deft with dump_dir on 2 ranks: returns what the runtime wrote and the code that ran."""
    import os

    os.environ["DEFT_DUMP_MEASURE_STEP"] = "2"
    make_model, make_optimizer, make_batch, loss_fn, _ddp_kwargs, _exact = CASES["mlp_dropout_sgd"]
    torch.manual_seed(0)
    model = make_model()
    optimizer = make_optimizer(model)
    data = torch.Generator().manual_seed(rank)
    batches = [make_batch(data) for _ in range(steps)]
    scratch = copy.deepcopy(model)
    profile = synthetic_profile(scratch, make_optimizer(scratch), loss_fn, batches[0], world_size)
    step = deft_compile(model, optimizer, loss_fn, policy="deft", profile=profile,
                        config=DeftConfig(plan_options=POLICY_OPTIONS["deft"]), dump_dir=f"{dump_dir}/rank{rank}")
    for inputs, targets in batches:
        step(inputs, targets)
    return {"plan_hash": step.plan.hash(), "code": step.graph.graph_module.code, "traces": step.trace_count}


def dssync_run(rank: int, world_size: int, steps: int, average: str = "gradients") -> dict:
    """DS-Sync on 4 ranks against an eager reference that averages (gradients, or parameters after a
    local step) within the same groups."""
    import re as _re

    import torch.distributed as dist

    from deft_compile.planner.solvers import dssync_partition

    (make_optimizer, make_batch, loss_fn, base,
     ref_model, ref_optimizer, deft_model, deft_optimizer) = reference_and_deft("mlp_dropout_sgd")
    step = deft_compile(deft_model, deft_optimizer, loss_fn, policy="dssync",
                        config=DeftConfig(plan_options={"group_size": 2, "seed": 7, "average": average}))
    data = torch.Generator().manual_seed(1234 + rank)
    reference_groups: dict[tuple, object] = {}
    report = []
    for t in range(steps):
        inputs, targets = make_batch(data)
        torch.manual_seed(100 * rank + t)
        step(inputs, targets)
        used = set(_re.findall(r"all_reduce_?\.default\([^,]+, 'sum', '([^']+)'", step.graph.graph_module.code))
        members = [dist.get_process_group_ranks(pg) for pg in step.policy_runtime.subgroups.values()
                   if isinstance(pg, dist.ProcessGroup) and pg.group_name in used]
        # Reference: same partition, own groups, gradients averaged within the group.
        partition = dssync_partition(world_size, 2, t, seed=7)
        mine = None
        for group in partition:
            if group not in reference_groups:
                reference_groups[group] = dist.new_group(list(group))
            if rank in group:
                mine = group
        torch.manual_seed(100 * rank + t)
        ref_optimizer.zero_grad(set_to_none=True)
        loss_fn(ref_model(inputs), targets).backward()
        if average == "gradients":
            for p in ref_model.parameters():
                p.grad = p.grad * 0.5
                dist.all_reduce(p.grad, group=reference_groups[mine])
        ref_optimizer.step()
        if average == "parameters":
            with torch.no_grad():
                for tensor in [*ref_model.parameters(), *ref_model.buffers()]:
                    if tensor.is_floating_point():
                        dist.all_reduce(tensor, group=reference_groups[mine])
                        tensor.div_(2)
        group_params = [p.detach().clone() for p in deft_model.parameters()]
        partner = [torch.zeros_like(p) for p in group_params]
        # the other member of my group holds the same parameters after a parameters-averaging step
        for mine_p, other in zip(group_params, partner):
            other.copy_(mine_p)
            dist.all_reduce(other, group=reference_groups[mine])
        same_in_group = all(torch.equal(o, 2 * m) for o, m in zip(partner, group_params))
        diff = max((a - b).abs().max().item() for a, b in zip(deft_model.parameters(), ref_model.parameters()))
        report.append({"step": t, "members": members, "expected": [list(mine)] if average == "gradients" else [],
                       "max_abs": diff, "same_in_group": same_in_group})
    before_flush = [p.detach().clone() for p in deft_model.parameters()]
    step.flush()
    return {"steps": report, "before_flush": before_flush,
            "after_flush": [p.detach().clone() for p in deft_model.parameters()]}


def dlcp_run(rank: int, world_size: int, deadline_ms, max_loss: float, steps: int) -> dict:
    """DLCP: per step, check the drop bound, that the residual plus the applied average conserves every
    rank's gradient exactly, and that all ranks hold the same model; without a deadline compare with DDP."""
    import torch.distributed as dist

    make_model, make_optimizer, make_batch, loss_fn, _ddp_kwargs, _exact = CASES["mlp_dropout_sgd"]
    torch.manual_seed(0)
    base = make_model()
    model, ddp_model = copy.deepcopy(base), copy.deepcopy(base)
    optimizer, ddp_optimizer = make_optimizer(model), make_optimizer(ddp_model)
    ddp = DistributedDataParallel(ddp_model)
    data = torch.Generator().manual_seed(1234 + rank)
    batches = [make_batch(data) for _ in range(steps)]
    scratch = copy.deepcopy(base)
    profile = synthetic_profile(scratch, make_optimizer(scratch), loss_fn, batches[0], world_size, comm_over_compute=2.0)
    step = deft_compile(model, optimizer, loss_fn, policy="dlcp", profile=profile,
                        config=DeftConfig(plan_options={"deadline_ms": deadline_ms, "max_loss": max_loss, "chunk_bytes": 256}))
    names = [p.name for p in profile.params]  # ready order, as the flat buffer
    params = dict(model.named_parameters())
    report = []
    for t, (inputs, targets) in enumerate(batches):
        # This rank's local gradient at the current weights, computed eagerly on a copy with the same RNG.
        probe = copy.deepcopy(model)
        torch.manual_seed(100 * rank + t)
        loss_fn(probe(inputs), targets).backward()
        local = torch.cat([dict(probe.named_parameters())[n].grad.reshape(-1) for n in names])
        previous = step.carry.get("acc:0")
        if previous is not None:
            local = previous + local
        torch.manual_seed(100 * rank + t)
        step(inputs, targets)
        torch.manual_seed(100 * rank + t)
        ddp_optimizer.zero_grad(set_to_none=True)
        loss_fn(ddp(inputs), targets).backward()
        ddp_optimizer.step()
        applied = torch.cat([params[n].grad.reshape(-1) for n in names])
        residual = step.carry.get("acc:0", torch.zeros_like(local))
        conserved = applied * world_size
        total_residual = residual.clone()
        dist.all_reduce(total_residual)
        total_local = local.clone()
        dist.all_reduce(total_local)
        same = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        other = same.clone()
        dist.broadcast(other, src=0)
        stats = step.last_stats.get("stats:0")
        report.append({
            "step": t,
            "stats": stats,
            "conservation_error": (conserved + total_residual - total_local).abs().max().item(),
            "replicas_equal": bool(torch.equal(same, other)),
            "ddp_max_abs": max((a - b).abs().max().item() for a, b in zip(model.parameters(), ddp_model.parameters())),
            "residual_norm": residual.norm().item(),
        })
    had_residual = "acc:0" in step.carry
    nonzero = torch.tensor(float(had_residual and bool(step.carry["acc:0"].count_nonzero())))
    dist.all_reduce(nonzero, op=dist.ReduceOp.MAX)
    before_flush = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    step.flush()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    reference = flat.clone()
    dist.broadcast(reference, src=0)
    return {"steps": report, "budget": step.plan.options["chunk_budget"], "chunks": step.plan.metadata["chunks"],
            "had_residual": had_residual, "carry_after_flush": sorted(step.carry),
            "residual_nonzero_somewhere": bool(nonzero.item()), "flush_moved_weights": not torch.equal(before_flush, flat),
            "replicas_equal_after_flush": bool(torch.equal(flat, reference))}


def _mlp_with_delaying_profile(rank: int, world_size: int, steps: int):
    """The seeded ``mlp_dropout_sgd`` model and optimizer, this rank's ``steps`` batches and a slow-link profile
    whose plan delays buckets: ``(model, optimizer, loss_fn, batches, profile)``."""
    make_model, make_optimizer, make_batch, loss_fn, _ddp_kwargs, _exact = CASES["mlp_dropout_sgd"]
    torch.manual_seed(0)
    model = make_model()
    optimizer = make_optimizer(model)
    data = torch.Generator().manual_seed(1234 + rank)
    batches = [make_batch(data) for _ in range(steps)]
    scratch = copy.deepcopy(model)
    return model, optimizer, loss_fn, batches, delaying_profile(scratch, make_optimizer(scratch), loss_fn, batches[0],
                                                                world_size)


def closed_loop_run(rank: int, world_size: int, slower_ms: float, steps: int, drift_ms_per_step: float = 0.0,
                    duel_rounds: int = 2, priority_ms: float = 0.0, base_ms: float = 0.0,
                    min_window_ms: float = 0.0, duel_max_rounds: int = 0, flip_rounds_ms: float = 0.0,
                    replan_in_synchronous_duel: bool = False, measure_contention: bool = False,
                    step_back_in_duel: bool = False) -> dict:
    """deft with a delaying plan and the closed loop on; ``slower_ms`` is added to the measured step time
    of every plan with delays (as if they ran slower), so the loop must fall back to the synchronous plan.
    ``drift_ms_per_step`` adds a load that grows with every step to every plan (a machine getting busier);
    ``priority_ms`` is added to the priority plans (ByteScheduler's, US-Byte's), ``base_ms`` to every plan (so
    negative offsets still give positive times, whose ratios the duel compares). The Preserver is off: the
    injected times are no model's, and its trades on a profile refined to them would be re-plans of their own.
    ``min_window_ms`` is the loop's (0: windows of exactly ``measure_steps``, as the injected times assume).
    ``duel_max_rounds`` is the loop's (0: a duel never runs past ``duel_rounds``). ``flip_rounds_ms`` is subtracted
    from a plan with delays in a duel's even rounds and added in its odd ones (rounds that disagree).
    ``replan_in_synchronous_duel``: in the second block of a duel between synchronous plans, re-plan to the initial
    plan's options (as the Preserver's trade does through ``switch_plan``). ``step_back_in_duel``: in the first
    synchronous block of a duel of a plan with delays, switch to the synchronous options (as the Preserver does when
    it prices the delays out), which solve to the very plan that block runs. ``measure_contention`` is the loop's:
    off by default here, since the step thread's clocks do not see the injected times, and a refinement that
    measures compute from them while fitting the link to those times re-plans to profiles no model has (a plan
    with update periods, one more trial), which moves the steps the duel tests count on."""
    from deft_compile.preserver import PreserverConfig
    from deft_compile.planner.closed_loop import PRIORITY_POLICIES, SYNCHRONOUS_DUEL, ClosedLoopConfig

    model, optimizer, loss_fn, batches, profile = _mlp_with_delaying_profile(rank, world_size, steps)
    config = DeftConfig(first_bucket_mb=1e-6, bucket_cap_mb=1e-6, preserver=PreserverConfig(enabled=False),
                        closed_loop=ClosedLoopConfig(enabled=True, min_window_ms=min_window_ms, max_window_steps=40,
                                                     warmup_steps=2, measure_steps=3, duel_rounds=duel_rounds,
                                                     duel_steps=1, duel_max_rounds=duel_max_rounds,
                                                     measure_contention=measure_contention))
    step = deft_compile(model, optimizer, loss_fn, policy="deft", profile=profile, config=config)
    loop = step.closed_loop

    def inject(plan) -> float:
        stale = any(item.delay or item.period > 1 for item in plan.items)
        priority = priority_ms if plan.policy in PRIORITY_POLICIES else 0.0
        flip = 0.0
        if stale and loop.state == "duel":
            flip = flip_rounds_ms if (loop.duel.block // 2) % 2 else -flip_rounds_ms
        return base_ms + (slower_ms if stale else 0.0) + priority + flip + drift_ms_per_step * step.step_count

    loop.inject = inject
    initial_delayed, initial_options, replanned_at = None, None, None
    stepped_back = None  # (step, whether the synchronous options solved to the plan the duel's block ran)
    for t in range(steps):
        step(*batches[t])
        if initial_delayed is None:  # the closed loop observes the initial plan first
            initial_delayed = sum(1 for item in step.plan.items if item.delay)
            initial_options = dict(step.plan.options)
        if (replan_in_synchronous_duel and replanned_at is None and loop.state == "duel"
                and loop.duel.why == SYNCHRONOUS_DUEL and loop.duel.block == 1):
            step.switch_plan(initial_options, "test: a re-plan with delays during the duel of synchronous plans")
            replanned_at = step.step_count
        if (step_back_in_duel and stepped_back is None and loop.state == "duel" and loop.duel.why != SYNCHRONOUS_DUEL
                and loop.duel.current is loop.duel.plans[1] and loop.duel.steps > 0):
            running = step.plan.hash()
            step.switch_plan({**initial_options, "max_staleness": 0, "allow_period": False},
                             "test: the Preserver steps back to synchronous")
            stepped_back = (step.step_count, step.plan.hash() == running)
    step.flush()
    return {"initial_delayed": initial_delayed, "final_delayed": sum(1 for item in step.plan.items if item.delay),
            "state": step.closed_loop.state, "plan_hash": step.plan.hash(), "final_policy": step.plan.policy,
            "initial_plan_hash": step.plan_history[0]["plan_hash"], "replanned_at": replanned_at,
            "stepped_back": stepped_back,
            "history": [{k: v for k, v in h.items()} for h in step.plan_history]}


def closed_loop_recheck_run(rank: int, world_size: int, steps: int, flip_at: int | None) -> dict:
    """deft whose plans with delays measure (injected) 400 ms faster than the synchronous plans until step
    ``flip_at`` and 400 ms slower from then on (a host that got busy; None: never), every plan on a 1000 ms base.
    The loop settles on the plan with delays, re-checks it every 6 steps and must duel again once it slowed."""
    from deft_compile.preserver import PreserverConfig
    from deft_compile.planner.closed_loop import ClosedLoopConfig

    model, optimizer, loss_fn, batches, profile = _mlp_with_delaying_profile(rank, world_size, steps)
    config = DeftConfig(first_bucket_mb=1e-6, bucket_cap_mb=1e-6, preserver=PreserverConfig(enabled=False),
                        closed_loop=ClosedLoopConfig(enabled=True, min_window_ms=0.0, warmup_steps=1, measure_steps=2,
                                                     duel_rounds=2, duel_steps=1, priority_candidate=False,
                                                     recheck_every=6, duel_max_rounds=0,
                                                     measure_contention=False))  # injected times: see closed_loop_run
    step = deft_compile(model, optimizer, loss_fn, policy="deft", profile=profile, config=config)

    def inject(plan) -> float:
        stale = any(item.delay or item.period > 1 for item in plan.items)
        slowed = flip_at is not None and step.step_count >= flip_at
        return 1000.0 + ((400.0 if slowed else -400.0) if stale else 0.0)

    step.closed_loop.inject = inject
    for t in range(steps):
        step(*batches[t])
    step.flush()
    return {"final_delayed": sum(1 for item in step.plan.items if item.delay), "state": step.closed_loop.state,
            "history": [{k: v for k, v in h.items()} for h in step.plan_history]}


def closed_loop_priority_run(rank: int, world_size: int, steps: int, replan_at: int) -> dict:
    """deft kept synchronous (``max_staleness=0``, no Preserver) with the closed loop on: it must also measure a
    priority plan (ByteScheduler's or US-Byte's), settle on it when it measures fastest (``inject`` makes it so),
    and run it instead of a synchronous re-plan made at step ``replan_at``. Every step is compared with torch DDP
    (parameters whose update moved to the next forward with DDP's previous step), and after ``flush()`` all."""
    from deft_compile.planner.closed_loop import PRIORITY_POLICIES, ClosedLoopConfig
    from deft_compile.preserver import PreserverConfig

    case = "mlp_dropout_sgd"
    make_optimizer, make_batch, loss_fn, base, ddp_model, ddp, ddp_optimizer, deft_model, deft_optimizer = _ddp_pair(case)
    data = torch.Generator().manual_seed(1234 + rank)
    batches = [make_batch(data) for _ in range(steps)]
    scratch = copy.deepcopy(base)
    profile = synthetic_profile(scratch, make_optimizer(scratch), loss_fn, batches[0], world_size)
    config = DeftConfig(plan_options={"max_staleness": 0}, preserver=PreserverConfig(enabled=False),
                        closed_loop=ClosedLoopConfig(enabled=True, min_window_ms=0.0, warmup_steps=1, measure_steps=2, duel_rounds=2,
                                                     duel_steps=1, duel_max_rounds=0, measure_contention=False))  # injected times: see closed_loop_run
    step = deft_compile(deft_model, deft_optimizer, loss_fn, policy="deft", profile=profile, config=config)
    step.closed_loop.inject = lambda plan: -1000.0 if plan.policy in PRIORITY_POLICIES else 0.0
    report, replanned = [], None
    for t, (inputs, targets) in enumerate(batches):
        if t == replan_at:  # a synchronous re-plan by someone else (as the Preserver makes them): DDP's buckets
            step.switch_plan({"max_staleness": 0}, "test: a synchronous re-plan")
            replanned = step.plan.policy
        # A deferred parameter's .grad is not state: after a plan switch (which flushes) the first step of a
        # per-layer plan has none yet, while DDP's previous step left one. Parameters and optimizer state count.
        entry, _ = _step_beside_ddp(step, rank, t, inputs, targets, loss_fn, ddp, ddp_model, ddp_optimizer,
                                    deft_model, deft_optimizer, deferred_grads=False)
        entry.update(step=t, policy=step.plan.policy, state=step.closed_loop.state)
        report.append(entry)
    step.flush()
    final = _compare(_named_state(deft_model, deft_optimizer), _named_state(ddp_model, ddp_optimizer))
    return {"steps": report, "final": final, "replanned": replanned,
            "reasons": [h["reason"] for h in step.plan_history], "final_policy": step.plan.policy}


def closed_loop_verify_run(rank: int, world_size: int, steps: int) -> dict:
    """deft settles on its delaying plan (measured faster than the synchronous one), then another re-plan (as the
    Preserver makes them, through ``switch_plan``) adopts a different delaying plan that measures 1 s slower: the
    closed loop must measure it and switch to the synchronous plan."""
    from deft_compile.planner.closed_loop import ClosedLoopConfig

    model, optimizer, loss_fn, batches, profile = _mlp_with_delaying_profile(rank, world_size, steps)
    from deft_compile.preserver import PreserverConfig

    config = DeftConfig(first_bucket_mb=1e-6, bucket_cap_mb=1e-6, preserver=PreserverConfig(enabled=False),
                        closed_loop=ClosedLoopConfig(enabled=True, min_window_ms=0.0, warmup_steps=2, measure_steps=3, duel_rounds=2,
                                                     duel_steps=1, duel_max_rounds=0, measure_contention=False))  # injected times: see closed_loop_run
    step = deft_compile(model, optimizer, loss_fn, policy="deft", profile=profile, config=config)
    kept: list[str] = []

    def inject(plan) -> float:
        stale = any(item.delay or item.period > 1 for item in plan.items)
        if not stale:
            return 0.0
        return -1000.0 if plan.hash() in kept or not kept else 1000.0

    step.closed_loop.inject = inject
    replanned = None
    for t in range(steps):
        step(*batches[t])
        if not kept:
            kept.append(step.plan.hash())
        if step.closed_loop.state == "settled" and replanned is None:
            settled_delayed = sum(1 for item in step.plan.items if item.delay)
            step.switch_plan({**step.plan.options, "bucket_cap_bytes": 10 ** 9, "first_bucket_bytes": 10 ** 9},
                             "test: a re-plan after settling")
            replanned = step.plan.hash()
    step.flush()
    return {"settled_delayed": settled_delayed, "replanned": replanned, "kept": kept,
            "replanned_delayed": replanned is not None and replanned not in kept,
            "final_delayed": sum(1 for item in step.plan.items if item.delay), "state": step.closed_loop.state,
            "synchronous_only": step.closed_loop.synchronous_only,
            "reasons": [h["reason"] for h in step.plan_history]}


def compare_gpt2_delayed_with_reference(rank: int, world_size: int, steps: int, delayed_update: str = "averaged") -> dict:
    """The time-to-accuracy benchmark's GPT-2 (``transformers``, tied input/output embeddings, AdamW with betas
    (0.9, 0.95) and weight decay, a LambdaLR warm-up + cosine schedule stepped every step) trained by deft with a
    plan that delays some buckets (the tied embedding among them), beside the eager ``PlanReference`` of that plan: the delayed semantics on
    the model whose delays cost loss in docs/TIME_TO_ACCURACY.md."""
    from torch.optim.lr_scheduler import LambdaLR

    from deft_compile.preserver import PreserverConfig
    import tta  # benchmarks/tta.py

    torch.manual_seed(0)
    base = tta.build_model("tiny")
    ref_model, deft_model = copy.deepcopy(base), copy.deepcopy(base)
    ref_optimizer, deft_optimizer = tta.make_optimizer(ref_model), tta.make_optimizer(deft_model)
    factor = tta.lr_lambda(steps, 4, 0.1)
    schedulers = [LambdaLR(ref_optimizer, factor), LambdaLR(deft_optimizer, factor)]
    data = torch.Generator().manual_seed(1234 + rank)
    batches = [torch.randint(0, tta.VOCAB, (4, tta.context_of("tiny")), generator=data) for _ in range(steps)]
    scratch = copy.deepcopy(base)
    profile = synthetic_profile(scratch, tta.make_optimizer(scratch), None, (batches[0], batches[0]), world_size, 0.9)
    step = deft_compile(deft_model, deft_optimizer, None, policy="deft", profile=profile,
                        config=DeftConfig(plan_options={**POLICY_OPTIONS["deft"], "bucket_cap_bytes": 40000},
                                          preserver=PreserverConfig(enabled=False), delayed_update=delayed_update))
    forward = ref_model.forward
    ref_model.forward = lambda ids: forward(ids, ids)  # PlanReference calls model(inputs), then the loss

    def model_loss(loss, _targets):
        return loss

    width = deft_model.model.config.n_embd

    def compare() -> dict:
        actual, expected = (_split_key_bias(_named_state(m, o), width)
                            for m, o in ((deft_model, deft_optimizer), (ref_model, ref_optimizer)))
        entry = _compare(actual[0], expected[0])
        entry["key_bias"] = _compare(actual[1], expected[1])
        return entry

    reference, report = None, []
    for t, ids in enumerate(batches):
        step(ids, ids)
        if reference is None:
            reference = PlanReference(ref_model, ref_optimizer, model_loss, plan_schedule_by_name(step), world_size,
                                      local=delayed_update == "local")
        reference.step(ids, ids)
        for scheduler in schedulers:
            scheduler.step()
        entry = compare()
        entry.update(step=t, pending=len(step.pending), lr=deft_optimizer.param_groups[0]["lr"])
        report.append(entry)
    step.flush()
    reference.flush()
    final = compare()
    names = [name for name, _ in deft_model.named_parameters()]
    return {"steps": report, "final": final, "delayed": sorted(_delayed_names(step)), "params": names,
            "tied": deft_model.model.lm_head.weight is deft_model.model.transformer.wte.weight}


def _split_key_bias(tensors: dict[str, torch.Tensor], width: int) -> tuple[dict, dict]:
    """(every tensor but the key slices of GPT-2's fused attention bias, those key slices).

    ``c_attn.bias`` is [query | key | value]. The key bias adds q·b to every score of a query alike, which the
    softmax ignores, so its gradient is zero up to round-off, and Adam turns that round-off into steps whose size
    depends on the order of the float sums (about 1e-3 relative to the bias after one step on some CPUs). Those
    slices are compared on their own, in absolute terms; every other number is held to a tight relative bound."""
    rest, keys = {}, {}
    for name, tensor in tensors.items():
        if "attn.c_attn.bias" in name and tensor.numel() == 3 * width:
            query, key, value = tensor.reshape(3, width)
            rest[name + "[query]"], keys[name + "[key]"], rest[name + "[value]"] = query, key, value
        else:
            rest[name] = tensor
    return rest, keys


def synchronous_start_run(rank: int, world_size: int, profile_given: bool, steps: int,
                          start_synchronous: bool | None = None, closed_loop: bool = False) -> dict:
    """deft with the Preserver's trade: ``start_synchronous`` None resolves to on for a measured profile and off
    for a given one; on, the plan stays synchronous until the first trade (step 25) prices the delays."""
    from deft_compile.preserver import PreserverConfig
    from deft_compile.planner.closed_loop import ClosedLoopConfig

    model, optimizer, loss_fn, batches, profile = _mlp_with_delaying_profile(rank, world_size, steps)
    profile = profile if profile_given else None
    # An unreachable tolerance: the profile is never refined from this tiny model's noisy times, so the trades
    # depend on the measured gradients alone (a profile refined between two measurements can make a second,
    # different trade). No priority candidates and no longer duels: whether a
    # duel of synchronous plans runs, or a duel runs on, would follow this tiny model's noise, and with it the
    # steps at which the duel's blocks fall
    step = deft_compile(model, optimizer, loss_fn, policy="deft", profile=profile,
                        config=DeftConfig(first_bucket_mb=1e-6, bucket_cap_mb=1e-6,
                                          preserver=PreserverConfig(start_synchronous=start_synchronous),
                                          closed_loop=ClosedLoopConfig(enabled=closed_loop, min_window_ms=0.0, warmup_steps=2,
                                                                       measure_steps=3, duel_rounds=4, duel_steps=3,
                                                                       tolerance=1e9, duel_max_rounds=0,
                                                                       priority_candidate=False)))
    step(*batches[0])
    resolved = step.preserver.start_synchronous
    for t in range(1, steps):
        step(*batches[t])
    step.flush()
    return {"resolved": resolved, "initial_delayed": step.plan_history[0]["delayed_items"],
            "traded": step.preserver.traded, "history": [h["reason"] for h in step.plan_history],
            "max_delayed": max(h["delayed_items"] for h in step.plan_history)}


def dssync_buffer_groups(rank: int, world_size: int, average: str) -> dict:
    """A DS-Sync step and a ``wfbp`` step on a BatchNorm CNN: which opened a buffer group of its own, and the groups
    the DS-Sync graph's collectives ran on after two steps."""
    (_make_optimizer, make_batch, loss_fn, _base,
     ref_model, ref_optimizer, deft_model, deft_optimizer) = reference_and_deft("cnn_batchnorm_adam")
    dssync = deft_compile(deft_model, deft_optimizer, loss_fn, policy="dssync",
                          config=DeftConfig(plan_options={"group_size": 2, "seed": 7, "average": average}))
    wfbp = deft_compile(ref_model, ref_optimizer, loss_fn, policy="wfbp")
    data = torch.Generator().manual_seed(1234 + rank)
    for _ in range(2):
        inputs, targets = make_batch(data)
        dssync(inputs, targets)
    groups = _collective_groups(dssync)
    step_group = dssync.groups.step_group.name if dssync.groups.step_group is not None else None
    dssync.flush()
    return {"dssync_buffer_group": dssync.groups.buffer_group is not None, "wfbp_buffer_group": wfbp.groups.buffer_group is not None,
            "groups": groups, "step_group": step_group}


def group_thread_cores(rank: int, world_size: int) -> dict:
    """The cores the threads of two newly opened process groups may run on: one from ``dist.new_group``, one
    from ``deft_compile.step.distributed.new_group`` (what the library opens its groups with, in the context the
    launcher's emulation registers); and the calling (compute) thread's."""
    import os

    import torch.distributed as dist

    from deft_compile.step.distributed import new_group

    def threads() -> set[int]:
        return {int(tid) for tid in os.listdir("/proc/self/task")}

    def cores_of_new(open_group) -> list[list[int]]:
        before = threads()
        group = open_group()
        dist.all_reduce(torch.ones(1), group=group)
        return [sorted(os.sched_getaffinity(tid)) for tid in sorted(threads() - before)]

    ranks = list(range(world_size))
    return {"plain": cores_of_new(lambda: dist.new_group(ranks=ranks)),
            "helper": cores_of_new(lambda: new_group(ranks=ranks)),
            "compute": sorted(os.sched_getaffinity(0))}


def control_group_run(rank: int, world_size: int, steps: int) -> dict:
    """deft with the closed loop and the Preserver (a loss window every 2 steps): the groups of every eager
    all-reduce the step makes (recorded by wrapping ``dist.all_reduce``), the step's groups, and whether a small
    all-reduce on the control group returns while large ones are still running on the data-parallel group (on that
    group itself it waits behind them)."""
    import torch.distributed as dist

    from deft_compile.preserver import PreserverConfig
    from deft_compile.planner.closed_loop import ClosedLoopConfig

    model, optimizer, loss_fn, batches, profile = _mlp_with_delaying_profile(rank, world_size, steps)
    config = DeftConfig(first_bucket_mb=1e-6, bucket_cap_mb=1e-6, preserver=PreserverConfig(check_every=2),
                        closed_loop=ClosedLoopConfig(enabled=True, min_window_ms=0.0, warmup_steps=1, measure_steps=2, duel_rounds=1,
                                                     duel_steps=1, duel_max_rounds=0))
    step = deft_compile(model, optimizer, loss_fn, policy="deft", profile=profile, config=config)
    used: list[str] = []
    plain = dist.all_reduce

    def recording(tensor, *args, group=None, **kwargs):
        used.append((group or dist.group.WORLD).group_name)
        return plain(tensor, *args, group=group, **kwargs)

    dist.all_reduce = recording
    try:
        for inputs, targets in batches:
            step(inputs, targets)
    finally:
        dist.all_reduce = plain
    step.flush()

    tensors = [torch.ones(8 * 2 ** 20) for _ in range(6)]

    def large_ones_done_when_a_small_one_returns(group) -> int:
        """Six large all-reduces in flight on the data-parallel group (gloo works a group's queue with two
        threads), then a small one on ``group``: how many large ones had completed when it returned."""
        dist.barrier(group=step.control_group)
        large = [dist.all_reduce(tensor, group=step.process_group, async_op=True) for tensor in tensors]
        dist.all_reduce(torch.ones(1), group=group)
        done = sum(work.is_completed() for work in large)
        for work in large:
            work.wait()
        return done

    return {"used": used, "control": step.control_group.group_name, "data_parallel": step.process_group.group_name,
            "states": step.closed_loop.state,
            "control_waited_for": large_ones_done_when_a_small_one_returns(step.control_group),
            "data_parallel_waited_for": large_ones_done_when_a_small_one_returns(step.process_group)}


def hybrid_vs_reference(rank: int, world_size: int, case: str, steps: int, schedule: str) -> dict:
    """deft with ``synchronous_schedule=schedule``: its delayed buckets follow the delayed semantics and every
    other parameter DDP's, its update moved to the next forward. Compared step by step with ``PlanReference``
    of the plan (a parameter whose update waits for the next forward with the reference's previous step), and
    after ``flush`` everything with the reference's last."""
    from deft_compile.passes.schedule import APPLY_NEXT_FORWARD
    from deft_compile.preserver import PreserverConfig

    loss_fn, ref_model, ref_optimizer, deft_model, deft_optimizer, batches, profile = reference_case(
        case, rank, world_size, steps)
    # the input-side parameter kept synchronous, as the Preserver keeps what staleness harms most
    options = {**POLICY_OPTIONS["deft"], "synchronous_schedule": schedule, "keep_synchronous": [profile.params[-1].name]}
    step = deft_compile(deft_model, deft_optimizer, loss_fn, policy="deft", profile=profile,
                        config=DeftConfig(plan_options=options, preserver=PreserverConfig(enabled=False)))
    reference, report = None, []
    for t, (inputs, targets) in enumerate(batches):
        torch.manual_seed(100 * rank + t)
        step(inputs, targets)
        if reference is None:
            reference = PlanReference(ref_model, ref_optimizer, loss_fn, plan_schedule_by_name(step), world_size,
                                      compensated=step.delayed_update == "compensated")
        before = _snapshot(ref_model, ref_optimizer)
        torch.manual_seed(100 * rank + t)
        reference.step(inputs, targets)
        after = _named_state(ref_model, ref_optimizer)
        next_forward = {item.id for item in step.items if item.apply == APPLY_NEXT_FORWARD} & set(step.pending)
        deferred = {step.profile.params[s.param].name for item in step.plan.items if item.id in next_forward
                    for s in item.slices}
        entry = _compare_deferred(_named_state(deft_model, deft_optimizer), before, after, deferred,
                                  deferred_grads=False)
        entry.update(step=t, deferred=len(deferred))
        report.append(entry)
    plan = step.plan
    step.flush()
    reference.flush()
    # parameters, buffers and optimizer state; not .grad, which the reference's flush clears for the
    # synchronous parameters and the step keeps (as DDP does)
    no_grads = lambda state: {k: v for k, v in state.items() if not k.startswith("grad:")}  # noqa: E731
    final = _compare(no_grads(_named_state(deft_model, deft_optimizer)),
                     no_grads(_named_state(ref_model, ref_optimizer)))
    return {"steps": report, "final": final, "options": dict(plan.options),
            "delayed_items": sum(1 for item in plan.items if item.delay),
            "next_forward_items": sum(1 for item in step.items if item.apply == APPLY_NEXT_FORWARD),
            "items": len(plan.items), "pending_after_flush": step.pending}


def closed_loop_hybrid_run(rank: int, world_size: int, steps: int, priority_schedule: bool = True) -> dict:
    """deft starts synchronous (as it does before the Preserver's first trade) and its closed loop settles on a
    priority plan (``inject`` makes the priority plans 1 s faster than the rest); then a re-plan with delays (the
    Preserver's trade, through ``switch_plan``) must carry the parameters it leaves synchronous on that priority
    schedule, and still duel against the priority plan."""
    from deft_compile.passes.schedule import APPLY_NEXT_FORWARD, APPLY_NEXT_UPDATE
    from deft_compile.preserver import PreserverConfig
    from deft_compile.planner.closed_loop import PRIORITY_POLICIES

    model, optimizer, loss_fn, batches, profile = _mlp_with_delaying_profile(rank, world_size, steps)
    config = DeftConfig(first_bucket_mb=1e-6, bucket_cap_mb=1e-6, preserver=PreserverConfig(enabled=False),
                        plan_options={"max_staleness": 0},
                        closed_loop=ClosedLoopConfig(enabled=True, min_window_ms=0.0, warmup_steps=1, measure_steps=2, duel_rounds=2,
                                                     duel_steps=1, priority_schedule=priority_schedule, duel_max_rounds=0,
                                                     measure_contention=False))  # injected times: see closed_loop_run
    step = deft_compile(model, optimizer, loss_fn, policy="deft", profile=profile, config=config)
    step.closed_loop.inject = lambda plan: 1000.0 if plan.policy in PRIORITY_POLICIES else 2000.0
    initial_options, replan, settled_policy = None, None, None
    for t in range(steps):
        step(*batches[t])
        initial_options = initial_options or dict(step.plan.options)
        if step.closed_loop.state == "settled" and replan is None:
            settled_policy = step.plan.policy
            step.switch_plan({**initial_options, "max_staleness": 1}, "test: a re-plan with delays after settling")
            applies = sorted({item.apply for item in step.items})
            replan = {"options": dict(step.plan.options), "delayed": sum(1 for item in step.plan.items if item.delay),
                      "applies": applies, "hash": step.plan.hash()}
    step.flush()
    return {"settled_policy": settled_policy, "replan": replan, "final_policy": step.plan.policy,
            "state": step.closed_loop.state, "priority_schedule": step.closed_loop.priority_schedule,
            "next_forward": APPLY_NEXT_FORWARD, "next_update": APPLY_NEXT_UPDATE,
            "history": [{k: v for k, v in h.items()} for h in step.plan_history]}


def priority_closed_loop_run(rank: int, world_size: int, policy: str, steps: int, slower_ms: float) -> dict:
    """A ByteScheduler or US-Byte step with its closed loop (``inject`` adds ``slower_ms`` to every measured step,
    so the plan misses its prediction): the loop refines the profile, tries the plan re-tuned on it, settles on
    the faster; every step gives DDP's numbers (updates deferred to the next forward compared with DDP's
    previous step), and after ``flush`` all of them."""
    make_optimizer, make_batch, loss_fn, base, ddp_model, ddp, ddp_optimizer, deft_model, deft_optimizer = _ddp_pair(
        "mlp_dropout_sgd")
    data = torch.Generator().manual_seed(1234 + rank)
    batches = [make_batch(data) for _ in range(steps)]
    scratch = copy.deepcopy(base)
    profile = synthetic_profile(scratch, make_optimizer(scratch), loss_fn, batches[0], world_size)
    step = deft_compile(deft_model, deft_optimizer, loss_fn, policy=policy, profile=profile,
                        config=DeftConfig(closed_loop=ClosedLoopConfig(enabled=True, min_window_ms=0.0, warmup_steps=1,
                                                                       measure_steps=2, measure_contention=False)))  # injected times: see closed_loop_run
    step.closed_loop.inject = lambda plan: slower_ms
    report = []
    for t, (inputs, targets) in enumerate(batches):
        entry, _ = _step_beside_ddp(step, rank, t, inputs, targets, loss_fn, ddp, ddp_model, ddp_optimizer,
                                    deft_model, deft_optimizer, deferred_grads=False)
        entry.update(step=t)
        report.append(entry)
    step.flush()
    final = _compare(_named_state(deft_model, deft_optimizer), _named_state(ddp_model, ddp_optimizer))
    return {"steps": report, "final": final, "state": step.closed_loop.state, "scales": list(step.closed_loop.scales),
            "reasons": [h["reason"] for h in step.plan_history], "final_policy": step.plan.policy}


def contention_probe_run(rank: int, world_size: int) -> dict:
    """``measure_contention`` on the world group: a message long enough to time, and one too short."""
    import torch.distributed as dist

    from deft_compile.step.profiler import measure_contention

    group = dist.group.WORLD
    return {"large": measure_contention(group, 64 << 20), "tiny": measure_contention(group, 64)}


def contention_config_run(rank: int, world_size: int) -> dict:
    """The profile's contention under ``DeftConfig.contention``: 0 by default, a given number, or measured."""
    make_model, make_optimizer, make_batch, loss_fn, _ddp_kwargs, _exact = CASES["mlp_dropout_sgd"]
    found = {}
    for label, contention in (("default", 0.0), ("given", 0.25), ("measured", None)):
        torch.manual_seed(0)
        model = make_model()
        step = deft_compile(model, make_optimizer(model), loss_fn, policy="deft",
                            config=DeftConfig(contention=contention))
        step(*make_batch(torch.Generator().manual_seed(rank)))
        found[label] = step.profile.contention
    return found
