"""US-Byte: unequal-sized block groups in backward, layer order after backward.

Two phases, following the US-Byte paper's model (Sun et al., TPDS 2024):

1. Backward phase (gradients still being produced). Whenever the link frees
   up at time t and gradient data is pending, send one block group sized to
   fill the gap until the next gradient-ready event r_next under the α–β
   cost: bytes = scale · (r_next − t − α)/β, at least ``min_block_bytes``
   (so α never exceeds half a block's time). The block takes pending data in
   priority order, crossing tensor boundaries and cutting tensors anywhere
   (blocks are unequal by construction).
2. Forward phase (backward finished). The remaining data goes in layer order,
   input side first — the order that lets the next forward start earliest,
   which the paper proves optimal for this phase — one group per layer,
   merging consecutive layers until a group reaches ``phase2_min_bytes``.

Priority search over the backward order: data of layers below a split layer
λ goes first, lowest layer first (ByteScheduler-like); the rest in ready
order (WFBP-like). λ = lowest layer is pure ready order, λ above the top
layer is pure input-first. We grid-search λ over 7 layer quantiles at scale 1,
then the scale over {0.5, 1, 2, 4} at the best λ, scoring each with the
per-layer closed form (see ``per_layer``). Each item is waited for before the
forward of the lowest layer it carries; a parameter is updated after the last
of its items. Sizes are the link's bytes: with ``wire_dtype`` a 16-bit block
holds twice the elements.
"""

from __future__ import annotations

import heapq
import math

import numpy as np

from deft_compile.planner.plan import WIRE_FULL, CommItem, ParamSlice, Plan, Profile, before_forward_of_layer, wire_for
from deft_compile.planner.solvers.common import finish, wire_option
from deft_compile.planner.solvers.per_layer import LayerContext

SCALE_GRID = (0.5, 1.0, 2.0, 4.0)
SPLIT_QUANTILES = 7


class _Blocks:
    """One emulation of US-Byte for a given split layer, scale and minimum sizes."""

    def __init__(self, ctx: LayerContext, alpha: float, beta: float, split_layer: int,
                 scale: float, min_block_bytes: int, phase2_min_bytes: int) -> None:
        self.groups: list[list[ParamSlice]] = []
        ends: list[float] = []
        ready = ctx.ready_list
        layer_of = ctx.param_layer_list
        keys = ctx.keys
        element_bytes = ctx.element_bytes_list
        n = len(ready)
        remaining = list(ctx.param_numel_list)
        sent = [0] * n
        heap: list[tuple[int, int, int]] = []
        now = 0.0
        k = 0
        while True:  # phase 1: gradients still being produced
            while k < n and ready[k] <= now:
                layer = layer_of[k]
                heapq.heappush(heap, (0, layer, k) if layer < split_layer else (1, 0, k))
                k += 1
            if k == n:
                break
            if not heap:
                now = ready[k]
                continue
            gap = ready[k] - now
            target = scale * (gap - alpha) / beta if beta > 0 else math.inf
            if target < min_block_bytes:
                target = float(min_block_bytes)
            group: list[ParamSlice] = []
            nbytes = 0
            key_of_group = keys[heap[0][2]]
            while heap and nbytes < target:
                q = heap[0][2]
                if keys[q] != key_of_group:
                    break
                size = element_bytes[q]
                need = target - nbytes
                take = remaining[q] if math.isinf(need) else min(remaining[q],
                                                                 max(1, math.ceil(need / size)))
                group.append(ParamSlice(q, sent[q], take))
                sent[q] += take
                remaining[q] -= take
                nbytes += take * size
                if remaining[q] == 0:
                    heapq.heappop(heap)
            now += alpha + beta * nbytes
            self.groups.append(group)
            ends.append(now)
        # phase 2: layer order, input side first, merged up to phase2_min_bytes
        left = [q for q in ctx.forward_order if remaining[q] > 0]
        group = []
        nbytes = 0
        for position, q in enumerate(left):
            group.append(ParamSlice(q, sent[q], remaining[q]))
            nbytes += remaining[q] * element_bytes[q]
            nxt = left[position + 1] if position + 1 < len(left) else None
            if (nxt is None or keys[nxt] != keys[q]
                    or (layer_of[nxt] != layer_of[q] and nbytes >= phase2_min_bytes)):
                now += alpha + beta * nbytes
                self.groups.append(group)
                ends.append(now)
                group, nbytes = [], 0
        self.ends = np.array(ends)
        layer_pos = ctx.param_layer_pos_list
        wait_pos = [min(layer_pos[s.param] for s in g) for g in self.groups]
        update_pos = [0] * n
        for g, pos in zip(self.groups, wait_pos):
            for s in g:
                if pos > update_pos[s.param]:
                    update_pos[s.param] = pos
        self.wait_pos = np.array(wait_pos, dtype=np.int64)
        self.update_pos = np.array(update_pos, dtype=np.int64)
        self.iteration_ms = ctx.iteration_ms(self.ends, self.wait_pos, update_pos)


