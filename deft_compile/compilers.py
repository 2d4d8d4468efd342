"""What runs a step graph (``DeftConfig.compiler``): the names, the default and the check, without importing torch."""

from __future__ import annotations

import os
from typing import Any

#: ``inductor``: regional Inductor lowering (the default); ``inductor-graph``: the whole graph at once (opt-in);
#: ``aten``: the graph's aten ops called from Python (docs/ARCHITECTURE.md, "Lowering with Inductor").
COMPILERS: tuple[str, ...] = ("inductor", "inductor-graph", "aten")
ENV_COMPILER = "DEFT_COMPILER"


def default_compiler() -> str:
    """``$DEFT_COMPILER`` if set (the test suite sets ``aten``), else ``"inductor"``."""
    value = os.environ.get(ENV_COMPILER, "inductor")
    check_compiler(value, source=f"${ENV_COMPILER}")
    return value


def check_compiler(value: Any, source: str = "compiler") -> None:
    if value not in COMPILERS:
        raise ValueError(f"{source} must be one of {', '.join(map(repr, COMPILERS))}; got {value!r}")
