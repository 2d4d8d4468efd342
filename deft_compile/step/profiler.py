"""Profiler: measured compute per parameter and all-reduce cost per link, agreed across ranks.

Compute is measured on the captured step itself: the graph runs node by node
under an ``fx.Interpreter`` on *copies* of the parameters, buffers, optimizer
state and inputs (the live model is never touched, and the random-number state
is restored afterwards so training draws the same numbers it would have),
``warmup`` times and then ``repeats`` times (in the training step's profile,
``profile_step``, no further run once the timed runs' nodes took
``PROFILE_BUDGET_S`` together, though always one after the graph's first: each
run delays the first step by a step's time); each node's fastest time is
attributed to a parameter:

* forward nodes to the parameter whose first use most recently started (its
  "layer"), split evenly among parameters first used by the same node;
* backward nodes between the gradient-ready events of two parameters to the
  later one, so ``backward_ms`` is the gap the planner fills (nodes before the
  first gradient is ready are ``extra_backward_ms``);
* optimizer nodes to the parameter they update.

Link costs come from timed all-reduces of several sizes, fitted to
``alpha + beta * bytes`` (least squares, non-negative: ``planner.link_fit``). Every rank measures,
then all ranks take the maximum of each number, so every rank solves the same
plan from the same profile. Per size, the link's time is the mean of the faster
half of the repeats (``fast_mean``): robust to a busy moment on a shared machine.
The compute thread's own cost per message (``Profile.message_cpu_ms``: launch,
wait, flatten and split ops) is timed on tiny messages (``measure_message_cpu``).
How much a collective slows compute beside it (``Profile.contention``) is timed
with a matmul loop run alone and beside one all-reduce (``measure_contention``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx

from deft_compile.ir import ops
from deft_compile.planner.link_fit import fast_mean, fit_alpha_beta
from deft_compile.planner.plan import LinkCost, Profile
from deft_compile.step.annotate import StepAnnotation
from deft_compile.step.capture import CapturedStep
from deft_compile.step.isa_key import wait_for_isa_check
from deft_compile.step.scheduling import ProfileIndex, static_profile
from deft_compile.timing import HostClock, clock_for, comm_device, resolve_ms


# All-reduce sizes the profiler times to fit a link's alpha and beta.
LINK_PROBE_BYTES = (1 << 12, 1 << 16, 1 << 20, 1 << 22)
#: the timed rounds of one probe size stop short of ``repeats`` past this predicted time (``probe_repeats``)
LINK_PROBE_BUDGET_MS = 250.0
#: the fewest timed rounds of one probe size
LEAST_LINK_REPEATS = 3
#: seconds of node time after which the step's profile times no further run (at least one after the first)
PROFILE_BUDGET_S = 0.25


class _TimingInterpreter(fx.Interpreter):
    """Runs the graph node by node, each node's work inside ``timed`` (the clock's bracket, ``Clock.time_nodes``)."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.timed: Callable[[Callable[[], Any]], Any] | None = None
        self.order: list[fx.Node] = []

    def run_node(self, n: fx.Node) -> Any:
        if n.op in ("placeholder", "output", "get_attr") or self.timed is None:
            return super().run_node(n)
        self.order.append(n)
        return self.timed(lambda: super(_TimingInterpreter, self).run_node(n))


def measure_node_times(
    captured: CapturedStep, inputs: Sequence[torch.Tensor], *, warmup: int = 1, repeats: int = 3,
    clock: HostClock | None = None, budget_s: float | None = None,
) -> dict[fx.Node, float]:
    """Milliseconds of every node of the captured graph (``time_graph_nodes`` on a copy of the inputs)."""
    return time_graph_nodes(captured.graph_module, inputs, warmup=warmup, repeats=repeats, clock=clock,
                            budget_s=budget_s)


