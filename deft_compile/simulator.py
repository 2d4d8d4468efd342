"""Alias import path of ``deft_compile.planner.simulator``.

``import deft_compile.simulator`` gives the very module ``deft_compile.planner.simulator`` (one module object, so
classes and registries are shared); new code should import ``deft_compile.planner.simulator``.
"""

import importlib
import sys

sys.modules[__name__] = importlib.import_module("deft_compile.planner.simulator")
