"""Which delayed semantics a step runs, and which delayed parameters a compensated plan corrects, with their
optimizer's hyper-parameters (the rewrite itself is ``deft_compile.passes.compensation``).

``DeftConfig.delayed_update="auto"`` (the default) resolves per optimizer (``resolve_delayed_update``):
``"compensated"`` where the compensation covers the optimizer (SGD with momentum and no dampening in every param
group, Adam, AdamW), ``"averaged"`` otherwise (plain delays, which the Preserver admits only where a paired replay
measures them harmless; docs/POLICIES.md). An explicit ``"compensated"`` on an optimizer it does not cover is
refused."""

from __future__ import annotations

from typing import Sequence

import torch

from deft_compile.errors import DeftError
from deft_compile.passes.compensation import Compensation
from deft_compile.passes.schedule import APPLY_NEXT_UPDATE, ScheduledItem
from deft_compile.step.optim_support import hyperparameter_slots


def compensation_family(optimizer: torch.optim.Optimizer) -> str | None:
    """``"sgd"`` (momentum > 0, no dampening, in every param group), ``"adam"`` (Adam, AdamW), or None: an
    optimizer the compensation does not cover."""
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return "adam"
    if isinstance(optimizer, torch.optim.SGD) and all(group["momentum"] != 0 and group["dampening"] == 0
                                                      for group in optimizer.param_groups):
        return "sgd"
    return None


def family_of(optimizer: torch.optim.Optimizer) -> str:
    """The compensation family of ``optimizer``; ``DeftError`` where the compensation does not cover it."""
    family = compensation_family(optimizer)
    if family is not None:
        return family
    if isinstance(optimizer, torch.optim.SGD):
        raise DeftError("delayed_update='compensated' needs SGD with momentum > 0 and no dampening in every param "
                        "group (the correction is the Nesterov form of the momentum)")
    raise DeftError(f"delayed_update='compensated' supports SGD with momentum, Adam and AdamW; got "
                    f"{type(optimizer).__name__} (use delayed_update='averaged' or 'auto')")


def resolve_delayed_update(setting: str, optimizer: torch.optim.Optimizer) -> str:
    """The semantics a step with ``DeftConfig.delayed_update=setting`` runs: ``"auto"`` gives ``"compensated"``
    where ``compensation_family`` covers the optimizer and ``"averaged"`` otherwise; an explicit setting is kept
    (``"compensated"`` on an optimizer it does not cover raises ``DeftError``)."""
    if setting == "auto":
        return "compensated" if compensation_family(optimizer) is not None else "averaged"
    if setting == "compensated":
        family_of(optimizer)
    return setting


def compensation_for(items: Sequence[ScheduledItem], optimizer: torch.optim.Optimizer,
                     params: Sequence[torch.Tensor]) -> Compensation:
    """The compensation of the items applied at the next update (one update of delay, with or without an update
    period or gradient accumulation), on captured parameter indices."""
    family = family_of(optimizer)
    delayed = {s.param for item in items if item.apply == APPLY_NEXT_UPDATE for s in item.slices}
    group_of = {p: g for g, group in enumerate(optimizer.param_groups) for p in group["params"]}
    rate_input = {g: i for i, (g, name) in enumerate(hyperparameter_slots(optimizer)) if name == "lr"}
    momentum, betas, eps, lr_input, lr = {}, {}, {}, {}, {}
    for index in delayed:
        g = group_of[params[index]]
        group = optimizer.param_groups[g]
        if family == "sgd":
            momentum[index] = float(group["momentum"])
        else:
            betas[index] = (float(group["betas"][0]), float(group["betas"][1]))
            eps[index] = float(group["eps"])
        if g in rate_input:
            lr_input[index] = rate_input[g]
        else:
            lr[index] = float(group["lr"])
    return Compensation(params=frozenset(delayed), family=family, momentum=momentum, betas=betas, eps=eps,
                        lr_input=lr_input, lr=lr)
