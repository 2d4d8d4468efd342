"""DeFT's Solver and the planning rules around it: profile in, plan out, torch-free.

``plan`` is the data model (``Profile``, ``Plan``, ``CommItem``), ``bucketing`` DDP's bucket assignment,
``solvers`` one solver per policy (the knapsacks), ``simulator`` the timeline model, ``stability`` the guard
against re-plans that gain nothing, ``closed_loop`` and ``refine`` closed-loop planning's rules and refinement,
``link_fit`` a link's cost from timed all-reduces, ``zoo_profiles`` paper-scale profiles. Nothing here imports
torch (the profiler that measures a captured step is ``deft_compile.step.profiler``), so planning is
unit-testable without processes.
"""
