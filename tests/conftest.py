"""Test-suite defaults.

Most tests check scheduling, numerics against DDP or error behaviour, not the
compiler, so they run the step graph as aten (no Inductor compile per graph):
``DEFT_COMPILER=aten`` unless the environment already says otherwise. Spawned
workers inherit it. Tests of the Inductor lowering pass ``compiler="inductor"``
explicitly (tests/test_inductor.py).
"""

import os

os.environ.setdefault("DEFT_COMPILER", "aten")
