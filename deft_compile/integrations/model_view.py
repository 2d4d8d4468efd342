"""A module that is another module under a different forward: the same submodules, parameters and buffers."""

from __future__ import annotations

from typing import Any, Callable

import torch.nn as nn


class ModelView(nn.Module):
    """``model``'s submodules, parameters and buffers (the very dictionaries, so the names are ``model``'s own and
    ``torch.func.functional_call`` on the view swaps ``model``'s tensors) with ``forward = fn(model, *args, **kwargs)``.

    deft_compile traces the module it is given; a view lets it trace a loss computed around ``model`` (a trainer's
    ``compute_loss``) while plans, profiles and ``keep_synchronous`` patterns keep ``model``'s parameter names.
    ``train()``/``eval()`` switch ``model`` itself too.
    """

    def __init__(self, model: nn.Module, fn: Callable[..., Any]) -> None:
        super().__init__()
        # plain attributes, not a submodule (its names would get a prefix), and named so that no submodule of
        # ``model`` is hidden by them (attribute lookup finds these before ``_modules``; Llama has a ``model``)
        self.__dict__["_view_of"] = model
        self.__dict__["_view_forward"] = fn
        for shared in ("_parameters", "_buffers", "_non_persistent_buffers_set", "_modules"):
            self.__dict__[shared] = model.__dict__[shared]
        self.training = model.training

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._view_forward(self._view_of, *args, **kwargs)

    def train(self, mode: bool = True) -> "ModelView":
        self._view_of.train(mode)
        self.training = mode
        return self
