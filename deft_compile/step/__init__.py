"""The training step: capture it into one FX graph, annotate it, run the pass list, execute it.

``capture`` traces forward, loss, backward and the optimizer update into an aten
graph; ``annotate`` finds each parameter's gradient, first forward use and update;
``scheduling`` turns a plan into the items the ``schedule`` pass executes;
``pipeline`` runs the ordered passes; ``runtime`` is the ``CompiledStep`` users
call, with per-policy run-time hooks in ``policy_runtime``.
"""
