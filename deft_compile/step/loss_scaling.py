"""Dynamic loss scaling's state for a compiled step (fp16 training).

The scale and the growth tracker are graph inputs that the step graph updates in
place with ``aten._amp_update_scale_`` (the ``gradient_guards`` pass), so the rules
are ``torch.amp.GradScaler``'s own: back off by ``backoff_factor`` on an inf/NaN,
grow by ``growth_factor`` after ``growth_interval`` clean updates. With a user's
``GradScaler`` the very tensors of that scaler are used, so ``scaler.get_scale()``
and ``scaler.state_dict()`` follow the step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from deft_compile.passes.gradient_guards import GuardOptions

# torch.amp.GradScaler's defaults
_DEFAULTS = {"init_scale": 2.0**16, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000}


@dataclass
class LossScaler:
    scale: torch.Tensor  # 0-dim float32
    growth_tracker: torch.Tensor  # 0-dim int32
    growth_factor: float
    backoff_factor: float
    growth_interval: int

    @classmethod
    def from_config(cls, loss_scale: Any, device: torch.device) -> "LossScaler | None":
        """None for no scaling; ``"dynamic"``: GradScaler's defaults; a ``GradScaler``: its settings and tensors."""
        if loss_scale is None:
            return None
        if isinstance(loss_scale, torch.amp.GradScaler):
            if not loss_scale.is_enabled():
                return None
            if loss_scale._scale is None:
                loss_scale._lazy_init_scale_growth_tracker(device)
            return cls(
                scale=loss_scale._scale,
                growth_tracker=loss_scale._growth_tracker,
                growth_factor=float(loss_scale._growth_factor),
                backoff_factor=float(loss_scale._backoff_factor),
                growth_interval=int(loss_scale._growth_interval),
            )
        return cls(
            scale=torch.full((), _DEFAULTS["init_scale"], dtype=torch.float32, device=device),
            growth_tracker=torch.zeros((), dtype=torch.int32, device=device),
            growth_factor=_DEFAULTS["growth_factor"],
            backoff_factor=_DEFAULTS["backoff_factor"],
            growth_interval=_DEFAULTS["growth_interval"],
        )

    def inputs(self) -> list[torch.Tensor]:
        """The graph inputs, in layout order (``GraphLayout.num_scaler_inputs``)."""
        return [self.scale, self.growth_tracker]

    def guard_options(self) -> dict[str, Any]:
        return {
            "skip_nonfinite": True,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
        }

    def get_scale(self) -> float:
        return float(self.scale)

    def state_dict(self) -> dict[str, Any]:
        return {"scale": float(self.scale), "growth_tracker": int(self.growth_tracker)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale.fill_(float(state["scale"]))
        self.growth_tracker.fill_(int(state["growth_tracker"]))


def guard_options_for(max_grad_norm: float | None, norm_type: float, scaler: LossScaler | None) -> GuardOptions:
    """What the ``gradient_guards`` pass adds for these settings."""
    return GuardOptions(max_norm=max_grad_norm, norm_type=norm_type, **(scaler.guard_options() if scaler else {}))
