"""What a compiled region is keyed by: its graph's structure (``structure_key``) and its inputs' shapes, strides,
dtypes and devices (``input_signature``). Shared by ``regions`` (one compile per structure) and ``flat_updates``
(one compile per optimizer form, the parameter's shape written as ``*``)."""

from __future__ import annotations

import hashlib
from typing import Any, Sequence

import torch
import torch.fx as fx


def structure_key(graph: fx.Graph, hide_shape: tuple[int, ...] | None = None) -> str:
    """A digest of a graph's structure: each node's op, target and arguments (other nodes by position, constants
    by value), not its names, so two layers of the same shape and code get one key. ``hide_shape``: placeholders
    of that shape are written with ``*`` for it (``flat_updates``: one key for every parameter's update)."""
    position: dict[fx.Node, int] = {}
    lines = []

    def describe(value: Any) -> Any:
        if isinstance(value, fx.Node):
            return f"%{position[value]}"
        if isinstance(value, (list, tuple)):
            return type(value)(describe(v) for v in value)
        if isinstance(value, dict):
            return {k: describe(v) for k, v in value.items()}
        return repr(value)

    for node in graph.nodes:
        position[node] = len(position)
        target = node.target
        if node.op == "placeholder":
            value = node.meta.get("val")
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else None
            if shape is not None and hide_shape is not None and shape == hide_shape:
                shape = "*"
            target = (shape, str(value.dtype)) if isinstance(value, torch.Tensor) else type(value).__name__
        lines.append(f"{node.op}|{target}|{describe(node.args)}|{describe(dict(node.kwargs))}")
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:24]


def input_signature(values: Sequence[Any]) -> tuple:
    """What a compiled region is specialised on besides its structure: each input's shape, stride, dtype and
    device (tensors), or its type (anything else)."""
    return tuple(
        (tuple(v.shape), tuple(v.stride()), v.dtype, v.device.type) if isinstance(v, torch.Tensor) else type(v).__name__
        for v in values
    )
