"""deft_compile: gradient-communication scheduling for data-parallel PyTorch as an FX pass.

``deft_compile`` and ``DeftConfig`` are imported lazily so that the pure planning
modules (``deft_compile.planner.plan``, ``.simulator``, ``.solvers``) load without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["DeftConfig", "deft_compile"]
__version__ = "0.1.0"

if TYPE_CHECKING:
    from deft_compile.api import deft_compile
    from deft_compile.config import DeftConfig


def __getattr__(name: str) -> Any:
    if name == "deft_compile":
        from deft_compile.api import deft_compile

        return deft_compile
    if name == "DeftConfig":
        from deft_compile.config import DeftConfig

        return DeftConfig
    raise AttributeError(f"module 'deft_compile' has no attribute {name!r}")
