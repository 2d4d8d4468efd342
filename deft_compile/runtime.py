"""The compiled step object users call once per training step."""

from __future__ import annotations

import collections
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from deft_compile.capture import CapturedStep, StateSlot, capture_step, split_user_inputs
from deft_compile.config import DeftConfig
from deft_compile.distributed import (
    broadcast_from_rank0,
    check_same_across_ranks,
    diagnose_peer_failure,
    model_fingerprint,
    resolve_group,
)
from deft_compile.dump import GraphDumper
from deft_compile.errors import DeftError
from deft_compile.optim_support import check_optimizer, hyperparameter_key
from deft_compile.pipeline import POLICIES, CompiledGraph, compile_captured

log = logging.getLogger("deft_compile")


class CompiledStep:
    """One call = forward, loss, backward, gradient averaging and the optimizer update.

    Graphs are cached by everything that changes what is traced: the shapes,
    dtypes and devices of the tensor inputs, non-tensor inputs, the train/eval
    mode of every module, the optimizer's hyper-parameters, and which optimizer
    state already exists (the first step creates it). A new key retraces, so a
    changed input shape or a learning-rate change never reuses a stale graph.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable[..., torch.Tensor] | None,
        *,
        policy: str,
        config: DeftConfig,
        process_group: dist.ProcessGroup | None,
        dump_dir: str | os.PathLike | None,
    ) -> None:
        check_optimizer(optimizer)
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; available: {', '.join(POLICIES)}")
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.policy = policy
        self.config = config
        self.dump_dir = Path(dump_dir) if dump_dir is not None else None
        self.comm_group, self._process_group = resolve_group(process_group)
        self._graphs: collections.OrderedDict[tuple, CompiledGraph] = collections.OrderedDict()
        self._verified_signature: list | None = None
        self.step_count = 0
        self.trace_count = 0
        self.last_trace_seconds = 0.0
        if self._process_group is not None:
            if config.check_consistency:
                self._check_model_across_ranks()
            broadcast_from_rank0(list(model.parameters()) + list(model.buffers()), self._process_group)

    @property
    def world_size(self) -> int:
        return self.comm_group.world_size if self.comm_group is not None else 1

    @property
    def graph(self) -> CompiledGraph | None:
        """The graph used by the most recent step."""
        return next(reversed(self._graphs.values()), None)

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        user_tensors, constants, spec = split_user_inputs(args, kwargs)
        key = self._cache_key(user_tensors, constants, spec)
        compiled = self._graphs.get(key)
        if compiled is None:
            compiled = self._compile(key, args, kwargs)
        else:
            self._graphs.move_to_end(key)
        captured = compiled.captured
        inputs = self._graph_inputs(captured, user_tensors)
        params = captured.model_state.params
        for p in params:  # like zero_grad(set_to_none=True): the graph computes fresh gradients
            p.grad = None
        try:
            with torch.no_grad():
                outputs = compiled.graph_module(*inputs)
        except Exception as exc:
            if self._process_group is not None and _looks_like_collective_failure(exc):
                raise diagnose_peer_failure(
                    exc, self._process_group, self.step_count, self.config.peer_check_timeout_s
                ) from exc
            raise
        new_state = outputs[1 : 1 + len(captured.state_outputs)]
        gradients = outputs[1 + len(captured.state_outputs) :]
        for (index, key_name), tensor in zip(captured.state_outputs, new_state):
            self.optimizer.state[params[index]][key_name] = tensor
        for index, entries in captured.extra_state.items():
            self.optimizer.state[params[index]].update(entries)
        for index, gradient in zip(captured.gradient_outputs, gradients):
            params[index].grad = gradient
        self.step_count += 1
        return outputs[0]

    def _cache_key(self, user_tensors: list[torch.Tensor], constants: list[Any], spec: Any) -> tuple:
        tensor_key = tuple((tuple(t.shape), t.dtype, t.device, t.requires_grad) for t in user_tensors)
        modes = tuple(m.training for m in self.model.modules())
        return (
            tensor_key,
            repr(constants),
            repr(spec),
            modes,
            hyperparameter_key(self.optimizer),
            tuple(self._existing_state_slots()),
        )

    def _existing_state_slots(self) -> list[StateSlot]:
        slots = []
        for index, p in enumerate(self.model.parameters()):
            for key, value in self.optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    slots.append((index, key))
        return slots

    def _compile(self, key: tuple, args: tuple, kwargs: dict) -> CompiledGraph:
        started = time.perf_counter()
        captured = capture_step(self.model, self.optimizer, self.loss_fn, args, kwargs, self._existing_state_slots())
        dump_dir = self.dump_dir / f"graph_{self.trace_count:02d}" if self.dump_dir is not None else None
        compiled = compile_captured(captured, self.policy, self.comm_group, self.config, GraphDumper(dump_dir))
        self.trace_count += 1
        self.last_trace_seconds = time.perf_counter() - started
        log.info(
            "captured step graph %d (%d nodes, %d buckets) in %.2f s",
            self.trace_count, len(compiled.graph_module.graph.nodes), len(compiled.buckets), self.last_trace_seconds,
        )
        if self.trace_count > 1:
            log.info("retraced because the input shapes, module modes, optimizer hyper-parameters or state changed")
        self._verify_across_ranks(compiled)
        self._graphs[key] = compiled
        while len(self._graphs) > self.config.max_cached_graphs:
            self._graphs.popitem(last=False)
        return compiled

    def _check_model_across_ranks(self) -> None:
        """Before anything is broadcast: same parameters, buffers, optimizer layout and policy everywhere."""
        names = {p: n for n, p in self.model.named_parameters()}
        check_same_across_ranks(
            {
                "parameters": model_fingerprint(self.model.named_parameters()),
                "buffers": model_fingerprint(self.model.named_buffers()),
                "optimizer": type(self.optimizer).__name__,
                "param groups": [[names.get(p, "?") for p in g["params"]] for g in self.optimizer.param_groups],
                "optimizer hyper-parameters": repr(hyperparameter_key(self.optimizer)),
                "policy": self.policy,
            },
            self._process_group,
        )

    def _verify_across_ranks(self, compiled: CompiledGraph) -> None:
        """Check once, before the first collective, that every rank will run the same communication.

        Later graphs (new input shapes) are compared locally with the verified
        collective schedule, because a cross-rank check at that point could
        deadlock against a rank that did not retrace.
        """
        if self._process_group is None:
            return
        signature = compiled.collective_signature()
        if self._verified_signature is None:
            if self.config.check_consistency:
                check_same_across_ranks({"gradient buckets": signature}, self._process_group)
            self._verified_signature = signature
        elif signature != self._verified_signature:
            raise DeftError(
                "the retraced step communicates different gradient buckets than the first one "
                f"({len(signature)} vs {len(self._verified_signature)} buckets); ranks could run mismatched "
                "collectives. This happens when a new input shape or module mode changes which parameters get "
                "gradients; keep that the same on every rank and every step"
            )

    def _graph_inputs(self, captured: CapturedStep, user_tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        params = captured.model_state.params
        state = [self.optimizer.state[params[index]][key] for index, key in captured.state_inputs]
        return [*params, *captured.model_state.buffers, *state, *user_tensors]


def _looks_like_collective_failure(exc: BaseException) -> bool:
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc).lower()
    return any(word in text for word in ("gloo", "nccl", "connection", "timed out", "timeout", "peer"))
