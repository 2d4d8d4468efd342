"""The Preserver's verdicts on delays: when a plan with staleness may start, when it must end, and when a decision
is final. Pure Python, no torch: numbers in, verdicts out (``deft_compile.preserver.trade`` gathers the numbers).

The rules (docs/POLICIES.md, "The Preserver"):

* **A switch must pay for itself.** Switching plans flushes the pending gradients (about one synchronous step's
  communication), builds the graphs of a plan not seen before, and, for a plan with delays, runs the closed
  loop's duel, half of whose steps run the slower plan. A proposal is made only when its per-step gain, over
  ``horizon`` steps (the longest the decision runs before it is looked at again), exceeds that one-off cost
  (``switch_pays``).
* **A plan with delays is judged on measured time.** Once the closed loop has measured it (its duel), the plan
  is kept while its measured step, priced (``planner.solvers.deft.priced_step_ms``: the steps it loses to
  staleness), stays within ``margin`` of the measured synchronous step (``keeps_delays``). A refined prediction
  never overrules a measurement.
* **Plain delays are admitted by a paired loss comparison, not by their price.** Measured: plain averaged
  delays priced at 1.2-2.2 ms per step cost 3-5 % of final validation loss, which the first-order price does
  not predict. A paired replay of the same minibatches from the same state, with the proposed delays and
  synchronous, admits them only when the delayed arm ends no worse than the synchronous arm ``lag`` steps
  earlier, within ``tolerance`` (``admits_plain``).
* **No ping-pong.** A decision confirmed by ``stable_after`` consecutive measurements is final and probing
  stops (``Stability``); a proposal the duel or the replay rejects, a reversal and a loss-ladder step all end
  in a synchronous decision that is never reopened. So a run changes its staleness at most twice: synchronous,
  delays, synchronous.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from deft_compile.planner.solvers.deft import priced_step_ms


def switch_cost_ms(flush_ms: float, build_ms: float, duel_steps: int = 0, gain_ms: float = 0.0) -> float:
    """The one-off cost of a switch: the flush (``flush_ms``), graph builds the graph cache does not hold
    (``build_ms``), and for a plan that must win a duel the duel's steps on the slower plan (half of
    ``duel_steps``, each ``gain_ms`` slower)."""
    return max(0.0, flush_ms) + max(0.0, build_ms) + 0.5 * max(0, duel_steps) * abs(gain_ms)


def switch_pays(gain_ms: float, horizon: int, cost_ms: float) -> bool:
    """Whether a per-step gain of ``gain_ms`` over ``horizon`` steps repays a switch costing ``cost_ms``."""
    return gain_ms > 0 and gain_ms * horizon > cost_ms


def keeps_delays(delayed_ms: float, synchronous_ms: float, lost_share: float, margin: float) -> bool:
    """A running plan with delays, measured at ``delayed_ms`` against the synchronous plan's measured
    ``synchronous_ms``, stays while its priced step (``priced_step_ms``: ``lost_share`` of each step's progress
    lost to its staleness) is no more than ``margin`` × the synchronous step above it (hysteresis: prices are
    medians of noisy measurements, and going back costs a flush and perturbs training)."""
    return priced_step_ms(delayed_ms, lost_share, 1.0) <= synchronous_ms * (1.0 + margin)


def admits_plain(stale_loss: float, synchronous_loss: float, tolerance: float) -> bool:
    """The paired replay's verdict on plain delays: the delayed arm's loss is finite and at most ``tolerance``
    (relative) above the synchronous arm's loss its lag earlier."""
    return math.isfinite(stale_loss) and math.isfinite(synchronous_loss) and \
        stale_loss <= synchronous_loss * (1.0 + tolerance)


@dataclass
class Stability:
    """Consecutive measurements that left the standing decision as it was; ``stable`` after ``after`` of them."""

    after: int = 3
    confirmations: int = 0

    def confirm(self) -> bool:
        """One more measurement agreed with the decision; whether the decision is stable now."""
        self.confirmations += 1
        return self.stable

    def reset(self) -> None:
        self.confirmations = 0

    @property
    def stable(self) -> bool:
        return self.confirmations >= self.after


def survives_doubt(plan_ms: float, price_ms: float, compute_ms: float, synchronous_ms: float, doubt: float) -> bool:
    """Whether a proposed plan with staleness is still faster than the synchronous plan with its price multiplied
    by ``doubt`` (``PreserverConfig.price_doubt``): the first-order price underestimates large losses, and a plan
    whose gain depends on the price being exact is not proposed."""
    from deft_compile.planner.solvers.deft import priced_step_ms

    return priced_step_ms(plan_ms, doubt * price_ms, compute_ms) < synchronous_ms
