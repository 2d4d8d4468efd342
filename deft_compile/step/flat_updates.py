"""One compiled optimizer update for every parameter of one optimizer form, whatever its shape.

A parameter's update region (``regions.tag_regions``: ``("update", p)``) is element-wise: every tensor it reads
or makes has the parameter's shape or is a 0-dim scalar (the step counter, the learning rate, the bias
corrections), and every op on the parameter-shaped tensors is point-wise (``torch.Tag.pointwise``) or makes a
tensor like its input (``zeros_like``, ``clone``, a dtype cast). Such a region computes the same numbers on the
flattened tensors: each element's arithmetic is the same, in the same order. So it compiles once, for 1-D inputs
of a symbolic length, and runs every parameter of that optimizer form (same optimizer, hyper-parameters and
dtypes: the same region structure once shapes are left out) on ``x.view(-1)`` of its contiguous tensors, at any
storage offset (a gradient is a view into its bucket's flat buffer).

A region that is not element-wise in this sense (a reduction, a view, a broadcast between shapes), inputs that
are not contiguous, a parameter of fewer than two elements (a size-0 or size-1 dimension is specialised, as in
``torch.compile``) or a length the compiled code's guards do not admit run the region compiled for its own
shapes, as every other region does.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from deft_compile.step.region_keys import structure_key

#: ops that make a tensor of their input's shape without being tagged point-wise
_LIKE_OPS = {
    torch.ops.aten.zeros_like.default, torch.ops.aten.ones_like.default, torch.ops.aten.empty_like.default,
    torch.ops.aten.full_like.default, torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default,
    torch.ops.aten.copy.default, torch.ops.aten.detach.default, torch.ops.aten.alias.default,
}
#: the flat compile's storage-offset hints start here (``FlatUpdate.fake_inputs``)
_OFFSET_HINT = 2
#: keyword arguments of ``_to_copy`` and the ``*_like`` ops that keep the shape and the element order
_LIKE_KWARGS = {"dtype", "layout", "device", "pin_memory", "memory_format", "non_blocking"}


@dataclass
class FlatUpdate:
    """What makes an update region element-wise: the one shape its tensors share, and its structure without it."""

    shape: tuple[int, ...]
    key: str
    _admitted: dict[tuple, bool] = field(default_factory=dict)

    @classmethod
    def of(cls, segment: Any) -> "FlatUpdate | None":
        """The segment's flat form, or None when it is not an element-wise update region (module docstring)."""
        region = segment.region
        if region is None or region[0] != "update":
            return None
        graph = segment.module.graph
        shapes: set[tuple[int, ...]] = set()
        for node in graph.nodes:
            for value in _tensors(node.meta.get("val")):
                if value.dim() > 0:
                    if any(not isinstance(d, int) for d in value.shape):
                        return None
                    shapes.add(tuple(value.shape))
            if node.op == "call_function" and not _elementwise(node):
                return None
        if len(shapes) != 1:
            return None
        shape = next(iter(shapes))
        if _numel(shape) < 2:
            return None
        return cls(shape, _shapeless_key(graph, shape))

    def conforms(self, inputs: Sequence[Any]) -> bool:
        """Whether a call's inputs can run flattened: every tensor of more than 0 dimensions has the shape and is
        contiguous."""
        return all(not isinstance(v, torch.Tensor) or v.dim() == 0 or (tuple(v.shape) == self.shape
                                                                       and v.is_contiguous()) for v in inputs)

    def fake_inputs(self, inputs: Sequence[Any]) -> tuple[list[Any], Any]:
        """Fake inputs of a new shape environment for the flat compile: 1-D of one symbolic length, each at a
        symbolic storage offset of its own, where ``inputs`` have the shape; 0-dim as they are; and the fake mode.
        The offsets are symbolic because a parameter's gradient is a view into its bucket's flat buffer: a compile
        for offset 0 would guard on it and serve no other parameter of the form."""
        from torch._dynamo.source import ConstantSource
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

        mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)
        length = None
        fakes: list[Any] = []
        for index, value in enumerate(inputs):
            if not isinstance(value, torch.Tensor) or value.dim() == 0:
                fakes.append(mode.from_tensor(value, static_shapes=True) if isinstance(value, torch.Tensor) else value)
                continue
            if length is None:
                length = mode.from_tensor(torch.empty(_numel(self.shape), dtype=value.dtype, device=value.device),
                                          symbolic_context=StatelessSymbolicContext(
                                              dynamic_sizes=[DimDynamic.DYNAMIC])).shape[0]
            # a hint other than 0 and 1, which a shape environment specialises
            offset = mode.shape_env.create_unspecified_symint_and_symbol(
                _OFFSET_HINT + index, ConstantSource(f"flat_update_offset_{index}"), DimDynamic.DYNAMIC)
            with mode:
                base = torch.empty_strided((length + offset,), (1,), dtype=value.dtype, device=value.device)
                fakes.append(base.as_strided((length,), (1,), offset))
        return fakes, mode

    def admits(self, fakes: Sequence[Any], mode: Any, inputs: Sequence[Any]) -> bool:
        """Whether the guards the flat compile recorded admit this parameter's length and its tensors' storage
        offsets (memoised per length and offsets)."""
        numel = (_numel(self.shape),
                 tuple(v.storage_offset() for v in inputs if isinstance(v, torch.Tensor) and v.dim() > 0))
        if numel not in self._admitted:
            env = mode.shape_env
            flat = [v.reshape(-1) if isinstance(v, torch.Tensor) and v.dim() > 0 else v for v in inputs]
            tensors = [(f, v) for f, v in zip(fakes, flat) if isinstance(f, torch.Tensor)]
            code = env.produce_guards_expression([f for f, _ in tensors], ignore_static=False)
            self._admitted[numel] = code is None or bool(env.evaluate_guards_expression(code, [v for _, v in tensors]))
        return self._admitted[numel]


def flat_callable(compiled: Callable[..., Any], segment: Any) -> Callable[..., Any]:
    """``compiled`` (1-D inputs) called with a region's inputs: tensors flattened, outputs shaped as recorded."""
    out_shapes = [tuple(v.shape) if isinstance(v, torch.Tensor) else None
                  for v in (node.meta.get("val") for node in segment.outputs)]

    def run(*values: Any) -> Any:
        flat = [v.view(-1) if isinstance(v, torch.Tensor) and v.dim() > 0 else v for v in values]
        results = compiled(*flat)
        return [r.view(s) if s is not None and isinstance(r, torch.Tensor) and tuple(r.shape) != s else r
                for r, s in zip(results, out_shapes)]

    return run


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, torch.Tensor)]
    return []


def _numel(shape: Sequence[int]) -> int:
    total = 1
    for d in shape:
        total *= d
    return total


def _elementwise(node: fx.Node) -> bool:
    """A point-wise op, a shape-keeping ``*_like``/cast/copy, or arithmetic on 0-dim values and Python scalars."""
    if all(v.dim() == 0 for a in node.all_input_nodes for v in _tensors(a.meta.get("val"))) and all(
            v.dim() == 0 for v in _tensors(node.meta.get("val"))):
        return True
    target = node.target
    if target in _LIKE_OPS:
        return set(node.kwargs) <= _LIKE_KWARGS
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags


def _shapeless_key(graph: fx.Graph, shape: tuple[int, ...]) -> str:
    """``structure_key`` with the shared shape written as ``*``: the same optimizer form, any parameter."""
    return hashlib.sha256(("flat|" + structure_key(graph, hide_shape=shape)).encode()).hexdigest()[:24]