def time_graph_nodes(
    gm: fx.GraphModule, inputs: Sequence[Any], *, warmup: int = 1, repeats: int = 3, clock: HostClock | None = None,
    budget_s: float | None = None,
) -> dict[fx.Node, float]:
    """Milliseconds of every computing node of ``gm`` (the minimum over ``repeats`` runs on copies of ``inputs``,
    after ``warmup`` runs; with ``budget_s``, no further run once the timed runs' nodes took that many seconds
    together, but at least one timed run that is not the graph's first: a first run on fresh copies also pays
    for first-touch pages and first kernel calls, unevenly across nodes).

    The minimum, not the median: on a shared machine a busy moment only ever
    makes a node slower, and one skewed profile would bias the whole plan.
    ``clock`` (default: the inputs' device's, ``deft_compile.timing.clock_for``) brackets each node: the host clock
    on a CPU, CUDA events around the node's kernels on a GPU. The random-number state is restored afterwards.
    """
    wait_for_isa_check()  # Inductor's ISA check (step/isa_key.py): its probes would share the timed cores
    if clock is None:
        device = next((t.device for t in inputs if isinstance(t, torch.Tensor) and t.device.type != "cpu"), None)
        clock = clock_for(device)
    rng = torch.get_rng_state()
    cuda_rng = _cuda_rng_states()
    interpreter = _TimingInterpreter(gm)
    samples: dict[fx.Node, list[float]] = {}
    timed_s = 0.0
    try:
        with torch.no_grad():
            for run in range(warmup + repeats):
                if budget_s is not None and run > max(warmup, 1) and timed_s >= budget_s:
                    break
                copies = [t.detach().clone() if isinstance(t, torch.Tensor) else t for t in inputs]
                interpreter.order = []

                def one_run(timed: Callable[[Callable[[], Any]], Any]) -> None:
                    interpreter.timed = timed
                    try:
                        interpreter.run(*copies)
                    finally:
                        interpreter.timed = None

                spans = clock.time_nodes(one_run)
                if run >= warmup:
                    node_ms = resolve_ms(spans)
                    timed_s += sum(node_ms) / 1e3
                    for node, ms in zip(interpreter.order, node_ms):
                        samples.setdefault(node, []).append(ms)
    finally:
        torch.set_rng_state(rng)
        _restore_cuda_rng_states(cuda_rng)
    return {node: min(values) for node, values in samples.items()}


def _cuda_rng_states() -> list[torch.Tensor] | None:
    """The CUDA generators' states where CUDA is initialised (the profiling runs draw from them too)."""
    return torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None


def _restore_cuda_rng_states(states: list[torch.Tensor] | None) -> None:
    if states is not None:
        torch.cuda.set_rng_state_all(states)


def attribute_times(
    annotation: StepAnnotation, index: ProfileIndex, node_ms: dict[fx.Node, float]
) -> dict[Any, Any]:
    """Per captured parameter index: (forward_ms, backward_ms, update_ms); plus the extras."""
    order = annotation.order
    forward_end = order[annotation.forward_end]
    ready_positions = [(order[annotation.params[c].gradient_ready], c) for c in index.ready]
    update_of: dict[fx.Node, int] = {}
    for a in annotation.params:
        for node in a.update_nodes:
            update_of[node] = a.index
    starts: dict[int, list[int]] = {}
    for a in annotation.params:
        if a.first_forward_use is not None and a.index in index.ready:
            starts.setdefault(order[a.first_forward_use], []).append(a.index)
    layer_starts = sorted(starts.items())
    forward = {c: 0.0 for c in index.ready}
    backward = {c: 0.0 for c in index.ready}
    update = {c: 0.0 for c in index.ready}
    extra_backward = 0.0
    extra_forward = 0.0
    last_ready = max((p for p, _ in ready_positions), default=forward_end)
    first_ready = min((p for p, _ in ready_positions), default=forward_end)
    for node, ms in node_ms.items():
        position = order.get(node)
        if position is None or _removed_before_running(node):
            continue
        if node in update_of:
            if update_of[node] in update:
                update[update_of[node]] += ms
        elif position < forward_end:
            owners = None
            for start, params in layer_starts:
                if start <= position:
                    owners = params
                else:
                    break
            if owners is None:
                extra_forward += ms
            else:
                for c in owners:
                    forward[c] += ms / len(owners)
        elif position <= last_ready:
            if position < first_ready:
                extra_backward += ms
            else:
                backward[next(c for p, c in ready_positions if p >= position)] += ms
    result: dict[Any, Any] = {c: (forward[c], backward[c], update[c]) for c in index.ready}
    result["extra_forward_ms"] = extra_forward
    result["extra_backward_ms"] = extra_backward
    return result


def _removed_before_running(node: fx.Node) -> bool:
    """Markers and record-function nodes are stripped by the passes; their time is not the step's."""
    target = node.target
    return target in ops.MARKERS or (isinstance(target, torch._ops.OpOverload) and target.namespace == "profiler")


