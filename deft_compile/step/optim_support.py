"""Which optimizers can be captured, and how they are put into a traceable mode.

Only per-parameter, element-wise optimizers are accepted: their update of one
parameter reads that parameter's gradient and state and nothing else, which is
what lets a pass bucket, reorder or delay updates per parameter. Coupled updates
(LBFGS's line search, anything clipping by a global norm inside ``step``) would
be silently wrong, so they are refused with a clear error.

While tracing we switch every param group to the single-tensor implementation
(``foreach=False, fused=False``) so each parameter's update is its own subgraph,
and to ``capturable=True`` where the optimizer has it, so the step counter stays
a tensor in the graph instead of a Python number frozen at trace time. Both are
the same math as the user's setting; ``capturable`` evaluates the bias
corrections in float32 tensors rather than Python floats, which is why Adam and
AdamW agree with eager to round-off (about 1e-7 relative) rather than bit for bit.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Iterator

import torch

from deft_compile.errors import UnsupportedOptimizerError

SUPPORTED_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.RMSprop,
    torch.optim.Adagrad,
)

# Optimizers whose learning rate enters the graph as an input (a 0-dim float64 tensor per param group,
# read with .item() inside the trace), so an LR scheduler does not retrace. Checked against eager for
# every one of them (tests/test_local.py); Adagrad's ``lr / (1 + (step - 1) * lr_decay)`` with a
# symbolic lr traced to wrong numbers, so its lr stays a graph constant (a change retraces).
LR_INPUT_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.RMSprop,
)

# Adam's and AdamW's capturable update divides by the step size, lr / (1 - beta1^t): at lr = 0 that gives
# 0 / 0 = NaN wherever the second moment is 0 (an embedding row no batch has used yet), where eager's
# non-capturable update, with Python floats, adds 0. A zero learning rate (a warm-up's first step, a linear decay's
# end) enters their graphs as this instead: every update it gives is below 1e-28 in absolute value, so only a
# parameter that is exactly 0 can move, and by less than that.
ZERO_LR_STANDIN = 1e-30
_DIVIDES_BY_LR = (torch.optim.Adam, torch.optim.AdamW)

# Options forced while tracing; restored afterwards.
_TRACE_OVERRIDES = {"foreach": False, "fused": False}
_CAPTURABLE_OPTIMIZERS = (torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop)


def check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Raise ``UnsupportedOptimizerError`` unless every update is per-parameter."""
    kind = type(optimizer)
    if kind not in SUPPORTED_OPTIMIZERS:
        names = ", ".join(o.__name__ for o in SUPPORTED_OPTIMIZERS)
        raise UnsupportedOptimizerError(
            f"{kind.__module__}.{kind.__qualname__} is not supported: deft_compile needs an optimizer "
            f"whose update of each parameter reads only that parameter's gradient and state "
            f"(supported: {names}). Optimizers that couple parameters, such as LBFGS or a "
            f"global-norm clip inside step(), cannot be bucketed or delayed."
        )
    for index, group in enumerate(optimizer.param_groups):
        if group.get("differentiable", False):
            raise UnsupportedOptimizerError(
                f"param group {index} has differentiable=True; deft_compile captures a "
                f"non-differentiable update"
            )
        for key, value in group.items():
            if isinstance(value, torch.Tensor) and key != "params":
                raise UnsupportedOptimizerError(
                    f"param group {index} has a tensor hyper-parameter {key!r}; pass a Python number"
                )


