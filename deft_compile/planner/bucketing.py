"""DDP-style gradient bucketing, as a pure function (no torch).

Why a copy of DDP's rule instead of calling ``dist._compute_bucket_assignment_by_size``:
the planner and simulator must run without torch and without processes, and the
rule is short. It follows ``compute_bucket_assignment_by_size`` in
``torch/csrc/distributed/c10d/reducer.cpp``: tensors are visited in the order
their gradients become ready, grouped by dtype, a tensor is appended to the open
bucket of its dtype and the bucket is closed once its size reaches the current
limit. The first bucket of each dtype uses ``first_bucket_bytes`` (DDP: 1 MiB)
so that communication starts early; later buckets use ``bucket_cap_bytes``
(DDP: 25 MiB).
"""

from __future__ import annotations

from typing import Hashable, Sequence

MiB = 1024 * 1024
DDP_FIRST_BUCKET_BYTES = 1 * MiB
DDP_BUCKET_CAP_BYTES = 25 * MiB


class BucketSizes:
    """Mixin for configurations with ``bucket_cap_mb`` and ``first_bucket_mb`` (DDP's units): the caps in bytes."""

    bucket_cap_mb: float
    first_bucket_mb: float

    @property
    def bucket_cap_bytes(self) -> int:
        return int(self.bucket_cap_mb * MiB)

    @property
    def first_bucket_bytes(self) -> int:
        return int(self.first_bucket_mb * MiB)


def assign_buckets(
    sizes_bytes: Sequence[int],
    keys: Sequence[Hashable] | None = None,
    *,
    first_bucket_bytes: int = DDP_FIRST_BUCKET_BYTES,
    bucket_cap_bytes: int = DDP_BUCKET_CAP_BYTES,
) -> list[list[int]]:
    """Split tensors into buckets the way DDP does.

    Args:
        sizes_bytes: size of each tensor in bytes, in gradient-ready order
            (index 0 is ready first in backward).
        keys: optional grouping key per tensor (dtype, device); tensors with
            different keys never share a bucket.
        first_bucket_bytes: size limit of the first bucket of each key.
        bucket_cap_bytes: size limit of every later bucket.

    Returns:
        Buckets as lists of tensor indices, ordered by the position of their
        first tensor, so bucket 0 is the first one ready in backward.
    """
    if first_bucket_bytes <= 0 or bucket_cap_bytes <= 0:
        raise ValueError("bucket size limits must be positive")
    if keys is None:
        keys = [None] * len(sizes_bytes)
    if len(keys) != len(sizes_bytes):
        raise ValueError("keys and sizes_bytes must have the same length")
    closed: list[list[int]] = []
    open_buckets: dict[Hashable, list[int]] = {}
    open_sizes: dict[Hashable, int] = {}
    limits: dict[Hashable, int] = {}
    for index, (size, key) in enumerate(zip(sizes_bytes, keys)):
        if size < 0:
            raise ValueError(f"tensor {index} has negative size {size}")
        bucket = open_buckets.setdefault(key, [])
        bucket.append(index)
        open_sizes[key] = open_sizes.get(key, 0) + size
        limit = limits.setdefault(key, first_bucket_bytes)
        if open_sizes[key] >= limit:
            closed.append(bucket)
            open_buckets[key] = []
            open_sizes[key] = 0
            limits[key] = bucket_cap_bytes
    closed.extend(b for b in open_buckets.values() if b)
    closed.sort(key=lambda b: b[0])
    return closed
