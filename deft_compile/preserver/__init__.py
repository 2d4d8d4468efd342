"""DeFT's Preserver: watch the convergence cost of delays and periods, re-plan when it is too high.

``decisions`` holds the torch-free decisions (``Preserver``, ``PreserverConfig``),
``monitor`` measures its signals around compiled steps and applies them,
``staleness`` measures a bucket's same-minibatch staleness error.
"""

from deft_compile.preserver.decisions import Preserver, PreserverConfig, PreserverEvent

__all__ = ["Preserver", "PreserverConfig", "PreserverEvent"]
