"""The Preserver's trade, carried out at each staleness measurement: price the parameters, then propose, keep or
end delays by the rules of :mod:`deft_compile.preserver.verdict`, judging a running plan with delays on the
closed loop's measured times (``ClosedLoop.measured_times``) wherever the step has a closed loop, and on the
simulator's predictions where it has none (a profile the user gives).

What one measurement decides, by the standing decision:

* **synchronous, open** (no delays adopted yet): solve with the new prices. A priced plan with staleness is
  proposed when it gains ``trade_margin`` of the compute step per step over the synchronous plan (the
  prediction scaled by the synchronous plan's measured / predicted time) and that gain repays the switch over
  ``switch_horizon`` steps. Compensated delays switch at once (the closed loop then duels them); plain delays
  wait for their paired replay (``admission``, a :class:`~deft_compile.preserver.admission.PlainAdmission`).
* **delays** (adopted): once the closed loop has measured the running plan with delays, keep it while
  ``verdict.keeps_delays`` holds at the new prices, else go back to synchronous for good. A plan with delays
  the closed loop measured no faster than the synchronous plan (its duel lost) ends the same way.
  ``stable_after`` consecutive keeps make the decision final; for plain delays a keep is a paired replay of
  the steps they run that finds them harmless (``verdict.admits_plain``; one that does not sends the run back
  to synchronous for good), not a price. The prices a plan was adopted with stay its options: new prices judge
  it, they never re-solve it into another set of delayed buckets (a new set needs new graphs, a flush and a
  duel, and its gain would be a prediction).

Torch-free: it reads the step through the ``WatchedStep`` protocol of :mod:`deft_compile.preserver.monitor`.
"""

from __future__ import annotations

import logging
import statistics
from typing import Any, Callable

from deft_compile.planner.solvers.deft import priced_step_ms
from deft_compile.preserver.decisions import Preserver, PreserverEvent
from deft_compile.preserver.pricing import compute_ms, plan_price_ms
from deft_compile.preserver.verdict import admits_plain, keeps_delays, survives_doubt, switch_cost_ms, switch_pays

log = logging.getLogger("deft_compile")

#: graphs a plan not seen before builds: its first call (nothing pending yet), its steady call, its flush
NEW_PLAN_GRAPHS = 3


def has_staleness(plan: Any) -> bool:
    return any(item.delay or item.period > 1 for item in plan.items)


def schedule_by_name(plan: Any, names: list[str]) -> dict[str, tuple[int, int]]:
    """Parameter name -> (delay, period) of every parameter ``plan`` makes stale (the replay's ``Schedule``)."""
    return {names[index]: (delay, period) for index, (delay, period, _offset) in plan.param_schedule().items()
            if delay or period > 1}


def priced_step_text(plan_ms: float, price_ms: float, compute: float, source: str) -> str:
    """The priced step as the rules compute it (``priced_step_ms``): the plan's step time divided by the share of
    each step's progress its staleness leaves, with every number that goes in."""
    share = price_ms / compute if compute > 0 else 0.0
    return (f"{source} {plan_ms:.3g} ms / (1 - price {price_ms:.3g} ms / compute {compute:.3g} ms = {share:.1%} of "
            f"each step's progress lost) = {priced_step_ms(plan_ms, price_ms, compute):.3g} ms per synchronous step")