def solve_usbyte(
    profile: Profile,
    *,
    split_layer: int | None = None,
    scale: float | None = None,
    min_block_bytes: int | None = None,
    phase2_min_bytes: int | None = None,
    link: int = 0,
    wire_dtype: str = WIRE_FULL,
) -> Plan:
    """US-Byte's plan; ``split_layer`` and ``scale`` are searched when None; blocks of gradients that narrow
    cross the link as ``wire_dtype``."""
    wire = wire_option(wire_dtype)
    ctx = LayerContext(profile, wire_dtype)
    cost = profile.links[link]
    alpha, beta = cost.alpha_ms, cost.beta_ms_per_byte
    break_even = int(alpha / beta) if beta > 0 else 1 << 20
    min_block_bytes = max(1, break_even) if min_block_bytes is None else int(min_block_bytes)
    phase2_min_bytes = max(1, break_even) if phase2_min_bytes is None else int(phase2_min_bytes)
    evaluated: dict[tuple[int, float], float] = {}

    def run(lam: int, sc: float) -> _Blocks:
        blocks = _Blocks(ctx, alpha, beta, lam, sc, min_block_bytes, phase2_min_bytes)
        evaluated[(lam, sc)] = blocks.iteration_ms
        return blocks

    if split_layer is None:
        layers = ctx.layers
        picks = np.linspace(0, len(layers), SPLIT_QUANTILES).round().astype(int)
        candidates = sorted({int(layers[i]) if i < len(layers) else int(layers[-1]) + 1
                             for i in picks})
        first_scale = 1.0 if scale is None else scale
        split_layer = min(candidates, key=lambda lam: (run(lam, first_scale).iteration_ms, lam))
    if scale is None:
        scale = min(SCALE_GRID, key=lambda sc: (evaluated[(split_layer, sc)]
                                                if (split_layer, sc) in evaluated
                                                else run(split_layer, sc).iteration_ms, sc))
    chosen = _Blocks(ctx, alpha, beta, split_layer, scale, min_block_bytes, phase2_min_bytes)
    items = []
    for position, (group, pos) in enumerate(zip(chosen.groups, chosen.wait_pos)):
        point = before_forward_of_layer(int(ctx.layers[pos]))
        items.append(CommItem(id=position, slices=tuple(group), link=link, order=position,
                              wait_at=point, update_at=point, bucket=position,
                              wire_dtype=wire_for(profile, group, wire_dtype)))
    options = {"split_layer": int(split_layer), "scale": float(scale),
               "min_block_bytes": int(min_block_bytes), "phase2_min_bytes": int(phase2_min_bytes),
               "link": int(link), **wire}
    metadata = {"search": "grid over split layer (7 quantiles), then scale grid",
                "evaluated": [[lam, sc, t] for (lam, sc), t in sorted(evaluated.items())],
                "closed_form_iteration_ms": chosen.iteration_ms}
    return finish(profile, "usbyte", items, options, metadata)
