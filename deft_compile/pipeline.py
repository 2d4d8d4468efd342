"""Turn a captured step into the graph that runs: the ordered pass list of each policy.

As in torchtitan's graph trainer, a policy is an ordered list of named passes,
each a plain ``GraphModule -> GraphModule`` function (context bound with
``functools.partial``). ``run_passes`` applies them in order and hands every
intermediate graph to the dumper.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch.fx as fx

from deft_compile.annotate import StepAnnotation, annotate
from deft_compile.bucketing import assign_buckets
from deft_compile.capture import CapturedStep
from deft_compile.config import DeftConfig
from deft_compile.dump import GraphDumper
from deft_compile.passes.broadcast_buffers import insert_buffer_broadcast
from deft_compile.passes.bucket_allreduce import insert_bucket_allreduce
from deft_compile.passes.cleanup import remove_detach, remove_profiler_ops
from deft_compile.passes.markers import strip_markers
from deft_compile.passes.optimizer_numerics import promote_bias_corrections

Pass = Callable[[fx.GraphModule], fx.GraphModule]
POLICIES = ("wfbp",)


@dataclass(frozen=True)
class CommGroup:
    """The process group a step communicates over, by name (what functional collectives take)."""

    name: str
    rank: int
    world_size: int


@dataclass
class CompiledGraph:
    """A rewritten step graph plus what the runtime needs to call it."""

    captured: CapturedStep
    graph_module: fx.GraphModule
    buckets: list[list[int]]

    def collective_signature(self) -> list[tuple[int, ...]]:
        """Per bucket, the numel of each member: what ranks must agree on to communicate."""
        params = self.captured.model_state.params
        return [tuple(params[i].numel() for i in bucket) for bucket in self.buckets]


def annotate_capture(captured: CapturedStep) -> StepAnnotation:
    states_by_param: dict[int, list[fx.Node]] = {}
    for (index, _key), node in zip(captured.state_inputs, captured.state_placeholders()):
        states_by_param.setdefault(index, []).append(node)
    return annotate(captured.graph_module.graph, captured.param_placeholders(), states_by_param)


def ddp_buckets(captured: CapturedStep, annotation: StepAnnotation, config: DeftConfig) -> list[list[int]]:
    """DDP buckets over the parameters the optimizer updates, in gradient-ready order."""
    ready = annotation.gradient_ready_order()
    params = captured.model_state.params
    sizes = [params[i].numel() * params[i].element_size() for i in ready]
    keys = [(params[i].dtype, params[i].device) for i in ready]
    buckets = assign_buckets(
        sizes, keys, first_bucket_bytes=config.first_bucket_bytes, bucket_cap_bytes=config.bucket_cap_bytes
    )
    return [[ready[i] for i in bucket] for bucket in buckets]


def build_passes(
    policy: str, captured: CapturedStep, buckets: list[list[int]], group: CommGroup | None, config: DeftConfig
) -> list[tuple[str, Pass]]:
    """The ordered passes of ``policy``; no collectives when ``group`` is None (one process)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; available: {', '.join(POLICIES)}")
    passes: list[tuple[str, Pass]] = [
        ("remove_profiler_ops", remove_profiler_ops),
        ("remove_detach", remove_detach),
        ("promote_bias_corrections", promote_bias_corrections),
    ]
    if group is not None and group.world_size > 1:
        if config.broadcast_buffers and captured.num_buffers:
            positions = list(range(captured.num_params, captured.num_params + captured.num_buffers))
            passes.append(
                ("broadcast_buffers", functools.partial(insert_buffer_broadcast, buffer_positions=positions, group_name=group.name))
            )
        passes.append(
            (
                "bucket_allreduce",
                functools.partial(
                    insert_bucket_allreduce, buckets=buckets, group_name=group.name, world_size=group.world_size
                ),
            )
        )
    passes.append(("strip_markers", strip_markers))
    return passes


def run_passes(gm: fx.GraphModule, passes: list[tuple[str, Pass]], dumper: GraphDumper) -> fx.GraphModule:
    dumper.record("captured", gm)
    for name, graph_pass in passes:
        gm = graph_pass(gm)
        dumper.record(name, gm)
    return gm


def compile_captured(
    captured: CapturedStep, policy: str, group: CommGroup | None, config: DeftConfig, dumper: GraphDumper
) -> CompiledGraph:
    annotation = annotate_capture(captured)
    buckets = ddp_buckets(captured, annotation, config) if group is not None and group.world_size > 1 else []
    passes = build_passes(policy, captured, buckets, group, config)
    gm = run_passes(captured.graph_module, passes, dumper)
    return CompiledGraph(captured=captured, graph_module=gm, buckets=buckets)
