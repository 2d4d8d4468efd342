"""The compiled step object users call once per training step.

``CompiledStep`` puts four parts together and keeps the attributes users, docs and tests read on one object:

- ``StepGroups`` (``step.groups``): the process groups, opened once at construction;
- ``StepRunner`` (``step.runner``): calling, flushing, the carried tensors; its ``GraphCache`` (``step.runner.cache``)
  holds the captures and step graphs;
- ``StepPlanning`` (``step.planning``): profile, plan, plan history, ``switch_plan``, the closed loop and the
  Preserver's hookup;
- ``PolicyRuntime`` (``step.policy_runtime``): what the policy does between steps.

One call: plan on the first call (``StepPlanning.plan_first``), let the policy pick this step's group, run the
graph (``StepRunner``), then the after-step hooks: the policy's, the runner's bookkeeping, the Preserver's and
the closed loop's (``StepPlanning.after_step``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from deft_compile.config import DeftConfig
from deft_compile.errors import DeftError
from deft_compile.passes.schedule import ScheduledItem
from deft_compile.planner.plan import Plan, Profile
from deft_compile.planner.solvers import POLICIES
from deft_compile.preserver import Preserver
from deft_compile.step.closed_loop import ClosedLoop
from deft_compile.step.compensation import resolve_delayed_update
from deft_compile.step.distributed import names_lost_peers
from deft_compile.step.input_checks import StepInputChecks, checks_inputs
from deft_compile.step.groups import StepGroups
from deft_compile.step.loss_scaling import LossScaler
from deft_compile.step.lowering import StepLowering
from deft_compile.step.optim_support import check_optimizer
from deft_compile.step.pipeline import CommGroup, CompiledGraph
from deft_compile.step.planning import StepPlanning
from deft_compile.step.policy_runtime import PolicyRuntime, runtime_for
from deft_compile.step.runner import StepRunner, carried_hyperparameters
from deft_compile.step.step_timer import StepTimer
from deft_compile.timing import clock_for

log = logging.getLogger("deft_compile")


class CompiledStep:
    """One call = forward, loss, backward, gradient communication and the optimizer update.

    Graphs are cached by everything that changes what is traced: the shapes,
    dtypes and devices of the tensor inputs, non-tensor inputs, the train/eval
    mode of every module, the optimizer's hyper-parameters, which optimizer
    state already exists (the first step creates it), and whether the previous
    step left pending communication ("carries"). A new key retraces, so a
    changed input shape or a learning-rate change never reuses a stale graph.
    """

    @names_lost_peers  # a collective failing in any of these names the ranks that are gone (PeerFailureError)
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
        profile: Profile | None = None,
    ) -> None:
        check_optimizer(optimizer)
        # the semantics this step runs ("auto" resolved for the optimizer; an explicit "compensated" it does not
        # cover is refused before anything runs): every part reads the resolved config
        config = dataclasses.replace(config, delayed_update=resolve_delayed_update(config.delayed_update, optimizer))
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; available: {', '.join(POLICIES)}")
        policy_runtime = runtime_for(policy)
        policy_runtime.check_config(policy, config)
        self.model = model
        self.optimizer = optimizer
        self.input_checks = StepInputChecks(model)  # what each call checks (step/input_checks.py)
        self.loss_fn = loss_fn
        self.policy = policy
        self.policy_runtime: PolicyRuntime = policy_runtime  # what the policy does between steps
        self.config = config
        self.dump_dir = Path(dump_dir) if dump_dir is not None else None
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self.loss_scaler: LossScaler | None = LossScaler.from_config(config.loss_scale, device)
        self.clock = clock_for(device)  # the step's device clock (deft_compile.timing): events on a GPU, the host's on a CPU
        self.lowering = StepLowering(config.compiler)  # Inductor or aten (deft_compile/step/lowering.py)
        self.groups = StepGroups(process_group)
        self.runner = StepRunner(model, optimizer, loss_fn, config, self.groups, self.loss_scaler, self.lowering,
                                 self.dump_dir, policy_runtime.record_stats)
        self.planning = StepPlanning(policy, policy_runtime, config, self.groups, self.runner, self.loss_scaler,
                                     self.dump_dir, profile, model=model, optimizer=optimizer, loss_fn=loss_fn)
        self._timer = StepTimer(self.lowering, cpu_timed=device.type == "cpu")
        self.groups.open(model, optimizer, policy, config, controllers=self.planning.has_controllers(),
                         picks_groups=policy_runtime.picks_groups)
        if self.groups.comm_group is not None:  # the ranks of one host compile each region once between them
            self.lowering.share_compiles(self.groups.comm_group.rank, self.groups.comm_group.world_size)

    @names_lost_peers
    @checks_inputs  # the model as captured; a failure on changed inputs names them (step/input_checks.py)
    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        runner, planning = self.runner, self.planning
        if runner.cache.capture_count == 0:
            planning.before_first_capture(args, kwargs)  # the optimizer's state, before the step is captured
        if not runner.items and (self.comm_group is not None or self.config.accumulation_steps > 1):
            planning.plan_first(args, kwargs)  # its capture stays cached for this call's compile
        if self.comm_group is not None:
            runner.use_step_group(self.policy_runtime.step_group(planning.handle))
        compiled, user_tensors, phases = runner.prepare(args, kwargs, planning.plan)
        planning.before_step()
        self._timer.start(self.clock, device_clock=planning.closed_loop is not None)
        outputs = runner.run_step(compiled, user_tensors, planning.plan)
        self.policy_runtime.after_step(planning.handle)
        runner.finish_call(phases, args, kwargs)
        planning.after_step(outputs, args, kwargs, self._timer.stop())
        return outputs

    # -- planning -------------------------------------------------------------------------------
    @property
    def plan(self) -> Plan | None:
        """The plan that runs (None before the first call of a distributed step)."""
        return self.planning.plan

    @property
    def profile(self) -> Profile | None:
        """The profile the plan was solved from (refined by the closed loop as it measures)."""
        return self.planning.profile

    @property
    def plan_history(self) -> list[dict[str, Any]]:
        """Every plan that ran, with the step it started at and why (the closed loop's measurements with it)."""
        return self.planning.plan_history

    @property
    def plan_switches(self) -> int:
        """Calls of ``switch_plan`` so far."""
        return self.planning.plan_switches

    @property
    def delayed_update(self) -> str:
        """The delayed semantics this step runs: ``"compensated"``, ``"averaged"`` or ``"local"``
        (``DeftConfig.delayed_update``, with ``"auto"`` resolved for the optimizer)."""
        return self.config.delayed_update

    @property
    def closed_loop(self) -> ClosedLoop | None:
        """Closed-loop planning (``step.closed_loop``), where it runs."""
        return self.planning.closed_loop

    @property
    def preserver(self) -> Preserver | None:
        """The Preserver watching this step's plan (policies it watches, with a process group), or None."""
        return self.planning.preserver

    @names_lost_peers
    def switch_plan(self, options: dict[str, Any], reason: str, plan: Plan | None = None, record: bool = True) -> None:
        """Re-solve with ``options`` (or take ``plan``) and use it from the next step; pending gradients are flushed first.

        Every rank must call it at the same step with the same options (the
        Preserver's signals are identical on all ranks, so its calls are).
        ``record=False`` (the closed loop's duel, which switches back and forth
        between two plans and records its verdict once) leaves ``plan_history``,
        the plan table in the log and the dumped plan artifacts alone.
        """
        self.planning.switch_plan(options, reason, plan=plan, record=record)

    def solve(self, options: dict[str, Any]) -> Plan:
        """The plan this step's policy gives for its profile with solver ``options`` (nothing changes)."""
        return self.planning.solve(options)

    def solver_options(self) -> dict[str, Any]:
        """The solver options of this step's own plan: the user's ``plan_options`` with what the configuration
        implies (DDP bucket sizes, updates that wait for every gradient under clipping or loss scaling)."""
        return self.planning.solver_options()

    # -- groups -----------------------------------------------------------------------------------
    @property
    def comm_group(self) -> CommGroup | None:
        """The data-parallel group as the passes name it (None when training is local)."""
        return self.groups.comm_group

    @property
    def world_size(self) -> int:
        return self.groups.world_size

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The data-parallel process group (None when training is local)."""
        return self.groups.process_group

    @property
    def control_group(self) -> dist.ProcessGroup | None:
        """The group for the Preserver's and the closed loop's small all-reduces (losses, measured times): the
        side group (``open_side_group``), so they do not wait behind gradient all-reduces still in flight;
        the data-parallel group where the step has none."""
        return self.groups.control_group

    # -- running ----------------------------------------------------------------------------------
    def updates_at(self, call_index: int) -> bool:
        """Whether call number ``call_index`` (0-based) ends a gradient-accumulation cycle with an update."""
        return self.runner.updates_at(call_index)

    @property
    def step_count(self) -> int:
        """Calls run so far (a resumed step continues its saved count)."""
        return self.runner.step_count

    @property
    def items(self) -> list[ScheduledItem]:
        """The communication items the current plan runs (what the ``schedule`` pass places)."""
        return self.runner.items

    @property
    def carry(self) -> dict[str, torch.Tensor]:
        """Tensors crossing the step boundary (pending communication, accumulations, residuals), by key."""
        return self.runner.carry

    @property
    def pending(self) -> list[int]:
        """Ids of plan items with gradients not yet applied (pending communication or a partial
        accumulation of an update period); the next steps or ``flush`` apply them."""
        return self.runner.pending

    @property
    def graph(self) -> CompiledGraph | None:
        """The graph used by the most recent step."""
        return self.runner.last_graph

    @property
    def compiler(self) -> str | None:
        """What ran the most recent step graph: ``"inductor"`` or ``"aten"`` (None before the first step)."""
        return self.lowering.last.compiler if self.lowering.last is not None else None

    @property
    def last_stats(self) -> dict[str, list[float]]:
        """Per-step statistics of the policy (DLCP: per item ``[chunks sent, dropped mass fraction]``)."""
        return self.policy_runtime.last_stats

    @property
    def last_grad_norm(self) -> torch.Tensor | None:
        """Total gradient norm of the latest clipped update."""
        return self.runner.last_grad_norm

    @property
    def last_update_skipped(self) -> bool:
        """Loss scaling found an inf/NaN in the latest update and skipped it."""
        return self.runner.last_update_skipped

    @property
    def last_call_updated(self) -> bool:
        """The last call applied an optimizer update (False while accumulating)."""
        return self.runner.last_call_updated

    @property
    def last_call_moved_weights(self) -> bool:
        """The last call moved weights (False also for a cycle's end that applied nothing: the first call of a plan
        that moves its updates into the next call, an update skipped for an inf/NaN)."""
        return self.runner.last_call_moved_weights

    @property
    def trace_count(self) -> int:
        """Step graphs built (passes run), one per cache miss."""
        return self.runner.cache.trace_count

    @property
    def capture_count(self) -> int:
        """Of those, the ones that traced the step (make_fx) instead of reusing a capture."""
        return self.runner.cache.capture_count

    @property
    def last_trace_seconds(self) -> float:
        return self.runner.cache.last_trace_seconds

    @property
    def overheads(self) -> dict[str, float | int]:
        """Wall-clock seconds this step spent outside training steps proper: the eager forward and backward
        before the first capture (the optimizer's state, the wire's price), profiling and solving the first plan
        (``planning_seconds``), tracing the step, or its update alone, with ``make_fx`` (``capture_seconds``),
        copying the capture and running the passes per step graph (``graph_seconds``; not the Inductor compile,
        which ``compile_seconds`` sums from ``lowering.history``), the Preserver's staleness measurements
        (``probe_seconds``) and its copies and paired replays for loss signals (``attribution_seconds``); with the
        counts of graphs built, of whole step traces (``captures``), of captures for new optimizer state that
        traced the update alone (``update_recaptures``), and of the Preserver's measurements by kind
        (``staleness_probes``: two eager passes each, ``wire_probes``: one)."""
        monitor = self.planning.monitor
        return {
            "planning_seconds": self.planning.seconds,
            "capture_seconds": self.runner.cache.capture_seconds,
            "graph_seconds": self.runner.cache.graph_seconds,
            "probe_seconds": monitor.probe_seconds if monitor is not None else 0.0,
            "attribution_seconds": monitor.attribution_seconds if monitor is not None else 0.0,
            "compile_seconds": sum(entry.get("seconds", 0.0) for entry in self.lowering.history),
            "graphs": self.runner.cache.trace_count,
            "captures": self.runner.cache.capture_count,
            "update_recaptures": self.runner.cache.update_recaptures,
            "staleness_probes": monitor.measurements["staleness"] if monitor is not None else 0,
            "wire_probes": monitor.measurements["wire"] if monitor is not None else 0,
        }

    @names_lost_peers
    def flush(self) -> None:
        """Apply every pending update now (delayed gradients, updates deferred to the next forward).

        After ``flush`` the model holds every gradient computed so far; the next
        step starts like a first step of the pending items. Without pending
        communication this does nothing. With ``delayed_update="local"`` the
        replicas of the delayed buckets' parameters (and their optimizer state)
        are averaged across ranks instead: identical again, and for SGD exactly
        the parameters the pending correction would give.
        """
        self.planning.flush()

    # -- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Step counter, plan, profile and pending gradients (waited, so they can be saved). No communication:
        callable on one rank. With ``delayed_update="local"`` each rank holds its own replica and pending local
        gradient; call ``flush()`` on every rank first for a checkpoint that every rank shares exactly."""
        pending = self.runner.saved_carry()
        planning = self.planning.state_dict()
        return {
            "step_count": self.runner.step_count,
            "policy": self.policy,
            "plan": planning["plan"],
            "profile": planning["profile"],
            "pending": pending,
            "accumulated": dict(self.runner.accumulated),
            "preserver": planning["preserver"],
            "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the loaded plan is used as is (no re-profiling), pending gradients continue."""
        if state["policy"] != self.policy:
            raise DeftError(f"state was saved with policy {state['policy']!r}, this step uses {self.policy!r}")
        self.runner.step_count = int(state["step_count"])
        self.planning.load_plan(state)
        self.runner.carry = carried_hyperparameters({str(k): v.clone() for k, v in state["pending"].items()},
                                                    self.runner.optimizer)
        self.runner.accumulated = {int(k): int(v) for k, v in state.get("accumulated", {}).items()}
        if state.get("loss_scaler") is not None and self.loss_scaler is not None:
            self.loss_scaler.load_state_dict(state["loss_scaler"])
        self.planning.load_preserver(state.get("preserver"))
