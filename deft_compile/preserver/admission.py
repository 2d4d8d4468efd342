"""The paired replay that admits plain delays (``delayed_update`` "averaged" or "local"; the rule is
``deft_compile.preserver.verdict.admits_plain``).

Plain delays are not admitted on their price: measured on the time-to-accuracy GPT-2, a price of 1.2-2.2 ms per
step hid a 3-5 % final-loss cost. When the trade proposes them (:mod:`deft_compile.preserver.trade`), the step
keeps running synchronously while this module copies the trained parameters, buffers and optimizer state
(``attribution.Snapshot``) before the next updating call and keeps the next ``admission_steps`` minibatches. Each
rank then replays them locally twice from the copy (``attribution.replay``): with the proposal's delays and
periods, and synchronously. Same start, same data, same dropout masks; the delayed arm's final loss is held
against the synchronous arm's loss its lag earlier (``attribution.lag_steps``), both over the last kept
minibatches, as all-rank means (one all-reduce on the step's control group), so every rank decides alike.

Cost: one copy and, per arm, one eager forward and backward per kept minibatch plus the evaluation forwards. It is
taken out of the loss attribution's budget (``PreserverConfig.attribution_budget``, ``preserver.budget``): the
copy is taken only once the agreed budget affords the copy and the replay, checked at every ``check_every``-th
step (one all-reduce of five numbers); until then the proposal waits and the step stays synchronous.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from deft_compile.preserver.attribution import Schedule, Snapshot, kept_batch, lag_steps, loss_over, replay
from deft_compile.preserver.budget import AttributionBudget
from deft_compile.timing import comm_device

#: minibatches (the last kept ones) over which the two arms are compared
EVALUATION_BATCHES = 10


class PlainAdmission:
    """One proposal of plain delays at a time: wait for the budget, copy, keep minibatches, replay both arms.

    ``budget`` is the monitor's ``AttributionBudget`` (this replay spends from it); ``steps``: the minibatches
    replayed (``PreserverConfig.admission_steps``); ``check_every``: how often the budget is agreed."""

    def __init__(self, budget: AttributionBudget, steps: int, check_every: int) -> None:
        self.budget = budget
        self.steps = steps
        self.check_every = max(1, check_every)
        self.schedule: Schedule | None = None
        self._copy_now = False
        self._snapshot: Snapshot | None = None
        self._batches: list[tuple[tuple, dict[str, Any]]] = []
        self.seconds = 0.0  # copies, kept minibatches and replays of every admission so far

    def request(self, schedule: Schedule) -> None:
        """Replay ``schedule`` against synchronous training once the budget affords it."""
        self.schedule = dict(schedule)
        self._copy_now, self._snapshot, self._batches = False, None, []

    def _shape(self) -> tuple[int, int, int]:
        """(steps each arm trains, the step the synchronous arm is evaluated after (its lag earlier), minibatches
        each arm is evaluated on)."""
        lag = lag_steps([self.schedule or {}])
        return self.steps, max(0, self.steps - lag), min(self.steps, EVALUATION_BATCHES)

    def _affordable(self, step: Any) -> bool:
        """Whether the agreed budget (every rank's numbers averaged) affords the copy and the replay."""
        tensor = torch.tensor(self.budget.numbers(), dtype=torch.float64, device=comm_device(step.control_group))
        dist.all_reduce(tensor, group=step.control_group)
        agreed = self.budget.agreed((tensor / step.world_size).tolist())
        trained, _lagged, evaluated = self._shape()
        return agreed.affords(agreed.copy_seconds + agreed.replay_seconds(2 * trained, 2 * evaluated))

    def before_step(self, step: Any) -> None:
        """Copy the state before this call if the budget was found to afford it (after the last call's check)."""
        if self.schedule is None or self._snapshot is not None or not self._copy_now:
            return
        if not step.updates_at(step.step_count):
            return
        started = time.perf_counter()
        self._snapshot = Snapshot(step.model, step.optimizer)
        self.budget.copy_seconds = time.perf_counter() - started
        self._spend(self.budget.copy_seconds)

    def after_step(self, step: Any, args: tuple, kwargs: dict) -> tuple[float, float, int] | None:
        """Keep this call's minibatch; once ``steps`` are kept, replay both arms and return (the delayed arm's loss,
        the synchronous arm's loss its lag earlier, steps replayed), all-rank means; None until then."""
        if self.schedule is None:
            return None
        if self._snapshot is None:
            if not self._copy_now and step.step_count % self.check_every == 0:
                self._copy_now = self._affordable(step)
            return None
        if not step.last_call_updated:
            return None
        started = time.perf_counter()
        self._batches.append(kept_batch(args, kwargs))
        self._spend(time.perf_counter() - started)
        if len(self._batches) < self.steps:
            return None
        started = time.perf_counter()
        stale, synchronous = self._replay(step)
        trained, _lagged, evaluated = self._shape()
        seconds = time.perf_counter() - started
        self.budget.replayed(seconds, 2 * trained, 2 * evaluated)
        self.seconds += seconds
        self.schedule, self._snapshot, self._batches, self._copy_now = None, None, [], False
        return stale, synchronous, trained

    def _replay(self, step: Any) -> tuple[float, float]:
        batches, snapshot, schedule = self._batches, self._snapshot, self.schedule or {}
        _trained, lagged, evaluate_on = self._shape()
        clip, model, loss_fn = step.config.max_grad_norm, step.model, step.loss_fn
        stale = replay(model, snapshot, loss_fn, batches, schedule, clip, evaluate_on=evaluate_on)[len(batches)]
        if lagged > 0:
            synchronous = replay(model, snapshot, loss_fn, batches, {}, clip, (lagged,), evaluate_on)[lagged]
        else:
            synchronous = loss_over(model, snapshot, snapshot.params, loss_fn, batches[-evaluate_on:])
        tensor = torch.tensor([min(stale, 1e300), min(synchronous, 1e300)], dtype=torch.float64,
                              device=comm_device(step.control_group))
        dist.all_reduce(tensor, group=step.control_group)
        stale, synchronous = (tensor / step.world_size).tolist()
        return stale, synchronous

    def _spend(self, seconds: float) -> None:
        self.budget.spend(seconds)
        self.seconds += seconds
