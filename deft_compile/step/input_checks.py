"""What the compiled step checks at call time about the model it captured and the inputs it is given, so that a
change it cannot follow gets a clear error instead of silent wrong numbers.

- The model's parameters must keep the dtypes, devices, shapes and ``requires_grad`` that ``deft_compile()`` saw
  (checked before each call, on the parameter objects it captured). The plan communicates the gradients of the
  parameters that required grad at ``deft_compile()``, the captured graphs run on those dtypes and devices, and the
  optimizer state was made for them: ``model.half()``, ``model.to(other device or dtype)``, or a parameter frozen or
  unfrozen afterwards raise ``ModelChangedError`` (DDP has the same limits: its buckets and hooks are built at
  construction; unfreezing a parameter under DDP leaves its gradient un-averaged, silently). A module replaced
  after ``deft_compile()`` is not looked for (walking the model on every call costs more than the step's own
  bookkeeping): the step goes on training the parameters it captured, as DDP's hooks stay on the old ones.
- Inputs may change shape, dtype or device between calls: the step retraces for them and runs what eager would.
  Where the step then fails (an input dtype the model cannot take, a device its parameters are not on) outside
  deft_compile's own errors, ``InputChangeError`` names the inputs that changed since the last call that ran.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from deft_compile.errors import DeftError, InputChangeError, ModelChangedError
from deft_compile.step.distributed import is_collective_failure


def _describe(dtype: torch.dtype, device: torch.device, shape: torch.Size, requires_grad: bool) -> str:
    return (f"{str(dtype).replace('torch.', '')} on {device}, shape {tuple(shape)}, "
            f"{'requires grad' if requires_grad else 'frozen'}")


class StepInputChecks:
    """The model's parameters as captured, and the dtypes and devices of the last call's tensor inputs."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._params = [(name, p, p.dtype, p.device, p.shape, p.requires_grad) for name, p in model.named_parameters()]
        self._last_inputs: tuple[Any, list[tuple[torch.dtype, torch.device]]] | None = None

    def check_model(self) -> None:
        """Raise ``ModelChangedError`` when a captured parameter's dtype, device, shape or ``requires_grad`` changed."""
        for name, p, dtype, device, shape, requires_grad in self._params:
            if p.dtype is not dtype or p.requires_grad is not requires_grad or p.shape != shape or p.device != device:
                raise ModelChangedError(
                    f"parameter {name!r} is {_describe(p.dtype, p.device, p.shape, p.requires_grad)} now, "
                    f"{_describe(dtype, device, shape, requires_grad)} when deft_compile() captured it: the step's "
                    f"graphs, its plan (which gradients are averaged) and the optimizer state were built for the "
                    f"latter. Move, cast, freeze or unfreeze the model (model.to(), .half(), requires_grad_()) before "
                    f"deft_compile(), then compile it again with a new optimizer")

    def ran(self, args: tuple, kwargs: dict) -> None:
        """Remember the dtypes and devices of a call that ran."""
        leaves, spec = pytree.tree_flatten((args, kwargs))
        self._last_inputs = (spec, [(leaf.dtype, leaf.device) for leaf in leaves if isinstance(leaf, torch.Tensor)])

    def explain_failure(self, exc: BaseException, args: tuple, kwargs: dict) -> InputChangeError | None:
        """``InputChangeError`` naming the tensor inputs whose dtype or device differ from the last call that ran,
        if any do; None otherwise (and for a collective's failure, which is the peers' business)."""
        if self._last_inputs is None or is_collective_failure(exc):
            return None
        last_spec, last = self._last_inputs
        with_paths, spec = pytree.tree_flatten_with_path((args, kwargs))
        if spec != last_spec:
            return None
        tensors = [(path, leaf) for path, leaf in with_paths if isinstance(leaf, torch.Tensor)]
        changes = [f"{_input_name(path)} is {str(t.dtype).replace('torch.', '')} on {t.device}, "
                   f"{str(dtype).replace('torch.', '')} on {device} before"
                   for (path, t), (dtype, device) in zip(tensors, last) if (t.dtype, t.device) != (dtype, device)]
        if not changes:
            return None
        cause = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return InputChangeError(
            f"the step failed on inputs whose dtype or device changed since the last step that ran "
            f"({'; '.join(changes)}): {type(exc).__name__}: {cause}. The step retraced for them and ran what eager "
            f"training would; give inputs of the dtype and on the device the model takes")


def _input_name(path: tuple) -> str:
    """``args[0]``, ``kwargs['input_ids']``, ``args[1][2]`` from a pytree key path of ``(args, kwargs)``."""
    root = "args" if getattr(path[0], "idx", 0) == 0 else "kwargs"
    return root + pytree.keystr(path[1:])


_Method = TypeVar("_Method", bound=Callable[..., Any])


def checks_inputs(method: _Method) -> _Method:
    """Decorate the compiled step's ``__call__`` (an object with ``input_checks``): check the model before the
    call, and name the changed inputs when the call fails outside deft_compile's own errors."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        checks: StepInputChecks = self.input_checks
        checks.check_model()
        try:
            result = method(self, *args, **kwargs)
        except DeftError:
            raise
        except Exception as exc:
            error = checks.explain_failure(exc, args, kwargs)
            if error is None:
                raise
            raise error from exc
        checks.ran(args, kwargs)
        return result

    return wrapper  # type: ignore[return-value]
