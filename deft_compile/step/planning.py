"""The compiled step's planning owner: profile, plan, plan history, plan switches, the closed loop and the
Preserver's hookup.

- First call (``plan_first``): the step is captured (the capture stays cached for the call's compile),
  profiled (measured with ``step.profiler`` where the policy's plan needs times or ``always_profile``; sizes
  only otherwise; a profile given is kept), solved (``planner.solvers``), the plan's hash compared across ranks,
  and the plan translated to items on the captured parameters (``step.scheduling``). Local training with
  gradient accumulation gets DDP's buckets on a local group, whose collectives the pipeline removes.
- ``switch_plan`` (the Preserver's and the closed loop's decisions, or a user's): the step flushes pending
  gradients first, every rank checks the new plan's hash, the runner runs the new items from the next call.
- After each call: the Preserver's monitor and then the closed loop see the call (``after_step``); both act
  only through ``switch_plan``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from deft_compile.config import DeftConfig
from deft_compile.debug.artifacts import log_structured, record_plan, write_plan_artifacts
from deft_compile.errors import DeftError
from deft_compile.passes.local_collectives import LOCAL_GROUP
from deft_compile.passes.schedule import APPLY_NEXT_UPDATE, ScheduledItem
from deft_compile.planner.plan import WIRE_FULL, LinkCost, Plan, Profile
from deft_compile.planner.simulator import UPDATE_WAITS_FOR_ALL
from deft_compile.planner.solvers import solve, solve_wfbp
from deft_compile.preserver import Preserver
from deft_compile.preserver.monitor import PreserverMonitor
from deft_compile.preserver.pricing import compute_ms, prior_update_prices
from deft_compile.step.capture import CapturedStep, split_user_inputs
from deft_compile.step.closed_loop import ClosedLoop
from deft_compile.step.distributed import check_same_across_ranks
from deft_compile.step.groups import StepGroups
from deft_compile.step.handle import StepHandle
from deft_compile.step.loss_scaling import LossScaler
from deft_compile.step.pipeline import CommGroup, annotate_capture
from deft_compile.step.policy_runtime import PolicyRuntime
from deft_compile.step.runner import StepRunner
from deft_compile.step.scheduling import ProfileIndex, scheduled_items, static_profile, with_accumulation
from deft_compile.step.step_timer import StepTiming
from deft_compile.timing import comm_device

log = logging.getLogger("deft_compile")

SOLVED_KEPT = 8  # plans ``StepPlanning.solve`` keeps


class StepPlanning:
    """Owns what the step runs: its profile and plan, their history, and the controllers that change them.

    Its controllers (the Preserver's monitor, the policy's hooks) see the step through ``handle``
    (``step/handle.py``): plan access, ``switch_plan``, the model, its optimizer and loss."""

    def __init__(self, policy: str, policy_runtime: PolicyRuntime, config: DeftConfig, groups: StepGroups,
                 runner: StepRunner, loss_scaler: LossScaler | None, dump_dir: Path | None,
                 profile: Profile | None, *, model: nn.Module, optimizer: torch.optim.Optimizer,
                 loss_fn: Callable[..., torch.Tensor] | None) -> None:
        self.policy = policy
        self.policy_runtime = policy_runtime
        self.config = config
        self.groups = groups
        self.runner = runner
        self.loss_scaler = loss_scaler
        self.dump_dir = dump_dir
        self.profile: Profile | None = profile
        self.plan: Plan | None = None
        self.plan_history: list[dict[str, Any]] = []
        # calls of ``switch_plan``: a switch to the plan that already runs changes no hash, and the closed loop must
        # still see that someone decided (the Preserver stepping back to the synchronous plan a duel is timing)
        self.plan_switches = 0
        self.seconds = 0.0  # the eager pass before the first capture, profiling and solving the first plan
        self.monitor: PreserverMonitor | None = None
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.handle = StepHandle(self, runner, groups, model, optimizer, loss_fn, config)
        self._profile_given = profile is not None  # the user's plan: no closed loop, no synchronous start
        self._index: ProfileIndex | None = None
        self._link_groups: list[CommGroup] = []
        self._solved: tuple[Profile | None, dict[str, Plan]] = (None, {})  # ``solve``'s last plans
        self._preserver_state: dict[str, Any] | None = None  # loaded by load_state_dict, for the Preserver
        # the measured price of each 16-bit wire dtype per parameter (``_measure_wire``); every plan of the step
        # is solved with them, so they are saved with the plan
        self.wire_prices: dict[str, dict[str, float]] | None = None
        self.wire_seconds = 0.0  # measuring them (part of ``seconds``)
        # the first call's gradients in the model's parameter order, where ``before_first_capture`` computed them
        self._first_gradients: list[torch.Tensor | None] | None = None
        self._warmed = False  # an eager forward and backward of the step ran before the first capture
        # Closed-loop planning times calls; under gradient accumulation calls of one cycle differ (only the last
        # communicates), so it stays off there (docs/API.md).
        closed_loop = config.closed_loop.active_for(policy, self._profile_given) and config.accumulation_steps == 1
        self.closed_loop = ClosedLoop(config.closed_loop) if closed_loop else None

    # -- what the closed loop reads (step.closed_loop.PlannedStep) ----------------------------------
    @property
    def step_count(self) -> int:
        return self.runner.step_count

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        return self.groups.process_group

    @property
    def control_group(self) -> dist.ProcessGroup | None:
        return self.groups.control_group

    @property
    def preserver(self) -> Preserver | None:
        return self.monitor.preserver if self.monitor is not None else None

    def watched_by_preserver(self) -> bool:
        return self.policy_runtime.watched_by_preserver and self.config.preserver.enabled

    def has_controllers(self) -> bool:
        """Whether controllers agree across ranks after steps (on the step's side group)."""
        return self.closed_loop is not None or self.watched_by_preserver()

    # -- the first plan ----------------------------------------------------------------------------
    def plan_first(self, args: tuple, kwargs: dict) -> None:
        """Profile (unless given or not needed), solve, check the plan hash across ranks, translate to items.
        The capture stays cached: the call that plans compiles from it right after."""
        captured = self.runner.cache.captured(args, kwargs)  # counted in the cache's ``capture_seconds``
        started = time.perf_counter()
        annotation = annotate_capture(captured)
        index = ProfileIndex.of(annotation)
        if self.groups.comm_group is None:
            self._plan_local(captured, index)
            return
        if self.plan is None:
            if self.profile is None:
                self.profile = self._profile(captured, annotation, index, args, kwargs)
                self.wire_prices = self._measure_wire(captured, args, kwargs)
            if len(self.profile.links) != len(self.groups.links):
                raise DeftError(
                    f"the profile describes {len(self.profile.links)} link(s) but this step has "
                    f"{len(self.groups.links)} (the process group plus DeftConfig.links={list(self.config.links)})"
                )
            if self.watched_by_preserver() and self.monitor is None:
                # the Preserver's prior prices (the updates a period skips) shape the first plan already
                self.monitor = PreserverMonitor(self.handle, self._new_preserver())
            options = self.monitor.preserver.options if self.monitor is not None else self.solver_options()
            self.plan = solve(self.profile, self.policy, **options)
            log.info("plan (%s, %s delays):\n%s", self.policy, self.config.delayed_update,
                     self.plan.table(self.profile))
        record_plan(self.profile, self.plan, self.dump_dir if self.groups.comm_group.rank == 0 else None)
        if self.config.check_consistency:
            check_same_across_ranks({"plan": self.plan.hash()}, self.groups.process_group)
        self._index = index
        self._link_groups = self.groups.link_groups()
        self.runner.use_items(self._scheduled(self.plan, index))
        if not self.plan_history:
            self._record_plan("initial plan")
        if self.watched_by_preserver() and self.monitor is None:
            self.monitor = PreserverMonitor(self.handle, self._new_preserver())
        if self._preserver_state is not None and self.monitor is not None:
            self.monitor.load_state_dict(self._preserver_state)  # resumed: continue its decisions
            self._preserver_state = None
        self.seconds += time.perf_counter() - started

    def _profile(self, captured: CapturedStep, annotation, index: ProfileIndex, args: tuple,
                 kwargs: dict) -> Profile:
        """Sizes only where the policy's plan needs no times (and ``always_profile`` is off); measured otherwise."""
        if not self.policy_runtime.needs_profile and not self.config.always_profile:
            links = [LinkCost(name, 0.0, 0.0) for name, _ in self.groups.links]
            return static_profile(captured, index, links, self.groups.world_size)
        from deft_compile.step.profiler import profile_step

        user_tensors, _, _ = split_user_inputs(args, kwargs)
        inputs = self.runner.graph_inputs(captured.graph_module.meta["deft_layout"], captured, user_tensors)
        # the eager pass before the capture ran the model's kernels once: the profile needs no warm-up run of its own
        profile = profile_step(captured, annotation, inputs, self.groups.links, self.groups.world_size,
                               warmup=0 if self._warmed else 1, contention=self.config.contention)
        log.info("profiled the step:\n%s", profile.to_json())
        return profile

    def before_first_capture(self, args: tuple, kwargs: dict) -> None:
        """Called before the step's first capture: where the policy's first call applies every update it
        computes (``PolicyRuntime.first_call_updates``) and nothing can postpone or skip that update (no gradient
        accumulation, no loss scaling), create the optimizer's state its first update would create, for the
        parameters an eager forward and backward of this call gives a gradient (``wire_error.step_gradients``,
        ``optim_support.initialize_state``): the step is then captured once, not again on its second call. Not
        where state exists (a resumed run), nor where the eager pass fails (the capture then reports the
        model's error as it would without it)."""
        optimizer = self.optimizer
        if (self.plan is not None or any(optimizer.state.values()) or self.config.accumulation_steps != 1
                or self.loss_scaler is not None
                or not self.policy_runtime.first_call_updates(self.config, self._profile_given)):
            return
        from deft_compile.preserver.wire_error import step_gradients
        from deft_compile.step.capture import ModelState
        from deft_compile.step.optim_support import initialize_state

        state = ModelState.of(self.model)
        started = time.perf_counter()
        try:
            gradients = step_gradients(self.model, state.param_names, state.params,
                                       dict(zip(state.buffer_names, state.buffers)), self.loss_fn, args, kwargs)
        except Exception:  # noqa: BLE001 - the capture that follows names what is wrong with the step
            return
        finally:
            self.seconds += time.perf_counter() - started
        initialize_state(optimizer, [p for p, g in zip(state.params, gradients) if g is not None])
        self._warmed = True
        if self.groups.comm_group is not None and self.narrows_by_price():
            self._first_gradients = gradients  # the wire's price reads them too (``_measure_wire``)

    def narrows_by_price(self) -> bool:
        """Whether the step chooses each bucket's wire dtype by measured price: a policy whose solver does
        (``PolicyRuntime.chooses_wire``: ``deft``) planning on the profile it measured, with a 16-bit dtype allowed
        (``DeftConfig.wire_dtypes``) and no fixed ``wire_dtype`` asked for."""
        return (self.policy_runtime.chooses_wire and not self._profile_given
                and "wire_dtype" not in self.config.plan_options
                and any(dtype != WIRE_FULL for dtype in self.config.wire_dtypes))

    def _measure_wire(self, captured: CapturedStep, args: tuple, kwargs: dict) -> dict[str, dict[str, float]] | None:
        """The price of each allowed 16-bit wire dtype per parameter (``preserver.wire_pricing``), from this call's
        gradients (``before_first_capture``'s, or one eager forward and backward per rank) and one all-reduce of
        three numbers per parameter and dtype. None where the step does not narrow by price."""
        if not self.narrows_by_price():
            return None
        from deft_compile.preserver.wire_error import cast_error_norms, metric_weights, step_gradients
        from deft_compile.preserver.wire_pricing import wire_prices, wire_shares

        started = time.perf_counter()
        state = captured.model_state
        dtypes = [dtype for dtype in self.config.wire_dtypes if dtype != WIRE_FULL]
        gradients, self._first_gradients = self._first_gradients, None
        if gradients is None:
            gradients = step_gradients(self.model, state.param_names, state.params,
                                       dict(zip(state.buffer_names, state.buffers)), self.loss_fn, args, kwargs)
        by_name = dict(zip(state.param_names, range(len(state.params))))
        names = [param.name for param in self.profile.params if param.name in by_name]
        chosen = [gradients[by_name[name]] for name in names]
        weights = metric_weights(self.optimizer, [state.params[by_name[name]] for name in names], chosen)
        row = cast_error_norms(chosen, self.groups.world_size, dtypes, weights)
        tensor = torch.tensor(row, dtype=torch.float64, device=comm_device(self.groups.process_group))
        dist.all_reduce(tensor, group=self.groups.process_group)
        shares = wire_shares(names, dtypes, tensor.tolist(), self.groups.world_size)
        prices = wire_prices(shares, compute_ms(self.profile), self.config.preserver.staleness_price)
        self.wire_seconds = time.perf_counter() - started
        log.info("wire precision priced in %.2f s (ms per step, all parameters): %s", self.wire_seconds,
                 ", ".join(f"{dtype} {sum(per_param.values()):.3g}" for dtype, per_param in prices.items()))
        return prices

    def _plan_local(self, captured: CapturedStep, index: ProfileIndex) -> None:
        """Without a process group only gradient accumulation needs items: DDP's buckets on ``LOCAL_GROUP``,
        whose collectives the pipeline removes."""
        local = static_profile(captured, index, [LinkCost("local", 0.0, 0.0)], 1)
        options = {"first_bucket_bytes": self.config.first_bucket_bytes, "bucket_cap_bytes": self.config.bucket_cap_bytes}
        plan = solve_wfbp(local, **options)  # DDP's buckets: no communication to schedule
        self.runner.use_items(self._scheduled(plan, index, [CommGroup(name=LOCAL_GROUP, rank=0, world_size=1)], local))

    def _scheduled(self, plan: Plan, index: ProfileIndex, groups: list[CommGroup] | None = None,
                   profile: Profile | None = None) -> list[ScheduledItem]:
        """The plan's items on captured parameters and process groups, with gradient accumulation's period."""
        profile = profile or self.profile
        items = scheduled_items(plan, index, groups or self._link_groups,
                                profile.params[0].element_bytes if profile else 4)
        items = with_accumulation(items, self.config.accumulation_steps)
        if self.config.delayed_update == "local":
            items = [dataclasses.replace(item, local_first=True) if item.apply == APPLY_NEXT_UPDATE and item.period == 1
                     else item for item in items]
        return items

    def _new_preserver(self) -> Preserver:
        options = self.solver_options()
        buckets = self.profile.buckets(options["first_bucket_bytes"], options["bucket_cap_bytes"])
        link = self.profile.links[0]
        costs = [link.cost(sum(self.profile.params[i].nbytes for i in bucket)) for bucket in buckets]
        prior: dict[str, float] = {}
        if self.config.preserver.trade:
            numels = {param.name: param.numel for param in self.profile.params}
            prior = prior_update_prices(numels, compute_ms(self.profile), self.config.preserver.staleness_price)
        return Preserver(
            self.config.preserver,
            base_options=options,
            max_period=int(options.get("max_period", 4)),
            mean_comm_ms=sum(costs) / len(costs) if costs else 0.0,
            prior_update_prices=prior,
            start_synchronous=(self.config.preserver.start_synchronous if self.config.preserver.start_synchronous
                               is not None else not self._profile_given),
            # plain delays (averaged, local) are admitted by a paired replay; compensated ones by price and duel
            plain_delays=self.config.delayed_update != "compensated",
        )

    # -- solving and switching ----------------------------------------------------------------------
    def solver_options(self) -> dict[str, Any]:
        """The solver options of this step's own plan: the user's ``plan_options`` with what the configuration
        implies (DDP bucket sizes, updates that wait for every gradient under clipping or loss scaling, the wire
        dtypes allowed)."""
        options: dict[str, Any] = dict(self.config.plan_options)
        options.setdefault("wire_dtypes", list(self.config.wire_dtypes))
        if self.config.max_grad_norm is not None or self.loss_scaler is not None:
            options.setdefault(UPDATE_WAITS_FOR_ALL, True)  # the gradient_guards pass makes updates wait for all
        if self.policy_runtime.uses_buckets:
            options.setdefault("first_bucket_bytes", self.config.first_bucket_bytes)
            options.setdefault("bucket_cap_bytes", self.config.bucket_cap_bytes)
        for key, value in self.policy_runtime.solver_defaults(self.config).items():
            options.setdefault(key, value)
        if self.wire_prices:
            options.setdefault("wire_prices", self.wire_prices)
        return options

    def solve(self, options: dict[str, Any]) -> Plan:
        """The plan this step's policy gives for its profile with solver ``options`` (nothing changes). Solving is
        pure, so the last few plans are kept by profile and options: the Preserver's gates and its measurement ask
        for the same unpriced and synchronous plans at one step."""
        if self.closed_loop is not None:
            options = self.closed_loop.adjust_options(options)
        key = json.dumps(options, sort_keys=True, default=repr)
        profile, solved = self._solved
        if profile is not self.profile:
            solved.clear()
            self._solved = (self.profile, solved)
        if key not in solved:
            if len(solved) >= SOLVED_KEPT:
                solved.pop(next(iter(solved)))
            solved[key] = solve(self.profile, self.policy, **options)
        return solved[key]

    def switch_plan(self, options: dict[str, Any], reason: str, plan: Plan | None = None, record: bool = True) -> None:
        """See ``CompiledStep.switch_plan``."""
        self.flush()
        self.plan = plan if plan is not None else self.solve(options)
        self.plan_switches += 1
        if self.config.check_consistency:
            check_same_across_ranks({"plan": self.plan.hash()}, self.groups.process_group)
        self.runner.use_items(self._scheduled(self.plan, self._index), reset=True)
        step_count = self.runner.step_count
        if not record:
            log.debug("step %d: plan %s (%s)", step_count, self.plan.hash()[:12], reason)
            return
        self._record_plan(reason)
        log.info("step %d: new plan (%s):\n%s", step_count, reason, self.plan.table(self.profile))
        log_structured("plan_change", {"step": step_count, "reason": reason, "plan": self.plan.to_dict()})
        if self.dump_dir is not None and (self.groups.comm_group is None or self.groups.comm_group.rank == 0):
            write_plan_artifacts(self.dump_dir / f"plan_step{step_count}", self.profile, self.plan)

    def flush(self) -> None:
        """Apply every pending update now: the policy's flush hook, then the runner's flush graph (see
        ``CompiledStep.flush``)."""
        self.policy_runtime.before_flush(self.handle)
        self.runner.flush(self.plan)

    def _record_plan(self, reason: str) -> None:
        self.plan_history.append(
            {
                "step": self.runner.step_count,
                "plan_hash": self.plan.hash(),
                "reason": reason,
                "delayed_items": sum(1 for item in self.plan.items if item.delay),
                "max_period": max((item.period for item in self.plan.items), default=1),
            }
        )

    # -- around each call ----------------------------------------------------------------------------
    def before_step(self) -> None:
        if self.monitor is not None:
            self.monitor.before_step()

    def after_step(self, outputs: Any, args: tuple, kwargs: dict, timing: StepTiming) -> None:
        """The Preserver sees the call (its time only if it ran no graph cold), then the closed loop
        (``step.closed_loop``: measured plans, refined profile)."""
        if self.monitor is not None:
            self.monitor.after_step(outputs, args, kwargs, timing.seconds if timing.measurable else None)
        if self.closed_loop is not None:
            self.closed_loop.after_step(self, timing.elapsed, measurable=timing.measurable,
                                        cpu_seconds=timing.cpu_seconds, run_queue_seconds=timing.run_queue_seconds)

    # -- checkpoints -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "plan": self.plan.to_json() if self.plan is not None else None,
            "profile": self.profile.to_json() if self.profile is not None else None,
            "preserver": self.monitor.state_dict() if self.monitor is not None else None,
            "wire_prices": self.wire_prices,
        }

    def load_plan(self, state: dict[str, Any]) -> None:
        """The saved profile and plan (used as they are: no re-profiling); the items follow on the next call."""
        if state["profile"] is not None:
            self.profile = Profile.from_json(state["profile"])
        if state.get("wire_prices"):
            self.wire_prices = {str(dtype): {str(name): float(price) for name, price in prices.items()}
                                for dtype, prices in state["wire_prices"].items()}
        if state["plan"] is not None:
            plan = Plan.from_json(state["plan"])
            if self.plan is not None and plan.hash() != self.plan.hash():
                raise DeftError("the saved plan differs from the one this step already uses")
            self.plan = plan
            self.runner.use_items([])

    def load_preserver(self, state: dict[str, Any] | None) -> None:
        """The Preserver's saved state: applied now if it watches already, else when it is created."""
        self._preserver_state = state
        if self._preserver_state is not None and self.monitor is not None:
            self.monitor.load_state_dict(self._preserver_state)
            self._preserver_state = None