class Trader:
    """Carries out the trade for one step's Preserver (see the module docstring). ``admission``: what replays
    plain delays before they are admitted (``preserver.admission.PlainAdmission``), None where the step runs
    compensated delays. ``agree``: the rank mean of a list of numbers (one all-reduce; the monitor's): every
    number a decision reads is the same on every rank."""

    def __init__(self, step: Any, preserver: Preserver, admission: Any = None,
                 agree: Callable[[list[float]], list[float]] = list) -> None:
        self.step = step
        self.preserver = preserver
        self.config = preserver.config
        self.admission = admission
        self.agree = agree

    # -- the closed loop's measurements ------------------------------------------------------------
    def _times(self):
        closed_loop = self.step.closed_loop
        return closed_loop.measured_times() if closed_loop is not None else None

    # -- one measurement ----------------------------------------------------------------------------
    def measured(self, step_count: int, changes: dict[str, tuple[float, float]], probe_ms: float,
                 noise: dict[str, float] | None = None) -> PreserverEvent | None:
        """One staleness measurement (every parameter's (‖Δg‖², ‖g‖²), summed over ranks, and where measured its
        gradient noise ratio; ``probe_ms`` its cost): price, decide, switch where the decision changes the plan, and
        schedule the next measurement."""
        preserver, step = self.preserver, self.step
        compute = compute_ms(step.profile)
        unpriced = preserver.unpriced_options()
        synchronous = step.solve({**unpriced, "max_staleness": 0})
        prices = preserver.trade(step_count, changes, compute, noise)
        event, changed = None, False
        if prices is not None:
            standing = step.solve(preserver.options)
            if has_staleness(standing):  # adopted, or a plan you gave that delays from the first step
                event = self._judge(step_count, prices, synchronous, compute)
            else:
                event = self._propose(step_count, prices, synchronous, compute)
            changed = event is not None
        preserver.probes.after_measurement(step_count, changed=changed, probe_ms=probe_ms, step_ms=self._step_ms(synchronous))
        return event

    def staleness_can_pay(self) -> bool:
        """Whether a staleness measurement can change the decision: never once it is final (``settled``); always
        while the standing plan has staleness (its prices judge it); with none adopted, only where the plan
        solved without prices is predicted to gain ``trade_margin`` of the compute step over the synchronous
        plan. A price is never negative, so no priced plan passes ``_propose``'s margin when that one does not,
        and the two eager passes of the measurement would buy nothing."""
        preserver, step = self.preserver, self.step
        if preserver.settled or step.profile is None:
            return False
        if has_staleness(step.solve(preserver.options)):
            return True
        unpriced = preserver.unpriced_options()
        plan = step.solve(unpriced)
        if not has_staleness(plan):
            return False
        synchronous = step.solve({**unpriced, "max_staleness": 0})
        gain_ms = float(synchronous.predicted_iteration_ms or 0.0) - float(plan.predicted_iteration_ms or 0.0)
        return gain_ms >= self.config.trade_margin * compute_ms(step.profile)

    def periods_can_run(self) -> bool:
        """Whether the plan solved without prices gives a bucket an update period. Prices only make periods dearer,
        so where it gives none no price can buy one, and a noise ratio (which prices periods, at the cost of an
        all-reduce of a gradient sample) changes nothing."""
        if self.step.profile is None:
            return False
        options = self.preserver.unpriced_options()
        if options.get("max_staleness", 1) == 0 or not options.get("allow_period", True):
            return False
        return any(item.period > 1 for item in self.step.solve(options).items)

    def running_step_ms(self) -> float:
        """The running plan's step time: measured by the closed loop where it has measured it, else predicted."""
        times, plan = self._times(), self.step.plan
        if times is not None and plan.hash() in times.plan_ms:
            return times.plan_ms[plan.hash()]
        return float(plan.predicted_iteration_ms or 0.0)

    # -- the 16-bit wire --------------------------------------------------------------------------------
    def wire_dtypes(self) -> list[str]:
        """The 16-bit dtypes the running plan sends in (what a measurement prices)."""
        return sorted({item.wire_dtype for item in self.step.plan.items if item.narrowed})

    def judge_wire(self, step_count: int, names: list[str], sums: list[float]) -> PreserverEvent | None:
        """Price the running plan's narrower wire on this measurement (``wire_pricing``): the buckets whose price no
        longer pays for the link time they save go back to float32 for good (``Preserver.keep_float32``), and the
        step switches plans. ``sums``: rank sums of ``wire_error.cast_error_norms`` over ``names``, for
        ``wire_dtypes()``."""
        from deft_compile.planner.wire import saved_link_ms
        from deft_compile.preserver.wire_pricing import harmful_buckets, wire_prices, wire_shares

        step, profile = self.step, self.step.profile
        dtypes = self.wire_dtypes()
        compute = compute_ms(profile)
        prices = wire_prices(wire_shares(names, dtypes, sums, step.world_size), compute, self.config.staleness_price)
        buckets: dict[int, tuple[list[int], str, int]] = {}
        for item in step.plan.items:
            if item.narrowed:
                params, _, _ = buckets.setdefault(item.bucket, ([], item.wire_dtype, item.link))
                params.extend(s.param for s in item.slices if s.param not in params)
        narrowed = []
        for params, dtype, link in buckets.values():
            links = [profile.links[link]]
            narrowed.append((tuple(profile.params[p].name for p in params), dtype,
                             saved_link_ms(profile, params, dtype, links)))
        step_ms = self.running_step_ms()
        harmful = harmful_buckets(narrowed, prices, step_ms, compute)
        if not harmful:
            log.debug("Preserver at step %d: the narrower wire of %d bucket(s) still pays", step_count, len(narrowed))
            return None
        described = "; ".join(f"{names[0]}{' ...' if len(names) > 1 else ''} on {dtype}: price {price:.3g} ms"
                              f" x step {step_ms:.3g} / compute {compute:.3g} ms >= {saved:.3g} ms saved"
                              for names, dtype, price, saved in harmful)
        why = f"narrower wire priced harmful on {len(harmful)} bucket(s), float32 from now on ({described})"
        metrics = {"wire_prices_ms": {dtype: sum(by_name.values()) for dtype, by_name in prices.items()},
                   "harmful_buckets": [list(names) for names, *_ in harmful]}
        event = self.preserver.keep_float32(step_count, {name for names, *_ in harmful for name in names}, why,
                                            metrics)
        step.switch_plan(self.preserver.options, why)
        return event

    def _step_ms(self, synchronous) -> float:
        """The running plan's step time the probes' budget is a share of (``running_step_ms``), the synchronous
        plan's prediction where the running plan has none."""
        return self.running_step_ms() or float(synchronous.predicted_iteration_ms or 0.0)

    def _metrics(self, prices, synchronous_ms: float, plan_ms: float, price_ms: float, gain_ms: float,
                 **extra: Any) -> dict[str, Any]:
        return {"synchronous_ms": synchronous_ms, "plan_ms": plan_ms, "price_ms": price_ms, "gain_ms": gain_ms,
                "total_staleness_price_ms": sum(prices[0].values()),
                "top_staleness_prices_ms": dict(sorted(prices[0].items(), key=lambda kv: -kv[1])[:5]),
                "top_update_prices_ms": dict(sorted(prices[1].items(), key=lambda kv: -kv[1])[:5]),
                **({"median_noise_ratio": statistics.median(prices[2].values())} if len(prices) > 2 and prices[2]
                   else {}), **extra}

    def _propose(self, step_count: int, prices, synchronous, compute: float) -> PreserverEvent | None:
        """No delays adopted: propose the priced plan if it pays (compensated: switch; plain: replay first). The
        options stay synchronous until a proposal is adopted: a priced plan that does not pay is not adopted, so
        no later re-solve (on a refined profile) turns the standing decision into delays."""
        preserver, step = self.preserver, self.step
        times = self._times()
        if times is not None and times.synchronous_only:
            return preserver.settle(step_count, "synchronous", "the closed loop measured delays no faster than the "
                                    "synchronous plan", {})
        priced = step.solve(preserver.priced_options(prices))
        if not has_staleness(priced):
            return None
        names = [param.name for param in step.profile.params]
        sync_ms = float(synchronous.predicted_iteration_ms or 0.0)
        plan_ms = float(priced.predicted_iteration_ms or 0.0)
        price_ms = plan_price_ms(priced, names, *prices)
        gain_ms = sync_ms - priced_step_ms(plan_ms, price_ms, compute)  # predicted: the duel measures it
        measured_sync = times.synchronous_ms if times is not None else None
        # in the units of the clock: the prediction scaled as the synchronous plan's measurement scales its own
        scale = measured_sync / sync_ms if measured_sync and sync_ms > 0 else 1.0
        build_ms = NEW_PLAN_GRAPHS * 1e3 * self.agree([float(step.last_trace_seconds)])[0]
        cost_ms = switch_cost_ms(measured_sync or sync_ms, build_ms, times.duel_steps if times is not None else 0,
                                 gain_ms * scale)
        metrics = self._metrics(prices, sync_ms, plan_ms, price_ms, gain_ms, switch_cost_ms=cost_ms,
                                clock_scale=scale)
        if not survives_doubt(plan_ms, price_ms, compute, sync_ms, self.config.price_doubt):
            doubted_ms = priced_step_ms(plan_ms, self.config.price_doubt * price_ms, compute)
            log.info("Preserver at step %d: delays would lose at %g times their price (%s; at that price %.3g ms per "
                     "synchronous step against %.3g ms synchronous): the plan stays synchronous", step_count,
                     self.config.price_doubt, priced_step_text(plan_ms, price_ms, compute, "predicted"), doubted_ms,
                     sync_ms)
            return None
        if gain_ms < self.config.trade_margin * compute or not switch_pays(gain_ms * scale,
                                                                           self.config.switch_horizon, cost_ms):
            log.info("Preserver at step %d: delays would gain %.3g ms per step (synchronous %.3g ms - priced step: %s; "
                     "needed: %.0f%% of compute, %.3g ms), %.3g ms on the step's clock (needed: a switch of %.3g ms "
                     "repaid in %d steps): the plan stays synchronous", step_count, gain_ms, sync_ms,
                     priced_step_text(plan_ms, price_ms, compute, "predicted"), self.config.trade_margin * 100,
                     self.config.trade_margin * compute, gain_ms * scale, cost_ms, self.config.switch_horizon)
            return None
        delayed = sum(1 for item in priced.items if item.delay)
        periodic = sum(1 for item in priced.items if item.period > 1)
        reason = (f"staleness priced (κ={self.config.staleness_price:g}): {delayed} delayed and {periodic} periodic "
                  f"of {len(priced.items)} items; {priced_step_text(plan_ms, price_ms, compute, 'predicted')} "
                  f"against {sync_ms:.3g} ms synchronous: a gain of {gain_ms:.3g} ms per step (at least "
                  f"{self.config.trade_margin:.0%} of compute, {self.config.trade_margin * compute:.3g} ms), "
                  f"{gain_ms * scale:.3g} ms on the step's clock against a switch of {cost_ms:.3g} ms")
        if preserver.plain_delays and self.admission is not None:
            preserver.admission = {"kind": "propose", "prices": [dict(p) for p in prices],
                                   "reason": reason, "schedule": schedule_by_name(priced, names), "metrics": metrics}
            self.admission.request(preserver.admission["schedule"])
            log.info("Preserver at step %d: plain delays proposed (%s); a paired replay of %d steps decides",
                     step_count, reason, self.config.admission_steps)
            return None
        event = preserver.record_trade(step_count, prices, metrics, reason)
        step.switch_plan(preserver.options, reason)
        return event

    def _judge(self, step_count: int, prices, synchronous, compute: float) -> PreserverEvent | None:
        """Delays adopted: keep the running plan with delays or go back to synchronous for good."""
        preserver, step = self.preserver, self.step
        names = [param.name for param in step.profile.params]
        times = self._times()
        running = step.plan
        if times is not None:
            if times.synchronous_only:
                return self._back(step_count, "the closed loop measured the plan with delays no faster than the "
                                  "synchronous plan", {})
            if not times.settled or not has_staleness(running) or running.hash() not in times.plan_ms \
                    or times.synchronous_ms is None:
                return None  # its duel is under way: the measurement that judges it is not in yet
            plan_ms, sync_ms, source = times.plan_ms[running.hash()], times.synchronous_ms, "measured"
        else:
            plan_ms = float(running.predicted_iteration_ms or 0.0)
            sync_ms, source = float(synchronous.predicted_iteration_ms or 0.0), "predicted"
        price_ms = plan_price_ms(running, names, *prices)
        gain_ms = sync_ms - priced_step_ms(plan_ms, price_ms, compute)
        metrics = self._metrics(prices, sync_ms, plan_ms, price_ms, gain_ms, source=source)
        priced_text = priced_step_text(plan_ms, price_ms, compute, source)
        threshold_text = (f"synchronous {sync_ms:.3g} ms x (1 + margin {self.config.trade_margin:.0%}) = "
                          f"{sync_ms * (1.0 + self.config.trade_margin):.3g} ms")
        if keeps_delays(plan_ms, sync_ms, price_ms / compute if compute > 0 else 0.0, self.config.trade_margin):
            if preserver.plain_delays and self.admission is not None:
                # plain delays: what confirms them is a paired replay of the steps they run, not their price
                preserver.admission = {"kind": "confirm", "metrics": metrics,
                                       "schedule": schedule_by_name(running, names)}
                self.admission.request(preserver.admission["schedule"])
                return None
            if preserver.stability.confirm():
                return preserver.settle(step_count, "kept", f"the plan with delays kept by {preserver.stability.after} "
                                        f"measurements ({priced_text} <= {threshold_text})", metrics)
            return None
        return self._back(step_count, f"staleness priced (κ={self.config.staleness_price:g}): the plan with delays "
                          f"loses to the synchronous plan: {priced_text} > {threshold_text}", metrics)

    def _back(self, step_count: int, why: str, metrics: dict[str, Any]) -> PreserverEvent | None:
        """Back to synchronous for good, switching if the running plan has staleness."""
        event = self.preserver.settle(step_count, "synchronous", why, metrics)
        if event is not None and has_staleness(self.step.plan):
            self.step.switch_plan(self.preserver.options, why)
        return event

    # -- plain delays: the paired replay ---------------------------------------------------------------
    def before_step(self) -> None:
        if self.admission is not None and self.preserver.admission is not None:
            if self.admission.schedule is None:  # a resumed run: its replay starts afresh
                self.admission.request(self.preserver.admission["schedule"])
            self.admission.before_step(self.step)

    def after_step(self, args: tuple, kwargs: dict) -> PreserverEvent | None:
        """Feed the paired replay of plain delays; when it has run, decide. A proposal is admitted (switch) or the
        decision settles synchronous; a running plan's confirmation counts towards ``stable_after`` (a final
        decision once reached) or sends the run back to synchronous for good."""
        preserver = self.preserver
        if self.admission is None or preserver.admission is None:
            return None
        result = self.admission.after_step(self.step, args, kwargs)
        if result is None:
            return None
        stale, synchronous, steps = result
        pending, preserver.admission = preserver.admission, None
        step_count = self.step.step_count
        preserver.probes.resume(step_count)
        admitted = admits_plain(stale, synchronous, self.config.admission_tolerance)
        comparison = (f"paired replay of {steps} steps: {stale:.5g} with the delays, {synchronous:.5g} synchronous "
                      f"({'within' if admitted else 'above'} a tolerance of {self.config.admission_tolerance:.2%})")
        metrics = {**pending["metrics"], "replay_stale_loss": stale, "replay_synchronous_loss": synchronous,
                   "replay_steps": steps}
        if pending["kind"] == "confirm":
            if not admitted:
                return self._back(step_count, f"plain delays measured harmful: {comparison}", metrics)
            log.info("Preserver at step %d: plain delays confirmed: %s", step_count, comparison)
            if preserver.stability.confirm():
                return preserver.settle(step_count, "kept", f"plain delays kept by {preserver.stability.after} paired "
                                        f"replays (the last: {comparison})", metrics)
            return None
        if not admitted:
            return preserver.settle(step_count, "synchronous", f"plain delays not admitted: {comparison}", metrics)
        prices = tuple(pending["prices"])
        reason = f"{pending['reason']}; plain delays admitted: {comparison}"
        event = preserver.record_trade(step_count, prices, metrics, reason)
        self.step.switch_plan(preserver.options, reason)
        return event
