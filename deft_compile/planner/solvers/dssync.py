"""DS-Sync (divide-and-shuffle synchronisation): average within small groups that reshuffle.

Workers are split into groups of ``group_size``; each step a worker averages
its gradients only with its group, so an all-reduce spans ``group_size``
workers instead of all of them. Every ``shuffle_every`` steps the grouping is
redrawn from a permutation seeded by ``(seed, round)``, identical on every rank,
so information mixes across the whole job; a global average at the end (and at
``flush()``) restores one model. Communication items are DDP's buckets; only
the process group changes from step to step.
"""

from __future__ import annotations

import random

from deft_compile.planner.bucketing import DDP_BUCKET_CAP_BYTES, DDP_FIRST_BUCKET_BYTES
from deft_compile.planner.plan import WIRE_FULL, Plan, Profile
from deft_compile.planner.solvers.common import finish, wire_option
from deft_compile.planner.solvers.wfbp import wfbp_items


def dssync_partition(world_size: int, group_size: int, step: int, *, seed: int = 0, shuffle_every: int = 1) -> list[tuple[int, ...]]:
    """The groups (sorted rank tuples, sorted) used at ``step``; every rank computes the same ones.

    ``world_size`` must be a multiple of ``group_size``.
    """
    if group_size < 1 or world_size % group_size:
        raise ValueError(f"group_size {group_size} must divide world_size {world_size}")
    if shuffle_every < 1:
        raise ValueError("shuffle_every must be at least 1")
    ranks = list(range(world_size))
    random.Random(f"dssync/{seed}/{step // shuffle_every}").shuffle(ranks)
    groups = [tuple(sorted(ranks[i : i + group_size])) for i in range(0, world_size, group_size)]
    return sorted(groups)


def solve_dssync(
    profile: Profile,
    *,
    group_size: int = 2,
    shuffle_every: int = 1,
    seed: int = 0,
    average: str = "parameters",
    first_bucket_bytes: int = DDP_FIRST_BUCKET_BYTES,
    bucket_cap_bytes: int = DDP_BUCKET_CAP_BYTES,
    wire_dtype: str = WIRE_FULL,
) -> Plan:
    """DDP's buckets, to be all-reduced within the step's group (see module docstring), as ``wire_dtype``.

    ``average="parameters"`` (the default: DS-Sync "synchronizes the workers in the same group") keeps
    gradients local, updates locally, and averages the parameters (and buffers) within the group after
    the step, so every group ends each step as one model (model averaging). ``"gradients"`` averages the
    gradients within the group instead, overlapped with backward like DDP; but the group's members then
    start each step from the weights their previous groups left them, and the replicas drift apart
    (docs/DSSYNC_DLCP.md: −2.0 points on digits, against −0.3 with ``"parameters"``).
    """
    if average not in ("gradients", "parameters"):
        raise ValueError(f"average must be 'gradients' or 'parameters', not {average!r}")
    if wire_dtype != WIRE_FULL and average == "parameters":
        raise ValueError(f"wire_dtype={wire_dtype!r} needs average='gradients': with 'parameters' no gradient "
                         "crosses the link")
    dssync_partition(profile.world_size, group_size, 0, seed=seed, shuffle_every=shuffle_every)
    buckets = profile.buckets(first_bucket_bytes, bucket_cap_bytes)
    options = {"group_size": int(group_size), "shuffle_every": int(shuffle_every), "seed": int(seed), "average": average,
               "first_bucket_bytes": int(first_bucket_bytes), "bucket_cap_bytes": int(bucket_cap_bytes),
               **wire_option(wire_dtype)}
    return finish(profile, "dssync", wfbp_items(profile, buckets, wire_dtype=wire_dtype), options,
                  {"buckets": len(buckets), "note": "predicted with the whole-world link cost (an upper bound)"})
