"""The compiled step's process groups: the data-parallel group, the extra links, the side group, and the group a
policy picks for one step.

- The data-parallel group is the one given, else the default group; none when training is local (no process
  group, or world size 1).
- Opening (``StepGroups.open``, once, at construction): the model, optimizer and policy are compared across
  ranks (``check_consistency``), rank 0's parameters and buffers are broadcast, the links of
  ``DeftConfig.links`` are opened, and the side group (``open_side_group``: the buffer broadcast and the
  control all-reduces) where the step broadcasts buffers or runs controllers that agree across ranks, unless the
  policy picks its own group every step (DS-Sync broadcasts within that group).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from deft_compile.step.distributed import (
    broadcast_from_rank0,
    check_same_across_ranks,
    comm_group_of,
    group_timeout,
    model_fingerprint,
    open_side_group,
    resolve_group,
)
from deft_compile.step.links import open_link
from deft_compile.step.optim_support import hyperparameter_key
from deft_compile.step.pipeline import CommGroup

log = logging.getLogger("deft_compile")


class StepGroups:
    """Which process groups the step communicates over."""

    def __init__(self, process_group: dist.ProcessGroup | None) -> None:
        self.comm_group, self.process_group = resolve_group(process_group)
        self.links: list[tuple[str, dist.ProcessGroup]] = []  # (spec, group); the data-parallel group first
        self.side_group: dist.ProcessGroup | None = None  # buffer broadcast and control all-reduces
        self.buffer_group: CommGroup | None = None  # the side group, when the step broadcasts buffers
        self.step_group: CommGroup | None = None  # the group this step's items use, when the policy picks one

    @property
    def world_size(self) -> int:
        return self.comm_group.world_size if self.comm_group is not None else 1

    @property
    def control_group(self) -> dist.ProcessGroup | None:
        """The side group where the step has one, else the data-parallel group."""
        return self.side_group if self.side_group is not None else self.process_group

    def open(self, model: nn.Module, optimizer: torch.optim.Optimizer, policy: str, config: Any, *,
             controllers: bool, picks_groups: bool) -> None:
        """Check the model across ranks, broadcast rank 0's parameters and buffers, open the links and the side
        group. ``controllers``: the step runs controllers whose all-reduces go on the side group (the closed loop,
        the Preserver); ``picks_groups``: the policy picks a group of its own every step."""
        if self.process_group is None:
            if config.links:
                log.warning("DeftConfig.links is ignored: training is local (no process group or world size 1)")
            return
        if config.check_consistency:
            check_model_across_ranks(model, optimizer, policy, self.process_group)
        broadcast_from_rank0(list(model.parameters()) + list(model.buffers()), self.process_group)
        ranks = dist.get_process_group_ranks(self.process_group)
        self.links = [("default", self.process_group)] + [
            (spec, open_link(spec, ranks=ranks, timeout=group_timeout(self.process_group))) for spec in config.links
        ]
        buffers = config.broadcast_buffers and any(buffer.numel() for buffer in model.buffers())
        if not picks_groups and (buffers or controllers):
            self.side_group = open_side_group(self.process_group)
            self.buffer_group = comm_group_of(self.side_group) if buffers else None

    def link_groups(self) -> list[CommGroup]:
        """Every link's group as the passes name it, the data-parallel group first."""
        return [CommGroup(name=pg.group_name, rank=dist.get_rank(pg), world_size=dist.get_world_size(pg))
                for _, pg in self.links]


def check_model_across_ranks(model: nn.Module, optimizer: torch.optim.Optimizer, policy: str,
                             group: dist.ProcessGroup) -> None:
    """Before anything is broadcast: same parameters, buffers, optimizer layout and policy everywhere."""
    names = {p: n for n, p in model.named_parameters()}
    check_same_across_ranks(
        {
            "parameters": model_fingerprint(model.named_parameters()),
            "buffers": model_fingerprint(model.named_buffers()),
            "optimizer": type(optimizer).__name__,
            "param groups": [[names.get(p, "?") for p in g["params"]] for g in optimizer.param_groups],
            "optimizer hyper-parameters": repr(hyperparameter_key(optimizer)),
            "learning rates": [float(g["lr"]) for g in optimizer.param_groups],
            "policy": policy,
        },
        group,
    )