def lr_is_input(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the captured step takes each param group's learning rate as an input."""
    return type(optimizer) in LR_INPUT_OPTIMIZERS


def lr_inputs(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The learning-rate inputs of a captured step: one 0-dim float64 tensor per param group (exact; for Adam and
    AdamW a zero learning rate is ``ZERO_LR_STANDIN``)."""
    if not lr_is_input(optimizer):
        return []
    standin = isinstance(optimizer, _DIVIDES_BY_LR)
    return [torch.tensor(ZERO_LR_STANDIN if standin and float(group["lr"]) == 0.0 else float(group["lr"]),
                         dtype=torch.float64) for group in optimizer.param_groups]


def hyperparameter_key(optimizer: torch.optim.Optimizer) -> tuple:
    """A hashable fingerprint of every group's hyper-parameters that are graph constants.

    Those are baked into the graph, so a change must select or build another
    graph rather than reuse a stale one. The learning rate is a graph input
    where :func:`lr_is_input` says so, and then left out: an LR scheduler's
    step reuses the graph.
    """
    skip = {"params", "lr"} if lr_is_input(optimizer) else {"params"}
    return tuple(
        tuple(sorted((k, _freeze(v)) for k, v in group.items() if k not in skip))
        for group in optimizer.param_groups
    )


def _freeze(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    return value


@contextlib.contextmanager
def traceable_optimizer(
    optimizer: torch.optim.Optimizer,
    params: list[torch.Tensor],
    param_index: dict[torch.Tensor, int],
    state: dict[int, dict[str, Any]],
    learning_rates: list[Any] | None = None,
) -> Iterator[dict[torch.Tensor, dict[str, Any]]]:
    """Point ``optimizer`` at traced tensors for the duration of a trace.

    ``params`` are the tensors the traced function sees (graph inputs), in the
    capture's order; ``param_index`` maps each live parameter to its position;
    ``state`` holds, per position, the optimizer state to start from. Yields the
    state dict keyed by the traced tensors, which the optimizer fills in place.
    ``learning_rates`` (one per group, e.g. symbolic floats read from graph
    inputs) replace the groups' ``lr``. Everything is restored afterwards, even
    when tracing fails.
    """
    saved_groups = [dict(group) for group in optimizer.param_groups]
    saved_state = optimizer.state
    traced_state = _StateDict()
    try:
        for group in optimizer.param_groups:
            group["params"] = [params[param_index[p]] for p in group["params"]]
            for key, value in _TRACE_OVERRIDES.items():
                if key in group:
                    group[key] = value
            if isinstance(optimizer, _CAPTURABLE_OPTIMIZERS):
                group["capturable"] = True
        for group, lr in zip(optimizer.param_groups, learning_rates or []):
            group["lr"] = lr
        for index, entries in state.items():
            traced_state[params[index]] = dict(entries)
        optimizer.state = traced_state
        yield traced_state
    finally:
        for group, saved in zip(optimizer.param_groups, saved_groups):
            group.clear()
            group.update(saved)
        optimizer.state = saved_state


class _StateDict(dict):
    """``defaultdict(dict)`` keyed by tensor identity, like ``Optimizer.state``."""

    def __missing__(self, key: torch.Tensor) -> dict:
        value: dict = {}
        self[key] = value
        return value


#: optimizers whose state ``initialize_state`` creates before the first capture: the Adam family and RMSprop
#: through torch's own lazy initialisation (``_init_group``, which reads no gradient value), SGD's momentum buffer
#: as zeros where a zero buffer's first update equals the lazy one (``dampening == 0``: 0·m + g = g exactly)
_INITIALIZED_BY_INIT_GROUP = (torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop)


def initialize_state(optimizer: torch.optim.Optimizer, trained: list[torch.Tensor]) -> bool:
    """Create ``optimizer``'s state for the parameters ``trained`` (those the first step gives a gradient) as its
    first update would, before that update: the step is then captured once with its state as graph inputs,
    instead of once without state (the traced update creating it) and again from the second call on.

    The state is what the traced first update creates: torch's ``_init_group`` run under the trace's settings
    (single-tensor, ``capturable`` where the optimizer has it: ``traceable_optimizer``), so a step counter is a
    0-dim tensor at 0 on the parameter's device and the moments are zeros; the first update then computes what it
    would from no state. SGD gets zero momentum buffers where ``momentum > 0`` and ``dampening == 0``. Returns
    False, creating nothing, for any other optimizer or setting (a subclass, Adagrad, whose state exists from its
    constructor, SGD with dampening), or where some parameter has state already."""
    kind = type(optimizer)
    if kind not in (*_INITIALIZED_BY_INIT_GROUP, torch.optim.SGD) or any(optimizer.state.get(p) for p in trained):
        return False
    wanted = {id(p) for p in trained}
    if kind is torch.optim.SGD:
        if any(group["momentum"] != 0 and group["dampening"] != 0 for group in optimizer.param_groups):
            return False
        for group in optimizer.param_groups:
            if group["momentum"] != 0:
                for p in group["params"]:
                    if id(p) in wanted:
                        optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return True
    saved_grads = {p: p.grad for group in optimizer.param_groups for p in group["params"]}
    saved_groups = [dict(group) for group in optimizer.param_groups]
    try:
        for group in optimizer.param_groups:
            group.update({key: value for key, value in _TRACE_OVERRIDES.items() if key in group})
            group["capturable"] = True
            for p in group["params"]:
                p.grad = torch.zeros_like(p) if id(p) in wanted else None
            outputs = len(inspect.signature(optimizer._init_group).parameters) - 1  # every argument after the group
            with torch.no_grad():
                optimizer._init_group(group, *([] for _ in range(outputs)))
    finally:
        for group, saved in zip(optimizer.param_groups, saved_groups):
            group.clear()
            group.update(saved)
        for p, grad in saved_grads.items():
            p.grad = grad
    return True
