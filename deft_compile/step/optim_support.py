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
    """Whether the captured step takes each param group's learning rate (and ``VALUE_INPUTS``) as inputs."""
    return type(optimizer) in LR_INPUT_OPTIMIZERS


#: the hyper-parameters besides the learning rate that enter the graph as inputs, per optimizer with an lr input.
#: The update's arithmetic reads them from 0-dim float64 inputs, like the rate, so its compiled code holds no value
#: of them and param groups that differ only in them share one compile (``step/flat_updates.py``).
#: - Those in ``BRANCHING`` decide which ops the update runs (``if weight_decay != 0``, ``if momentum > 0``): an input
#:   where not 0, a constant 0 otherwise (the branch not taken), so their zero-ness stays part of the graph's
#:   structure. Taking the branch at 0 would not be exact where the term is added: ``g + 0 · w`` is NaN at an
#:   infinite weight, where eager adds nothing.
#: - AdamW's decoupled decay is always an input, its branch always taken: ``w · (1 − lr · 0)`` multiplies by exactly
#:   1, so the no-decay group (biases, norms) shares the decayed group's compile, as transformers' two groups do.
#: - Adam's and AdamW's betas and eps stay constants: with a constant β the compiled bias correction 1 − β^t keeps
#:   double precision, while a float64 input's power is taken in the step counter's float32 (1 − β2^t loses 1e-5 of
#:   itself at β2 = 0.999, t = 1).
VALUE_INPUTS: dict[type, tuple[str, ...]] = {
    torch.optim.SGD: ("momentum", "dampening", "weight_decay"),
    torch.optim.Adam: ("weight_decay",),
    torch.optim.AdamW: ("weight_decay",),
    torch.optim.RMSprop: ("alpha", "eps", "weight_decay", "momentum"),
}
BRANCHING = frozenset({"momentum", "dampening", "weight_decay"})
#: (optimizer, name) of the branching inputs that stay inputs at 0, their branch taken (exact there)
_ALWAYS_INPUT = frozenset({(torch.optim.AdamW, "weight_decay")})

HyperSlot = tuple[int, str]  # (param group, name): "lr", "weight_decay", ...


def hyperparameter_slots(optimizer: torch.optim.Optimizer) -> list[HyperSlot]:
    """The hyper-parameter inputs of a captured step, in graph-input order: per param group its learning rate, then
    its ``VALUE_INPUTS`` (a ``BRANCHING`` one only where it is not 0, AdamW's weight decay always). None for an
    optimizer whose rate is a constant (``lr_is_input``)."""
    if not lr_is_input(optimizer):
        return []
    slots: list[HyperSlot] = []
    for g, group in enumerate(optimizer.param_groups):
        slots.append((g, "lr"))
        for name in VALUE_INPUTS[type(optimizer)]:
            if name not in BRANCHING or float(group[name]) != 0.0 or (type(optimizer), name) in _ALWAYS_INPUT:
                slots.append((g, name))
    return slots


def hyperparameter_value(optimizer: torch.optim.Optimizer, slot: HyperSlot) -> float:
    """The value of one hyper-parameter input, as the graph reads it (for Adam and AdamW a zero learning rate is
    ``ZERO_LR_STANDIN``)."""
    group, name = optimizer.param_groups[slot[0]], slot[1]
    value = float(group[name])
    if name == "lr" and value == 0.0 and isinstance(optimizer, _DIVIDES_BY_LR):
        return ZERO_LR_STANDIN
    return value


def hyperparameter_inputs(optimizer: torch.optim.Optimizer, slots: list[HyperSlot] | None = None) -> list[torch.Tensor]:
    """The hyper-parameter inputs of a captured step (``slots``: its ``GraphLayout.hyper_inputs``; by default the
    optimizer's ``hyperparameter_slots`` now): one 0-dim float64 tensor each, exact."""
    if slots is None:
        slots = hyperparameter_slots(optimizer)
    return [torch.tensor(hyperparameter_value(optimizer, slot), dtype=torch.float64) for slot in slots]


def traced_hyperparameters(slots: list[HyperSlot], values: list[Any]) -> list[dict[str, Any]]:
    """Per param group, the values the traced update reads in place of the group's (symbolic floats read from the
    inputs): a ``BRANCHING`` one is declared not 0 (``torch._check``), so the update's branch on it is taken: as the
    group's value would take it, or at 0 where taking it is exact (``_ALWAYS_INPUT``). The declaration is the
    trace's alone: no check of it runs in the graph."""
    groups: dict[int, dict[str, Any]] = {}
    for (g, name), value in zip(slots, values):
        if name in BRANCHING:
            torch._check(value != 0)
            if name == "momentum":  # RMSprop branches on momentum > 0; the constructors refuse a negative one
                torch._check(value > 0)
        groups.setdefault(g, {})[name] = value
    return [groups[g] for g in sorted(groups)]


def hyperparameter_key(optimizer: torch.optim.Optimizer) -> tuple:
    """A hashable fingerprint of every group's hyper-parameters but the learning rate.

    Constants are baked into the graph, so a change must select or build another
    graph rather than reuse a stale one. The learning rate is a graph input
    where :func:`lr_is_input` says so, and then left out: an LR scheduler's
    step reuses the graph. The other ``VALUE_INPUTS`` stay in the key although
    the graph reads them as inputs: whether a ``BRANCHING`` one is 0 decides the
    graph's ops, and a compensated plan's rewrite reads momentum and betas as
    constants. A change of them captures again; the compiled regions, which hold
    no value of them, are reused.
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
    hyperparameters: list[dict[str, Any]] | None = None,
) -> Iterator[dict[torch.Tensor, dict[str, Any]]]:
    """Point ``optimizer`` at traced tensors for the duration of a trace.

    ``params`` are the tensors the traced function sees (graph inputs), in the
    capture's order; ``param_index`` maps each live parameter to its position;
    ``state`` holds, per position, the optimizer state to start from. Yields the
    state dict keyed by the traced tensors, which the optimizer fills in place.
    ``hyperparameters`` (per group, the values that replace the group's:
    symbolic floats read from graph inputs, ``traced_hyperparameters``) replace
    the groups' values. Everything is restored afterwards, even when tracing fails.
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
        for group, values in zip(optimizer.param_groups, hyperparameters or []):
            group.update(values)
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
