"""deft_compile: gradient-communication scheduling for data-parallel PyTorch as an FX pass."""

from deft_compile.config import DeftConfig
from deft_compile.api import deft_compile

__all__ = ["DeftConfig", "deft_compile"]
__version__ = "0.1.0"
