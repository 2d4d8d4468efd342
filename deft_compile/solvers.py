"""Alias import path of ``deft_compile.planner.solvers``.

``import deft_compile.solvers`` gives the very module ``deft_compile.planner.solvers`` (one module object, so
classes and registries are shared); new code should import ``deft_compile.planner.solvers``.
"""

import importlib
import sys

sys.modules[__name__] = importlib.import_module("deft_compile.planner.solvers")
