"""How much training time the Preserver's loss attribution may take (torch-free).

A paired replay (:mod:`deft_compile.preserver.attribution`) re-trains the steps
since the best loss window twice, eagerly: with the staleness that ran and
synchronously. Late in a long run that is a rounding error; early in one it can
cost more than every step before it: a replay of 14 steps, twice, inside 12
timed steps puts a VGG-16-BN launch of the suite at 1.29x DDP while its schedule
runs at 0.81x (docs/POLICIES.md). So, like the staleness
probes (``probe_budget``), the attribution has a budget: its copies and replays
never take more than ``share`` of the steps' own time so far. A signal whose
replay does not fit is acted on unattributed (the Preserver steps down: safe for
convergence, it costs speed). A state copy that does not fit is not taken, and
a signal before the next one is acted on unattributed too.

The numbers the decisions use are means over ranks (``agreed``): every rank
must decide the same, because a replay ends in an all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

#: a forward pass alone, as a share of a forward and backward pass (the replay's evaluations are forwards)
FORWARD_SHARE = 1.0 / 3.0


@dataclass
class AttributionBudget:
    """Time spent on loss attribution against time spent training.

    Attributes:
        share: the most copies and replays may take, as a share of ``training_seconds``; None: no limit.
        training_seconds: the steps' own time so far (Preserver measurements and cold graph runs excluded).
        steps: steps counted in ``training_seconds``.
        spent_seconds: copies, kept minibatches and replays so far.
        pass_seconds: the latest measured eager forward and backward of one minibatch (0: none measured yet;
            a step's own time stands in).
        copy_seconds: the latest state copy (0: none taken yet).
    """

    share: float | None = 0.05
    training_seconds: float = 0.0
    steps: int = 0
    spent_seconds: float = 0.0
    pass_seconds: float = 0.0
    copy_seconds: float = 0.0

    def count_step(self, seconds: float) -> None:
        self.training_seconds += seconds
        self.steps += 1

    def spend(self, seconds: float) -> None:
        self.spent_seconds += seconds

    def affords(self, seconds: float) -> bool:
        """Whether spending ``seconds`` more keeps the attribution within its share of the training time."""
        if self.share is None:
            return True
        return self.share > 0 and self.spent_seconds + seconds <= self.share * self.training_seconds

    def replay_seconds(self, trained: int, evaluated: int) -> float:
        """Predicted time of a replay with ``trained`` forward and backward passes (both arms) and ``evaluated``
        forward passes: at the measured eager pass time, or a step's own mean time before any measurement."""
        per_pass = self.pass_seconds or (self.training_seconds / self.steps if self.steps else 0.0)
        return per_pass * (trained + FORWARD_SHARE * evaluated)

    def replayed(self, seconds: float, trained: int, evaluated: int) -> None:
        """A replay of that shape took ``seconds``: spent, and the eager pass time the next prediction uses."""
        self.spend(seconds)
        self.pass_seconds = seconds / (trained + FORWARD_SHARE * evaluated)

    def numbers(self) -> list[float]:
        """What ``agreed`` averages over ranks."""
        return [self.training_seconds, float(self.steps), self.spent_seconds, self.pass_seconds, self.copy_seconds]

    def agreed(self, means: list[float]) -> "AttributionBudget":
        """This budget with the rank means of ``numbers()``: the figures every rank decides from."""
        training, steps, spent, per_pass, copy = means
        return AttributionBudget(self.share, training, round(steps), spent, per_pass, copy)

    def state_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "share"}

    def load_state_dict(self, state: dict[str, float]) -> None:
        for f in fields(self):
            if f.name != "share" and f.name in state:
                setattr(self, f.name, type(getattr(self, f.name))(state[f.name]))