def probe_repeats(previous: tuple[int, float] | None, nbytes: int, repeats: int, budget_ms: float | None,
                  least: int = LEAST_LINK_REPEATS) -> int:
    """How many timed all-reduces of ``nbytes`` a link probe takes: ``repeats``, fewer where the time predicted
    for them passes ``budget_ms``, never under ``least``. The prediction scales the previous (smaller) size's
    measured time by the size ratio, which never underestimates a cost α + β·bytes; every rank has that time (the
    slowest rank's), so every rank takes the same count. On a slow link the largest size takes most of the probe's
    time; its time is then the mean of the faster two of three rounds."""
    if budget_ms is None or previous is None or previous[1] <= 0:
        return repeats
    predicted = previous[1] * nbytes / previous[0]
    return max(min(least, repeats), min(repeats, int(budget_ms // predicted)))


def measure_allreduce(group: Any, sizes_bytes: Sequence[int], repeats: int = 5, warmup: int = 1,
                      budget_ms: float | None = None) -> list[tuple[int, float]]:
    """All-reduce time (ms) of a float32 tensor per size, over ``group``; every rank must call it.

    The time per size is the mean of the faster half of ``repeats`` (``fast_mean``); ``budget_ms``: fewer repeats
    where they would take longer (``probe_repeats``).

    Each repeat starts after a barrier and its time is the slowest rank's (a MAX
    all-reduce of the per-rank times), so all ranks return the same numbers and a
    rank that arrived late cannot make the link look fast. The tensor lives where the group's collectives
    take it (``comm_device``: the GPU for NCCL) and is timed with that device's clock.
    """
    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    device = comm_device(group)
    clock = clock_for(device)
    results: list[tuple[int, float]] = []
    for size in sizes_bytes:
        tensor = torch.ones(max(1, int(size) // 4), dtype=torch.float32, device=device)
        for _ in range(warmup):
            dist.all_reduce(tensor, group=group)
        samples = []
        for _ in range(probe_repeats(results[-1] if results else None, tensor.numel() * 4, repeats, budget_ms)):
            dist.barrier(group=group)
            samples.append(clock.time_call(lambda: dist.all_reduce(tensor, group=group))[1])
        times = torch.tensor(samples, dtype=torch.float64, device=device)
        dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
        results.append((tensor.numel() * 4, fast_mean(times.tolist())))
    return results


def measure_link(name: str, group: Any, repeats: int = 6) -> LinkCost:
    """The link's cost model: β (and the latency of one message) fitted on timed all-reduces of
    ``LINK_PROBE_BYTES``; α is what one more message adds to a queue of them (``measure_queued_message_ms``)
    when that is less than the fitted latency. The simulator queues messages on a link one after the other,
    while gloo runs a group's collectives on two threads, so back-to-back messages overlap their latencies:
    with the single-message latency (1–3 ms on a shaped link) a plan of 160 messages was predicted 72 %
    too slow. Every rank must call it."""
    alpha, beta = fit_alpha_beta(measure_allreduce(group, LINK_PROBE_BYTES, repeats=repeats,
                                                   budget_ms=LINK_PROBE_BUDGET_MS))
    queued = max(0.0, measure_queued_message_ms(group) - beta * 4)
    return LinkCost(name, min(alpha, queued), beta)


def measure_queued_message_ms(group: Any, messages: int = 16, repeats: int = 3) -> float:
    """Milliseconds per message when ``messages`` tiny all-reduces are launched back to back and then waited
    for: the marginal cost of a message in a queue, latency overlapped as the backend allows. Every rank must
    call it."""
    device = comm_device(group)
    tensors = [torch.ones(1, device=device) for _ in range(messages)]

    def one_round() -> None:
        works = [dist.all_reduce(t, group=group, async_op=True) for t in tensors]
        for work in works:
            work.wait()

    return _fastest_round_ms(one_round, group, repeats) / messages


def measure_message_cpu(group: Any, messages: int = 24, repeats: int = 3) -> float:
    """The compute side's own ms per collective, as the scheduled step runs it: ``cat.out`` of two tensors
    into a bucket, the in-place functional all-reduce that launches it, and later ``wait_tensor`` and
    ``split_with_sizes``. Messages are launched back to back, then waited for once the link is surely done
    with them, so the time is the compute side's, not the link's (the simulator charges the link with α and β).
    On a CPU that is the step thread's time; on a GPU the compute stream's (events around the launches and
    around the waits). Every rank must call it."""
    functional = torch.ops._c10d_functional
    device = comm_device(group)
    clock = clock_for(device)
    pieces = [torch.ones(1, device=device), torch.ones(1, device=device)]
    buckets = [torch.empty(2, device=device) for _ in range(messages)]
    name = group.group_name
    best = math.inf
    for index in range(repeats + 1):
        dist.barrier(group=group)
        clock.synchronize()
        started = clock.mark()
        launched = [functional.all_reduce_(torch.cat(pieces, out=bucket), "sum", name) for bucket in buckets]
        launch = clock.since(started)
        clock.synchronize()
        dist.barrier(group=group)  # all messages have finished on every rank by now
        started = clock.mark()
        for out in launched:
            torch.split(functional.wait_tensor(out), [1, 1])
        waits = clock.since(started)
        clock.synchronize()
        if index > 0:  # the first round warms the path up
            best = min(best, sum(resolve_ms([launch, waits])))
    return _slowest_rank_ms(best, group) / messages


#: the message the contention probe all-reduces (at most): long enough on a slow link to time, short on a fast one
CONTENTION_PROBE_BYTES = 32 << 20
#: below this all-reduce time the probe cannot tell contention from noise, and reports none
CONTENTION_MIN_COMM_MS = 5.0


def measure_contention(group: Any, nbytes: int, repeats: int = 3) -> float:
    """``Profile.contention``: the share of an all-reduce's time that slows compute running beside it.

    Why: on a CPU host gloo's copies, reductions and the loopback's kernel work take cores the compute
    needs, so communication hidden behind compute is not free (the floor's step with the whole gradient
    all-reduced beside it takes about 1.5x the floor on GPT-2). On an accelerator it is about 0; on a CPU host
    the probe reads 0.55-0.91 in normal mode and 0.10-0.24 in accelerator emulation, where gloo's threads have
    a core of their own. How: a loop of 128x128 matmuls (on the group's device) sized to about twice the
    all-reduce's time runs alone and with one all-reduce of ``nbytes`` (at most ``CONTENTION_PROBE_BYTES``)
    launched before it and waited for after it, which it then overlaps completely: (with - alone) / all-reduce,
    the fastest of ``repeats`` rounds of each, the slowest rank's, clipped to [0, 1]. An all-reduce under
    ``CONTENTION_MIN_COMM_MS`` cannot be told from noise: 0. Every rank must call it."""
    device = comm_device(group)
    clock = clock_for(device)
    buffer = torch.zeros(max(1, min(nbytes, CONTENTION_PROBE_BYTES) // 4), device=device)
    comm_ms = _fastest_round_ms(lambda: dist.all_reduce(buffer, group=group), group, repeats)
    if comm_ms < CONTENTION_MIN_COMM_MS:
        return 0.0
    matrix = torch.randn(128, 128, device=device)
    per_mm_ms = max(1e-6, clock.time_call(lambda: [torch.mm(matrix, matrix) for _ in range(20)])[1] / 20)
    count = torch.tensor([math.ceil(2.0 * comm_ms / per_mm_ms)], dtype=torch.float64, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)  # every rank runs the same loop
    matmuls = int(count.item())

    def compute() -> None:
        for _ in range(matmuls):
            torch.mm(matrix, matrix)

    def overlapped() -> None:
        work = dist.all_reduce(buffer, group=group, async_op=True)
        compute()
        work.wait()

    alone_ms = _fastest_round_ms(compute, group, repeats)
    overlapped_ms = _fastest_round_ms(overlapped, group, repeats)
    return min(1.0, max(0.0, (overlapped_ms - alone_ms) / comm_ms))


def _fastest_round_ms(one_round: Callable[[], Any], group: Any, repeats: int) -> float:
    """Milliseconds of the fastest of ``repeats`` rounds of ``one_round`` (noise only adds time), each after a
    barrier, after one warm-up round, timed with the group's device clock (``Clock.time_call``); the slowest
    rank's, so every rank gets the same number."""
    clock = clock_for(comm_device(group))
    best = math.inf
    for index in range(repeats + 1):
        dist.barrier(group=group)
        _, ms = clock.time_call(one_round)
        if index > 0:  # the first round warms the path up
            best = min(best, ms)
    return _slowest_rank_ms(best, group)


def _slowest_rank_ms(ms: float, group: Any) -> float:
    slowest = torch.tensor([ms], dtype=torch.float64, device=comm_device(group))
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    return float(slowest.item())


def agree_across_ranks(profile: Profile, group: dist.ProcessGroup) -> Profile:
    """Every rank gets the element-wise maximum of all ranks' measurements."""
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, profile.to_dict(), group=group)
    merged = gathered[0]
    for other in gathered[1:]:
        for mine, theirs in zip(merged["params"], other["params"]):
            for key in ("forward_ms", "backward_ms", "update_ms"):
                mine[key] = max(mine[key], theirs[key])
        for mine, theirs in zip(merged["links"], other["links"]):
            for key in ("alpha_ms", "beta_ms_per_byte"):
                mine[key] = max(mine[key], theirs[key])
        for key in ("extra_forward_ms", "extra_backward_ms", "message_cpu_ms", "contention"):
            merged[key] = max(merged[key], other[key])
    return Profile.from_dict(merged)


def profile_step(
    captured: CapturedStep,
    annotation: StepAnnotation,
    inputs: Sequence[torch.Tensor],
    groups: Sequence[tuple[str, dist.ProcessGroup]],
    world_size: int,
    *,
    warmup: int = 1,
    repeats: int = 3,
    link_repeats: int = 6,
    contention: float | None = 0.0,
) -> Profile:
    """Measure compute and links on this rank, then agree with the other ranks (if any).

    Compute: each node's fastest of ``repeats`` runs (fewer past ``PROFILE_BUDGET_S``); links: the faster half of
    ``link_repeats`` timed all-reduces per size, each the slowest rank's; then
    every number is the maximum over ranks, so all ranks plan from one profile.
    ``contention``: the profile's (``DeftConfig.contention``), or None to measure it.
    """
    index = ProfileIndex.of(annotation)
    node_ms = measure_node_times(captured, inputs, warmup=warmup, repeats=repeats, budget_s=PROFILE_BUDGET_S)
    timings = attribute_times(annotation, index, node_ms)
    links = [measure_link(name, group, link_repeats) for name, group in groups]
    if not links:
        links = [LinkCost("local", 0.0, 0.0)]
    profile = static_profile(captured, index, links, world_size, timings)
    if groups:
        measured = measure_contention(groups[0][1], profile.total_bytes) if contention is None else contention
        profile = dataclasses.replace(profile, message_cpu_ms=measure_message_cpu(groups[0][1]), contention=measured)
        profile = agree_across_ranks(profile, groups[0][1])
    return profile


def profile_model(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: Any,
    args: tuple,
    kwargs: dict | None = None,
    *,
    measure: bool = True,
    links: Sequence[LinkCost] = (),
    world_size: int = 1,
    warmup: int = 1,
    repeats: int = 3,
) -> Profile:
    """Profile one process's step without training: capture, optionally time, return a ``Profile``.

    Nothing of the model or optimizer changes. With ``measure=False`` the
    times are zero (sizes, layers and gradient-ready order only), for
    building a profile by hand or from another machine's numbers.
    """
    from deft_compile.step.capture import capture_step, split_user_inputs
    from deft_compile.step.optim_support import hyperparameter_inputs
    from deft_compile.step.pipeline import annotate_capture

    kwargs = kwargs or {}
    state_slots = [
        (i, key)
        for i, p in enumerate(model.parameters())
        for key, value in optimizer.state.get(p, {}).items()
        if isinstance(value, torch.Tensor)
    ]
    captured = capture_step(model, optimizer, loss_fn, args, kwargs, state_slots)
    annotation = annotate_capture(captured)
    index = ProfileIndex.of(annotation)
    timings = None
    if measure:
        user_tensors, _, _ = split_user_inputs(args, kwargs)
        params = captured.model_state.params
        state = [optimizer.state[params[i]][key] for i, key in state_slots]
        inputs = [*params, *captured.model_state.buffers, *state, *user_tensors, *hyperparameter_inputs(optimizer)]
        timings = attribute_times(annotation, index, measure_node_times(captured, inputs, warmup=warmup, repeats=repeats))
    return static_profile(captured, index, list(links) or [LinkCost("local", 0.0, 0.0)], world_size, timings)
