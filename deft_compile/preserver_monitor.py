"""Measures the Preserver's signals around compiled steps and applies its decisions.

Kept apart from :mod:`deft_compile.preserver` (pure decisions) and from the
runtime (graphs): this module knows which tensors to look at. Costs per step
are one ``loss.item()``; at the end of each check window it reads the applied
gradients of the delayed items in two consecutive steps (one subtraction and
two norms per delayed parameter) and all-reduces two numbers (loss sum and
count) so every rank decides on the same mean loss.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from deft_compile.preserver import Preserver, PreserverEvent

if TYPE_CHECKING:
    from deft_compile.runtime import CompiledStep


class PreserverMonitor:
    def __init__(self, step: "CompiledStep", preserver: Preserver) -> None:
        self.step = step
        self.preserver = preserver
        self.config = preserver.config
        self._loss_sum = 0.0
        self._loss_count = 0
        self._previous: dict[int, torch.Tensor] = {}
        self._recent_losses: list[float] = []
        self._probe: dict | None = None

    def _delayed_items(self) -> dict[int, list[int]]:
        """Item id -> captured parameter indices, for items delayed by one step with no period."""
        return {
            item.id: item.params for item in self.step._items if item.apply == "next-update" and item.period == 1
        }

    def _gradients(self, params: list[int]) -> dict[int, torch.Tensor]:
        live = self.step.graph.captured.model_state.params
        return {p: live[p].grad for p in params if live[p].grad is not None}

    def _drifts(self) -> dict[int, float]:
        drifts = {}
        for item, params in self._delayed_items().items():
            now = self._gradients(params)
            if not now or any(p not in self._previous for p in now):
                continue
            difference = math.sqrt(sum(float((now[p] - self._previous[p]).square().sum()) for p in now))
            norm = math.sqrt(sum(float(now[p].square().sum()) for p in now))
            if norm > 0:
                drifts[item] = difference / norm
        return drifts

    def _all_rank_mean(self, values: list[float]) -> list[float]:
        tensor = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(tensor, group=self.step._process_group)
        return (tensor / self.step.world_size).tolist()

    def after_step(self, loss: torch.Tensor) -> PreserverEvent | None:
        """Called after every step; may re-plan (through ``CompiledStep.switch_plan``)."""
        value = float(loss)
        step_count = self.step.step_count  # steps done, including this one
        if self._probe is not None:
            return self._during_probe(value, step_count)
        self._recent_losses = (self._recent_losses + [value])[-self.config.probe_window :]
        self._loss_sum += value
        self._loss_count += 1
        event = None
        if step_count % self.config.check_every == 0:
            drifts = self._drifts()
            mean_loss = self._all_rank_mean([self._loss_sum / self._loss_count])[0]
            self._loss_sum, self._loss_count = 0.0, 0
            event = self.preserver.observe_window(step_count, mean_loss, drifts)
            if event is not None:
                self._apply(event)
        elif (step_count + 1) % self.config.check_every == 0:
            # Keep the gradients applied in the step before a window ends, to measure drift against.
            self._previous = {
                p: g for params in self._delayed_items().values() for p, g in self._gradients(params).items()
            }
        if (
            event is None
            and self.config.probe_every > 0
            and step_count % self.config.probe_every == 0
            and not self.preserver.exhausted
            and len(self._recent_losses) == self.config.probe_window
        ):
            self._probe = {"plan_losses": list(self._recent_losses), "sync_losses": [], "options": self.preserver.options}
            self.step.switch_plan({**self.preserver.options, "max_staleness": 0, "allow_period": False},
                                  "Preserver probe: synchronous reference window")
        return event

    def _during_probe(self, value: float, step_count: int) -> PreserverEvent | None:
        probe = self._probe
        probe["sync_losses"].append(value)
        if len(probe["sync_losses"]) < self.config.probe_window:
            return None
        self._probe = None
        window = self.config.probe_window
        means = self._all_rank_mean(probe["plan_losses"] + probe["sync_losses"])
        event = self.preserver.observe_probe(step_count, means[:window], means[window:])
        if event is not None:
            self._apply(event)
        else:
            self.step.switch_plan(self.preserver.options, "Preserver probe over: back to the plan")
        self._recent_losses = []
        return event

    def _apply(self, event: PreserverEvent) -> None:
        """Switch to the event's plan; a level whose plan is the same as the current one is skipped."""
        current = self.step.plan.hash()
        while self.step.solve(self.preserver.options).hash() == current and not self.preserver.exhausted:
            self.preserver._step_down(event.step, "the plan did not change at that level", event.metrics)
        self.step.switch_plan(self.preserver.options, self.preserver.history[-1].reason)
