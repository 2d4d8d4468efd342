"""The training step: capture it into one FX graph, profile it, plan it, run the pass list, execute it.

``capture`` traces forward, loss, backward and the optimizer update into an aten graph; ``annotate`` finds each
parameter's gradient, first forward use and update; ``profiler`` times the captured step and the links;
``scheduling`` turns a plan into the items the ``schedule`` pass executes; ``pipeline`` runs the ordered passes
and ``lowering`` (with ``regions``) runs the result. ``runtime`` is the ``CompiledStep`` users call: its process
groups (``groups``), its runner (``runner``) with its graph cache (``graph_cache``), its planning owner
(``planning``, which owns the closed loop's measuring, ``closed_loop``, and the Preserver's hookup) and the
policy's run-time hooks (``policy_runtime``). The controllers see the step through ``handle``.
"""
