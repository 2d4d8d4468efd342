"""Alias import path of ``deft_compile.planner.plan``.

``import deft_compile.plan`` gives the very module ``deft_compile.planner.plan`` (one module object, so
classes and registries are shared); new code should import ``deft_compile.planner.plan``.
"""

import importlib
import sys

sys.modules[__name__] = importlib.import_module("deft_compile.planner.plan")
