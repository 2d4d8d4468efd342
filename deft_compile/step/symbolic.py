"""Input shapes that change: one capture per shape family, its changing dimensions symbols.

Like ``torch.compile``'s automatic dynamic shapes: a step is first captured for the exact shapes of its inputs.
When a later call brings the same inputs (number, dtypes, devices, ranks, constants, module modes, optimizer
state, autocast) with other sizes, the dimensions that changed become symbolic, and the step is captured once
more with those dimensions as symbols of a shape environment. Every later size of the family reuses that capture,
its step graphs and its compiled regions, as long as the guards the trace and Inductor recorded admit it; a size
they do not admit gets a static capture of its own (bounded by ``DeftConfig.max_cached_graphs``). A dimension the
caller marked with ``torch._dynamo.mark_dynamic`` is symbolic from the first call.

Parameters, buffers and optimizer state keep static shapes: the gradients, buckets and plan do not depend on an
input's length, so a new length is the same plan.

``ShapeFamilies`` decides which dimensions are symbolic (pure bookkeeping on shapes). ``SymbolicShapes`` holds a
symbolic capture's shape environment: its fake inputs, and the guard check for concrete inputs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch

log = logging.getLogger("deft_compile")

#: (user tensor index, dimension)
Dim = tuple[int, int]


class ShapeFamilies:
    """Which input dimensions have changed, per family of calls that differ only in sizes."""

    def __init__(self) -> None:
        self._first: dict[Any, tuple[tuple[int, ...], ...]] = {}
        self._dynamic: dict[Any, frozenset[Dim]] = {}

    def observe(self, family: Any, shapes: Sequence[tuple[int, ...]],
                marked: frozenset[Dim] = frozenset()) -> frozenset[Dim]:
        """Record a call's user-tensor shapes; the family's symbolic dimensions so far: those that ever changed, and
        those ``marked`` dynamic by the caller (``torch._dynamo.mark_dynamic``), symbolic from the first call."""
        shapes = tuple(tuple(s) for s in shapes)
        first = self._first.setdefault(family, shapes)
        changed = {(i, d) for i, (a, b) in enumerate(zip(first, shapes)) for d, (x, y) in enumerate(zip(a, b)) if x != y}
        changed |= marked
        dynamic = self._dynamic.get(family, frozenset())
        if not changed <= dynamic:
            dynamic = dynamic | changed
            self._dynamic[family] = dynamic
            log.info("input dimensions %s changed size; the step is captured with them symbolic", sorted(dynamic))
        return dynamic

    @staticmethod
    def marked(tensors: Sequence[torch.Tensor]) -> frozenset[Dim]:
        """The dimensions the caller marked with ``torch._dynamo.mark_dynamic``, a negative index counted from the
        end (the mark stores the index as given); an index outside the tensor's rank marks nothing."""
        return frozenset((i, d % t.dim()) for i, t in enumerate(tensors)
                         for d in getattr(t, "_dynamo_dynamic_indices", ()) if -t.dim() <= d < t.dim())

    @staticmethod
    def pattern(shapes: Sequence[tuple[int, ...]], dynamic: frozenset[Dim]) -> tuple:
        """The shapes with the symbolic dimensions left out (``None``): the key every size of the family shares."""
        return tuple(tuple(None if (i, d) in dynamic else size for d, size in enumerate(shape))
                     for i, shape in enumerate(shapes))


@dataclass
class SymbolicShapes:
    """A symbolic capture's shape environment and the guard check of concrete inputs against it."""

    fake_mode: Any
    fake_inputs: list[Any]
    user_indices: list[int]
    dims: frozenset[Dim]
    _guard_code: tuple[int, str | None] | None = field(default=None, repr=False)

    @classmethod
    def for_inputs(cls, example: Sequence[Any], user_indices: Iterable[int], dims: frozenset[Dim]) -> "SymbolicShapes":
        """Fake tensors of a new shape environment for ``example`` (the capture's graph inputs): the user tensors'
        ``dims`` symbolic, every other size static."""
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

        user_indices = list(user_indices)
        fake_mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)
        fakes: list[Any] = []
        for position, value in enumerate(example):
            if not isinstance(value, torch.Tensor):
                fakes.append(value)
                continue
            user = user_indices.index(position) if position in user_indices else None
            if user is not None and any((user, d) in dims for d in range(value.dim())):
                context = StatelessSymbolicContext(dynamic_sizes=[
                    DimDynamic.DYNAMIC if (user, d) in dims else DimDynamic.STATIC for d in range(value.dim())])
                fakes.append(fake_mode.from_tensor(value, symbolic_context=context))
            else:
                fakes.append(fake_mode.from_tensor(value, static_shapes=True))
        return cls(fake_mode, fakes, user_indices, dims)

    @property
    def shape_env(self) -> Any:
        return self.fake_mode.shape_env

    @property
    def user_fakes(self) -> list[Any]:
        return [self.fake_inputs[i] for i in self.user_indices]

    def admits(self, user_tensors: Sequence[torch.Tensor]) -> bool:
        """Whether concrete user tensors satisfy every guard recorded so far (by the trace and by Inductor)."""
        env = self.shape_env
        version = len(env.guards) + len(env.replacements) + len(env.var_to_range)
        if self._guard_code is None or self._guard_code[0] != version:
            self._guard_code = (version, env.produce_guards_expression(self.user_fakes, ignore_static=False))
        code = self._guard_code[1]
        return True if code is None else bool(env.evaluate_guards_expression(code, list(user_tensors)))

    def rebase_sizes(self, gm: Any) -> Any:
        """The captured graph with every symbolic size computed from the inputs (``passes.symbolic_sizes``)."""
        from deft_compile.passes.symbolic_sizes import rebase_symbolic_sizes

        return rebase_symbolic_sizes(gm)


def conforms(examples: Sequence[Any], inputs: Sequence[Any]) -> bool:
    """Whether concrete ``inputs`` are instances of symbolic ``examples``: the same dtypes, devices and ranks, and
    every size and stride the value of the example's expression once its symbols are bound from the inputs."""
    import sympy

    from deft_compile.passes.symbolic_sizes import size_expr

    pairs = []
    for example, value in zip(examples, inputs):
        if not isinstance(example, torch.Tensor) or not isinstance(value, torch.Tensor):
            if type(example) is not type(value):
                return False
            continue
        if example.dim() != value.dim() or example.dtype != value.dtype or example.device.type != value.device.type:
            return False
        pairs += zip((*example.shape, *example.stride()), (*value.shape, *value.stride()))
    binding: dict[Any, int] = {}
    for size, actual in pairs:
        expr = size_expr(size)
        if isinstance(expr, sympy.Symbol) and binding.setdefault(expr, sympy.Integer(actual)) != actual:
            return False
    for size, actual in pairs:
        expr = size_expr(size).xreplace(binding)
        if expr.free_symbols or int(expr) != actual:
            return False
    return True


def is_symbolic(value: Any) -> bool:
    """Whether a tensor (fake, from a capture) has a symbolic size or stride."""
    return isinstance(value, torch.Tensor) and any(
        isinstance(d, torch.SymInt) for d in (*value.shape, *value.stride()))
