"""Which delayed parameters a compensated plan corrects, with their optimizer's hyper-parameters
(``DeftConfig(delayed_update="compensated")``; the rewrite itself is ``deft_compile.passes.compensation``)."""

from __future__ import annotations

from typing import Sequence

import torch

from deft_compile.errors import DeftError
from deft_compile.passes.compensation import Compensation
from deft_compile.passes.schedule import APPLY_NEXT_UPDATE, ScheduledItem
from deft_compile.step.optim_support import lr_is_input


def family_of(optimizer: torch.optim.Optimizer) -> str:
    """``"sgd"`` (momentum, no dampening) or ``"adam"`` (Adam, AdamW); anything else cannot be compensated."""
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return "adam"
    if isinstance(optimizer, torch.optim.SGD):
        if any(group["momentum"] == 0 or group["dampening"] != 0 for group in optimizer.param_groups):
            raise DeftError("delayed_update='compensated' needs SGD with momentum > 0 and no dampening in every param "
                            "group (the correction is the Nesterov form of the momentum)")
        return "sgd"
    raise DeftError(f"delayed_update='compensated' supports SGD with momentum, Adam and AdamW; got "
                    f"{type(optimizer).__name__} (use delayed_update='averaged')")


def compensation_for(items: Sequence[ScheduledItem], optimizer: torch.optim.Optimizer,
                     params: Sequence[torch.Tensor]) -> Compensation:
    """The compensation of the items applied at the next update (one update of delay, with or without an update
    period or gradient accumulation), on captured parameter indices."""
    family = family_of(optimizer)
    delayed = {s.param for item in items if item.apply == APPLY_NEXT_UPDATE for s in item.slices}
    group_of = {p: g for g, group in enumerate(optimizer.param_groups) for p in group["params"]}
    rate_is_input = lr_is_input(optimizer)
    momentum, betas, eps, lr_input, lr = {}, {}, {}, {}, {}
    for index in delayed:
        g = group_of[params[index]]
        group = optimizer.param_groups[g]
        if family == "sgd":
            momentum[index] = float(group["momentum"])
        else:
            betas[index] = (float(group["betas"][0]), float(group["betas"][1]))
            eps[index] = float(group["eps"])
        if rate_is_input:
            lr_input[index] = g
        else:
            lr[index] = float(group["lr"])
    return Compensation(params=frozenset(delayed), family=family, momentum=momentum, betas=betas, eps=eps,
                        lr_input=lr_input, lr=lr)
