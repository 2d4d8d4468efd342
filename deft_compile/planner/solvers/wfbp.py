"""WFBP / PyTorch DDP: DDP's buckets, issued when ready, waited at the end of backward.

This is the baseline every other policy is compared with, and the plan DeFT
falls back to. One process group (link 0 unless told otherwise). With
``wire_dtype="float16"`` or ``"bfloat16"`` every bucket of float32 gradients
crosses the link in that dtype: DDP with ``fp16_compress_hook`` /
``bf16_compress_hook``.
"""

from __future__ import annotations

from deft_compile.planner.bucketing import DDP_BUCKET_CAP_BYTES, DDP_FIRST_BUCKET_BYTES
from deft_compile.planner.plan import (
    UPDATE_AT_STEP,
    WAIT_END_OF_BACKWARD,
    WINDOW_BACKWARD,
    WIRE_FULL,
    CommItem,
    Plan,
    Profile,
    wire_for,
)
from deft_compile.planner.solvers.common import bucket_slices, finish, wire_option


def wfbp_items(profile: Profile, buckets: list[list[int]], link: int = 0,
               wire_dtype: str = WIRE_FULL) -> list[CommItem]:
    """One synchronous item per bucket, in bucket (ready) order; each bucket whose gradients narrow crosses
    the link as ``wire_dtype``."""
    return [
        CommItem(id=i, slices=slices, link=link, window=WINDOW_BACKWARD, delay=0, period=1,
                 order=i, wait_at=WAIT_END_OF_BACKWARD, update_at=UPDATE_AT_STEP, bucket=i,
                 wire_dtype=wire_for(profile, slices, wire_dtype))
        for i, slices in enumerate(bucket_slices(profile, buckets))
    ]



def solve_wfbp(
    profile: Profile,
    *,
    first_bucket_bytes: int = DDP_FIRST_BUCKET_BYTES,
    bucket_cap_bytes: int = DDP_BUCKET_CAP_BYTES,
    link: int = 0,
    wire_dtype: str = WIRE_FULL,
) -> Plan:
    """DDP's schedule: buckets (1 MiB first, 25 MiB cap) launched when ready, one link; the buckets sized by
    the gradients' bytes (as DDP's), sent as ``wire_dtype``."""
    buckets = profile.buckets(first_bucket_bytes, bucket_cap_bytes)
    options = {"first_bucket_bytes": int(first_bucket_bytes),
               "bucket_cap_bytes": int(bucket_cap_bytes), "link": int(link), **wire_option(wire_dtype)}
    return finish(profile, "wfbp", wfbp_items(profile, buckets, link, wire_dtype), options,
                  {"buckets": len(buckets)})
