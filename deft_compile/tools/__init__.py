"""What the ``deft-compile`` CLI runs for users: the demo and bench, explain and simulate, shaped links, the local
launcher (and its thread placement for accelerator emulation) and the model presets. Benchmark harnesses are in
``benchmarks/``."""
