"""DeFT's Profiler and Solver: profile in, plan out.

``plan`` is the data model (``Profile``, ``Plan``, ``CommItem``), ``bucketing``
DDP's bucket assignment, ``solvers`` one solver per policy (the knapsacks),
``simulator`` the timeline model of DESIGN.md §3, ``zoo_profiles`` paper-scale
profiles. Everything here but ``profiler`` (which measures a captured step) is
torch-free, so planning is unit-testable without processes.
"""
