"""Shared model of the per-layer-wait policies (ByteScheduler, US-Byte).

Why a closed form instead of the full simulator inside their searches: in
these policies every collective of step t is waited for before the forward of
its layer in step t+1, so the link is idle when the backward of t+1 starts.
One backward's worth of collectives therefore determines the steady state
exactly: with item end times e_k measured from the backward start, the next
forward starts at T_B, layer l starts at max(end of layer l-1, max e_k of its
items), and the iteration is (end of that forward) + extra forward. The
solvers search with this and the final plan is checked by ``simulate`` (tests
assert both agree).
"""

from __future__ import annotations

import numpy as np

from deft_compile.planner.plan import WIRE_FULL, Profile, wire_element_bytes


class LayerContext:
    """Arrays of a profile that the per-layer evaluators need, built once per solve.

    Sizes are on the wire: ``element_bytes`` and ``param_bytes`` count each gradient element at the size it
    crosses the link in (``wire_dtype`` for gradients that narrow, their own otherwise), so partitions, blocks
    and their costs are in the link's bytes."""

    def __init__(self, profile: Profile, wire_dtype: str = WIRE_FULL) -> None:
        params = profile.params
        self.layers = np.array(sorted({p.layer for p in params}), dtype=np.int64)
        self.param_layer = np.array([p.layer for p in params], dtype=np.int64)
        self.param_layer_pos = np.searchsorted(self.layers, self.param_layer)
        self.layer_forward = np.bincount(self.param_layer_pos,
                                         weights=np.array([p.forward_ms for p in params]),
                                         minlength=len(self.layers))
        self.param_update = np.array([p.update_ms for p in params], dtype=float)
        self.param_numel = np.array([p.numel for p in params], dtype=np.int64)
        self.element_bytes = np.array([wire_element_bytes(p.dtype, wire_dtype, profile.world_size) for p in params])
        self.param_bytes = self.param_numel * self.element_bytes
        self.keys = profile.bucket_keys()
        #: gradient-ready time of each param, measured from the backward start
        self.ready = profile.extra_backward_ms + np.cumsum([p.backward_ms for p in params])
        self.backward_ms = profile.backward_ms
        # plain-list copies: the emulation loops index them one element at a time
        self.ready_list = [float(x) for x in self.ready]
        self.param_layer_list = [int(x) for x in self.param_layer]
        self.param_layer_pos_list = [int(x) for x in self.param_layer_pos]
        self.param_numel_list = [int(x) for x in self.param_numel]
        self.element_bytes_list = [int(x) for x in self.element_bytes]
        #: params in forward order: layer ascending, then param index
        self.forward_order = [int(q) for q in np.lexsort((np.arange(len(params)), self.param_layer))]
        self.extra_forward_ms = profile.extra_forward_ms

    def layer_position(self, layer: int) -> int:
        return int(np.searchsorted(self.layers, layer))

    def iteration_ms(self, ends: np.ndarray, item_wait_pos: np.ndarray,
                     param_update_pos: np.ndarray) -> float:
        """Steady-state iteration time given item end times (from backward start)."""
        n_layers = len(self.layers)
        waits = np.full(n_layers, -np.inf)
        if len(ends):
            np.maximum.at(waits, item_wait_pos, ends)
        durations = self.layer_forward + np.bincount(param_update_pos, weights=self.param_update,
                                                     minlength=n_layers)
        before = np.cumsum(durations) - durations
        start = before + np.maximum.accumulate(np.maximum(waits - before, self.backward_ms))
        return float(start[-1] + durations[-1]) + self.extra_forward_ms


def discrete_unimodal_argmin(evaluate, n: int) -> int:
    """Index minimising ``evaluate`` on 0..n-1, assuming unimodality (ternary search).

    Uses O(log n) evaluations, memoised; ties go to the smaller index.
    """
    cache: dict[int, float] = {}

    def f(i: int) -> float:
        if i not in cache:
            cache[i] = evaluate(i)
        return cache[i]

    lo, hi = 0, n - 1
    while hi - lo > 2:
        m1 = lo + (hi - lo) // 3
        m2 = hi - (hi - lo) // 3
        if f(m1) <= f(m2):
            hi = m2
        else:
            lo = m1
    return min(range(lo, hi + 1), key=lambda i: (f(i), i))
