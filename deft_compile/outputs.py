"""What a training step's model (or loss function) may return, and where its loss is."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from deft_compile.errors import LossError


_MISSING = object()


def loss_of(output: Any) -> Any:
    """The loss in what the model (or ``loss_fn``) returned: a tensor, a mapping with a ``"loss"`` key,
    or an object with a ``.loss`` attribute (``transformers``' ``ModelOutput`` is both)."""
    if isinstance(output, torch.Tensor):
        return output
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", _MISSING)
    if loss is None:
        raise LossError(
            f"the step's output ({type(output).__name__}) has no loss (loss=None): pass the labels to the model "
            f"(e.g. step(input_ids=ids, labels=ids)) or give a loss_fn"
        )
    if loss is _MISSING:
        raise LossError(
            f"the step must produce a scalar loss: a tensor, a mapping with 'loss' or an object with a .loss "
            f"attribute; got {type(output).__name__}"
        )
    return loss

