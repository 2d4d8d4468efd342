"""Refuse a traced step that draws random numbers after its forward pass: activation checkpointing with Dropout.

Activation checkpointing (``torch.utils.checkpoint``, ``gradient_checkpointing_enable()``) recomputes
part of the forward pass during backward. Eager restores the random state first, so a recomputed
Dropout draws the forward's mask again. The trace records the recomputation's ops but not that
restore: in the captured graph the recomputed Dropout draws a new mask, and the gradients belong to
a forward that never ran. Any op tagged ``nondeterministic_seeded`` after the end-of-forward marker is
that case (backward and the optimizer's update draw no random numbers of their own), and raises
``TraceError``; an op that draws only through a ``dropout_p``/``p`` argument (attention, dropout) does
not count when that is 0 or ``train`` is False, nor does a ``*_backward`` kernel (fused attention's
backward replays its forward's dropout from the seed that forward returned). Without random draws in the recomputed layers the
trace is exact, and nothing is raised.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from deft_compile.errors import TraceError
from deft_compile.ir.ops import PHASE


def check_no_random_after_forward(graph_module: fx.GraphModule) -> None:
    forward_done = False
    for node in graph_module.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is PHASE:
            forward_done = True
        elif forward_done and _draws_random_numbers(node):
            raise TraceError(
                f"the step draws random numbers after its forward pass ({node.target}): part of the forward is "
                f"recomputed in backward (activation checkpointing: torch.utils.checkpoint, "
                f"gradient_checkpointing_enable(), TrainingArguments(activation_checkpointing=True)), and the "
                f"traced graph draws new random numbers there where eager restores the forward's, so a recomputed "
                f"Dropout would give wrong gradients. Turn activation checkpointing off (the compiled step holds the "
                f"whole graph either way), or its layers' dropout"
            )


def _draws_random_numbers(node: fx.Node) -> bool:
    if not (isinstance(node.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in node.target.tags):
        return False
    if node.target._schema.name.endswith("_backward"):
        return False
    values = {}
    for position, argument in enumerate(node.target._schema.arguments):
        if position < len(node.args):
            values[argument.name] = node.args[position]
        elif argument.name in node.kwargs:
            values[argument.name] = node.kwargs[argument.name]
        elif argument.has_default_value():
            values[argument.name] = argument.default_value
    if values.get("train") is False:
        return False
    return not any(isinstance(values.get(name), (int, float)) and values[name] == 0 for name in ("dropout_p", "p"))
