"""Remove the collectives of a one-process schedule: gradient accumulation without a process group.

Training without a process group (or on a one-rank group, like DS-Sync's solo groups
when it averages parameters) still needs the ``schedule`` pass when
``accumulation_steps > 1``: it is the pass that accumulates local gradients across
calls and applies the mean every N calls. Its items then name ``LOCAL_GROUP`` (no such
process group exists) or a one-rank group; this pass replaces each
``wait_tensor(all_reduce(x))`` on those groups by ``x`` (the sum over one rank is ``x``).
"""

from __future__ import annotations

import torch
import torch.fx as fx

c10d = torch.ops._c10d_functional
LOCAL_GROUP = ""  # the group name of items that never leave this process
_ALL_REDUCES = (c10d.all_reduce.default, c10d.all_reduce_.default)
_WAIT = c10d.wait_tensor.default


def elide_local_collectives(gm: fx.GraphModule, group_names: frozenset[str] = frozenset({LOCAL_GROUP})) -> fx.GraphModule:
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _ALL_REDUCES or node.args[2] not in group_names:
            continue
        for user in list(node.users):
            if user.op == "call_function" and user.target == _WAIT:
                user.replace_all_uses_with(node.args[0])
                gm.graph.erase_node(user)
        node.replace_all_uses_with(node.args[0])  # a pending (carried) result is the input itself
        gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    return gm
