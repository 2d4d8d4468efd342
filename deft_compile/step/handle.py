"""The narrow view of a compiled step that its controllers get.

The Preserver's monitor (``preserver.monitor.WatchedStep``) and the policy's between-step hooks
(``step.policy_runtime.RunningStep``) read the plan, the counters, the parameters and the carried tensors through
a ``StepHandle`` and change the step only through ``switch_plan``. The handle holds the step's parts (its planning
owner, runner and groups), never the ``CompiledStep`` users call, so no part reaches back into the façade.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from deft_compile.config import DeftConfig
from deft_compile.passes.schedule import ScheduledItem
from deft_compile.planner.plan import Plan, Profile
from deft_compile.step.groups import StepGroups
from deft_compile.step.pipeline import CommGroup, CompiledGraph
from deft_compile.step.runner import StepRunner


class StepHandle:
    """Plan access, ``switch_plan``, the model, its optimizer and loss, the step's counters and carried tensors.

    ``planning``: the step's ``StepPlanning``, which creates the handle (typed loosely: it imports this module)."""

    def __init__(self, planning: Any, runner: StepRunner, groups: StepGroups, model: nn.Module,
                 optimizer: torch.optim.Optimizer, loss_fn: Callable[..., torch.Tensor] | None,
                 config: DeftConfig) -> None:
        self._planning = planning
        self._runner = runner
        self._groups = groups
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.config = config

    # -- the plan ---------------------------------------------------------------------------------
    @property
    def plan(self) -> Plan | None:
        return self._planning.plan

    @property
    def profile(self) -> Profile | None:
        return self._planning.profile

    @property
    def closed_loop(self) -> Any:
        """The closed loop's measurements (``step.closed_loop.ClosedLoop``), where it runs: the trader prices a switch
        and judges a running plan by them."""
        return self._planning.closed_loop

    def solve(self, options: dict[str, Any]) -> Plan:
        return self._planning.solve(options)

    def switch_plan(self, options: dict[str, Any], reason: str, plan: Plan | None = None, record: bool = True) -> None:
        self._planning.switch_plan(options, reason, plan=plan, record=record)

    # -- the calls ----------------------------------------------------------------------------------
    @property
    def step_count(self) -> int:
        return self._runner.step_count

    @property
    def items(self) -> list[ScheduledItem]:
        return self._runner.items

    @property
    def carry(self) -> dict[str, torch.Tensor]:
        return self._runner.carry

    @property
    def graph(self) -> CompiledGraph | None:
        return self._runner.last_graph

    @property
    def last_call_updated(self) -> bool:
        return self._runner.last_call_updated

    @property
    def last_call_moved_weights(self) -> bool:
        return self._runner.last_call_moved_weights

    @property
    def last_trace_seconds(self) -> float:
        return self._runner.cache.last_trace_seconds

    def updates_at(self, call_index: int) -> bool:
        return self._runner.updates_at(call_index)

    # -- the groups ---------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self._groups.world_size

    @property
    def comm_group(self) -> CommGroup | None:
        return self._groups.comm_group

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        return self._groups.process_group

    @property
    def control_group(self) -> dist.ProcessGroup | None:
        return self._groups.control_group
