"""DLCP-style bounded-loss communication: prioritised chunks, deadline, error feedback.

DLCP (domain-specific communication) exploits SGD's tolerance of bounded
gradient loss: gradients are cut into chunks, sent in priority order (input-side
layers first, then larger magnitudes), and when a step's communication would
pass a deadline the lowest-priority chunks are dropped, but never more than a
bounded fraction of the gradient mass. Here the dropped chunks are kept on each
rank and added to the next step's gradient (error feedback), so nothing is lost
for good. The plan is one communication item over every gradient; the chunking,
the ordering and the drop decision happen in the graph (``passes/schedule.py``)
from chunk magnitudes summed over all ranks, so every rank drops the same chunks.

Options: ``deadline_ms`` (None: no deadline, send everything: DDP's numbers),
``max_loss`` (fraction of the squared gradient norm that may be dropped in a
step), ``chunk_bytes``. The deadline becomes a chunk budget with the profile's
link cost: the largest n with ``alpha + beta * n * chunk_bytes <= deadline_ms``.
"""

from __future__ import annotations

import math

from deft_compile.planner.plan import Plan, Profile
from deft_compile.planner.solvers.common import finish
from deft_compile.planner.solvers.wfbp import wfbp_items

DEFAULT_CHUNK_BYTES = 64 * 1024


def chunk_budget(profile: Profile, deadline_ms: float | None, chunk_bytes: int, total_chunks: int, link: int = 0) -> int:
    """How many chunks fit in the deadline on ``link`` (all of them without a deadline)."""
    if deadline_ms is None:
        return total_chunks
    cost = profile.links[link]
    if cost.beta_ms_per_byte <= 0:
        return total_chunks
    fit = math.floor((deadline_ms - cost.alpha_ms) / (cost.beta_ms_per_byte * chunk_bytes))
    return max(0, min(total_chunks, fit))


def solve_dlcp(
    profile: Profile,
    *,
    deadline_ms: float | None = None,
    max_loss: float = 0.1,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> Plan:
    """One item over all gradients; the drop rule travels in the plan's options."""
    if not 0.0 <= max_loss < 1.0:
        raise ValueError("max_loss must be in [0, 1)")
    if chunk_bytes <= 0:
        raise ValueError("chunk_bytes must be positive")
    # One flat buffer per dtype (a collective carries one dtype); the deadline's chunk budget is
    # shared between them in proportion to their bytes.
    groups: dict[str, list[int]] = {}
    for index, param in enumerate(profile.params):
        groups.setdefault(param.dtype, []).append(index)
    everything = list(groups.values())
    total_chunks = math.ceil(profile.total_bytes / chunk_bytes)
    budget = chunk_budget(profile, deadline_ms, chunk_bytes, total_chunks)
    budgets = [budget * sum(profile.params[i].nbytes for i in group) // profile.total_bytes for group in everything]
    options = {"deadline_ms": deadline_ms, "max_loss": float(max_loss), "chunk_bytes": int(chunk_bytes),
               "chunk_budget": budget, "item_budgets": budgets}
    return finish(profile, "dlcp", wfbp_items(profile, everything), options,
                  {"chunks": total_chunks, "note": "predicted without dropping (an upper bound)"})
