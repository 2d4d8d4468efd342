"""ByteScheduler: fixed-size partitions, input-side layers first, credit window.

Algorithm: every gradient tensor is cut into partitions of at most
``partition_bytes``; partitions are issued by priority = layer index (input
side first; ties by param then offset) through a credit window: at most
``credit`` bytes may be committed to the link's FIFO ahead of time, so a
higher-priority partition that becomes ready can overtake everything not yet
committed. Each partition is waited for (and its parameter updated) just
before its layer's forward in the next step.

The priority queue is dynamic; a compiled step issues collectives in a fixed
order. We emulate the queue once (event-driven, O(n log n)) and record the
commit order; issuing in that order on a FIFO link reproduces the same
timeline. Tuning: partition size by ternary search over powers of two
(64 KiB .. 64 MiB, assuming the iteration time is unimodal in log size), then
the credit (1, 2, 4, 8 partitions) by grid at the chosen size, both scored
with the per-layer closed form (see ``per_layer``). Sizes are the link's
bytes: with ``wire_dtype`` a 16-bit partition holds twice the elements.
"""

from __future__ import annotations

import heapq
import math
from collections import deque

import numpy as np

from deft_compile.planner.plan import WIRE_FULL, CommItem, ParamSlice, Plan, Profile, before_forward_of_layer, wire_for
from deft_compile.planner.solvers.common import finish, wire_option
from deft_compile.planner.solvers.per_layer import LayerContext, discrete_unimodal_argmin

PARTITION_GRID = tuple(2 ** k for k in range(16, 27))  # 64 KiB .. 64 MiB
CREDIT_GRID = (1, 2, 4, 8)
DEFAULT_MAX_ITEMS = 2048


def partition(ctx: LayerContext, partition_bytes: int) -> list[ParamSlice]:
    """Partitions of at most ``partition_bytes`` per param, in priority order."""
    parts: list[ParamSlice] = []
    order = np.lexsort((np.arange(len(ctx.param_layer)), ctx.param_layer))
    for q in order:
        numel = int(ctx.param_numel[q])
        step = max(1, partition_bytes // int(ctx.element_bytes[q]))
        for offset in range(0, numel, step):
            parts.append(ParamSlice(int(q), offset, min(step, numel - offset)))
    return parts


def priority_schedule(ready: list[float], cost: list[float], nbytes: list[int],
                      credit_bytes: int) -> tuple[list[int], np.ndarray]:
    """Emulate a priority queue (index = priority, lower first) with a credit window.

    Returns (commit order, end time of each item) on one FIFO link that is
    free at time 0.
    """
    n = len(ready)
    by_ready = sorted(range(n), key=lambda i: (ready[i], i))
    heap: list[int] = []
    order: list[int] = []
    ends = np.zeros(n)
    inflight: deque[tuple[float, int]] = deque()
    inflight_bytes = 0
    now = 0.0
    link_free = 0.0
    k = 0
    while len(order) < n:
        while k < n and ready[by_ready[k]] <= now:
            heapq.heappush(heap, by_ready[k])
            k += 1
        while heap and (not inflight or inflight_bytes + nbytes[heap[0]] <= credit_bytes):
            i = heapq.heappop(heap)
            link_free = max(link_free, now) + cost[i]
            ends[i] = link_free
            inflight.append((link_free, nbytes[i]))
            inflight_bytes += nbytes[i]
            order.append(i)
        next_ready = ready[by_ready[k]] if k < n else math.inf
        next_done = inflight[0][0] if inflight else math.inf
        now = min(next_ready, next_done)
        while inflight and inflight[0][0] <= now:
            inflight_bytes -= inflight.popleft()[1]
    return order, ends


class _Candidate:
    """One (partition size, credit) setting, scheduled and scored."""

    def __init__(self, ctx: LayerContext, profile: Profile, link: int, partition_bytes: int,
                 credit: int) -> None:
        self.parts = partition(ctx, partition_bytes)
        link_cost = profile.links[link]
        nbytes = [s.count * int(ctx.element_bytes[s.param]) for s in self.parts]
        cost = [link_cost.cost(b) for b in nbytes]
        ready = [float(ctx.ready[s.param]) for s in self.parts]
        self.order, ends = priority_schedule(ready, cost, nbytes, credit * partition_bytes)
        params = np.array([s.param for s in self.parts], dtype=np.int64)
        self.iteration_ms = ctx.iteration_ms(ends, ctx.param_layer_pos[params],
                                             ctx.param_layer_pos)


def solve_bytescheduler(
    profile: Profile,
    *,
    partition_bytes: int | None = None,
    credit: int | None = None,
    link: int = 0,
    max_items: int = DEFAULT_MAX_ITEMS,
    wire_dtype: str = WIRE_FULL,
) -> Plan:
    """ByteScheduler's plan; ``partition_bytes``/``credit`` (in partitions) tuned if None; partitions of
    gradients that narrow cross the link as ``wire_dtype``."""
    options = {"link": int(link), "max_items": int(max_items), **wire_option(wire_dtype)}
    ctx = LayerContext(profile, wire_dtype)
    total = int(ctx.param_bytes.sum())
    evaluated: dict[tuple[int, int], float] = {}

    def run(size: int, cr: int) -> _Candidate:
        candidate = _Candidate(ctx, profile, link, size, cr)
        evaluated[(size, cr)] = candidate.iteration_ms
        return candidate

    if partition_bytes is None:
        grid = [size for size in PARTITION_GRID
                if sum(-(-int(b) // size) for b in ctx.param_bytes) <= max_items]
        grid = grid or [PARTITION_GRID[-1]]
        first_credit = credit or 1
        best_index = discrete_unimodal_argmin(lambda i: run(grid[i], first_credit).iteration_ms,
                                              len(grid))
        partition_bytes = grid[best_index]
    if credit is None:
        credit = min(CREDIT_GRID, key=lambda c: (evaluated[(partition_bytes, c)]
                                                 if (partition_bytes, c) in evaluated
                                                 else run(partition_bytes, c).iteration_ms, c))
    chosen = _Candidate(ctx, profile, link, partition_bytes, credit)
    items = []
    for position, index in enumerate(chosen.order):
        part = chosen.parts[index]
        point = before_forward_of_layer(int(ctx.param_layer[part.param]))
        items.append(CommItem(id=position, slices=(part,), link=link, order=position,
                              wait_at=point, update_at=point, wire_dtype=wire_for(profile, (part,), wire_dtype)))
    options = {"partition_bytes": int(partition_bytes), "credit": int(credit), **options}
    metadata = {"search": "ternary over log2 partition size, then credit grid",
                "evaluated": [[s, c, t] for (s, c), t in sorted(evaluated.items())],
                "closed_form_iteration_ms": chosen.iteration_ms, "total_bytes": total}
    return finish(profile, "bytescheduler", items, options, metadata)
