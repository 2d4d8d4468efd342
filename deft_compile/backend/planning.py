"""``options={"policy": "deft"}``: profile a backward graph at its first call and let DeFT's knapsack pick delays.

Why at the first call: the backward compiler only sees fake tensors; compute
times need the real saved activations. The first backward of a graph times
every node of the (not yet rewritten) graph with an ``fx.Interpreter``,
attributes each node's time to the next parameter gradient the graph produces
(DDP's gradient-ready order: that gradient's "layer"), measures the link with
the same all-reduce probes as ``deft_compile()``'s profiler, agrees the
numbers across ranks (element-wise maximum, so every rank solves the same
problem) and calls ``deft_compile.planner.solvers.solve(profile, "deft")`` with
the period fixed to 1. Buckets the plan delays (d=1) become delayed buckets of
this backend (their gradient is applied one step late, exactly as
``delay=``); the forward time of the graph (timed on its last forward call)
is the forward knapsack's capacity. Then the rewritten graphs are built and
lowered as for ``wfbp``, and this and every later call runs them.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Mapping

import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn

from deft_compile.backend.options import BackendOptions
from deft_compile.backend.passes import gradient_outputs, gradient_ready_order
from deft_compile.planner.plan import LinkCost, ParamProfile, Plan, Profile
from deft_compile.planner.solvers import solve


class ForwardTimer:
    """Wraps a boxed forward callable; remembers how long its last call took (ms)."""

    def __init__(self, forward: Callable[[list[Any]], Any]) -> None:
        self._boxed_call = True
        self.forward = forward
        self.last_ms = 0.0

    def __call__(self, args: list[Any]) -> Any:
        started = time.perf_counter()
        result = self.forward(args)
        self.last_ms = (time.perf_counter() - started) * 1e3
        return result


class PlannedBackward:
    """Boxed backward callable for ``policy="deft"``: plans on the first call, then runs what ``build`` made."""

    def __init__(
        self,
        bw: fx.GraphModule,
        params: Mapping[int, nn.Parameter],
        opts: BackendOptions,
        process_group: dist.ProcessGroup | None,
        forward: ForwardTimer | None,
        build: Callable[[BackendOptions], Callable[[list[Any]], Any]],
    ) -> None:
        self._boxed_call = True
        self.bw = bw
        self.params = dict(params)
        self.opts = opts
        self.process_group = process_group
        self.forward = forward
        self.build = build
        self.plan: Plan | None = None
        self.profile: Profile | None = None
        self._impl: Callable[[list[Any]], Any] | None = None

    def __call__(self, args: list[Any]) -> Any:
        if self._impl is None:
            self.profile = profile_backward(self.bw, list(args), self.params, self.process_group,
                                            forward_ms=self.forward.last_ms if self.forward is not None else 0.0)
            self.plan = solve(self.profile, "deft", first_bucket_bytes=self.opts.first_bucket_bytes,
                              bucket_cap_bytes=self.opts.bucket_cap_bytes, allow_period=False, max_period=1)
            ready = gradient_ready_order(self.bw, sorted(self.params))
            delayed = tuple(self.params[ready[s.param]] for item in self.plan.items if item.delay for s in item.slices)
            opts = dataclasses.replace(self.opts, delay_all=False, delayed_params=delayed,
                                       delayed_ids=frozenset(id(p) for p in delayed))
            self._impl = self.build(opts)
        return self._impl(args)


def profile_backward(
    bw: fx.GraphModule,
    args: list[Any],
    params: Mapping[int, nn.Parameter],
    process_group: dist.ProcessGroup | None,
    *,
    forward_ms: float,
    repeats: int = 2,
) -> Profile:
    """The ``Profile`` of one backward graph: per parameter (in ready order) its backward ms; the link's α, β."""
    from deft_compile.step.profiler import (
        LINK_PROBE_BYTES,
        agree_across_ranks,
        fit_alpha_beta,
        measure_allreduce,
        time_graph_nodes,
    )

    node_ms = time_graph_nodes(bw, args, warmup=1, repeats=repeats)
    ready = gradient_ready_order(bw, sorted(params))
    outputs = gradient_outputs(bw)
    owner = {outputs[p]: p for p in ready}
    backward = {p: 0.0 for p in ready}
    extra, pending = 0.0, 0.0
    seen_first = False
    for node in bw.graph.nodes:
        pending += node_ms.get(node, 0.0)
        if node in owner:
            if not seen_first:
                extra, pending, seen_first = pending, 0.0, True  # loss/head backward before any gradient
            backward[owner[node]] += pending
            pending = 0.0
    profiles = [
        ParamProfile(
            name=f"input{p}", numel=params[p].numel(), dtype=str(params[p].dtype).replace("torch.", ""),
            backward_ms=backward[p], layer=i, bucket_key=f"{params[p].dtype}/{params[p].device}",
        )
        for i, p in enumerate(ready)
    ]
    if process_group is not None:
        samples = measure_allreduce(process_group, LINK_PROBE_BYTES, repeats=3)
        link = LinkCost("default", *fit_alpha_beta(samples))
        world_size = dist.get_world_size(process_group)
    else:
        link, world_size = LinkCost("local", 0.0, 0.0), 1
    profile = Profile(params=profiles, links=[link], world_size=world_size,
                      extra_forward_ms=forward_ms, extra_backward_ms=extra, name="backend")
    if process_group is not None:
        profile = agree_across_ranks(profile, process_group)
    return profile
