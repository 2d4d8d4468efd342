"""Which buckets cross the link in a narrower dtype: each bucket's choice by the time it saves and its price.

A bucket sent in ``bfloat16`` or ``float16`` crosses the link in half the bytes of float32, one sent in ``int8``
(blocks of 8-bit integers with a float32 scale each) in about a quarter, and each arrives with a rounding
error. The Preserver prices that error in the unit it prices staleness in (ms per step of the compute
step, :mod:`deft_compile.preserver.wire_pricing`); this module turns prices into a choice per bucket:

- A bucket narrows to the allowed dtype that saves the most link time net of its price scaled to the step, when
  that saving is positive (``narrowing_pays``): the priced step is the step time over ``1 - price / compute``, so
  a price P costs about ``step / compute x P`` ms per step (``lost_ms``). Between the two 16-bit dtypes, which
  save the same bytes, that is the one priced lower; the 8-bit wire saves half as much again, and costs its
  coarser rounding's price.
- The set of narrowed buckets is then judged as a whole by the simulator (``solvers.deft``): the synchronous
  plan with those buckets narrowed must be faster, priced, than the float32 one, or nothing narrows.
- ``keep_float32`` names parameters (``fnmatch`` patterns) that never cross narrowed: the Preserver's for
  buckets it measured harmful after they ran narrowed (sent back to float32, they stay there), or a user's. A
  bucket holding such a parameter stays float32 whole, or, where that is faster priced, splits in two
  (``split_kept``): the kept parameters in a float32 bucket of their own, the others free to narrow. The
  harm may have been measured on another plan's partition (a priority plan's bucket of the bias alone), and
  keeping its parameter's whole DDP bucket in float32 would cost that bucket's narrowed bytes on every step.

Pure Python, no torch.
"""

from __future__ import annotations

import fnmatch
from typing import Sequence

from deft_compile.planner.plan import WIRE_FULL, LinkCost, Profile, may_narrow, wire_element_bytes


def lost_ms(price_ms: float, step_ms: float, compute_ms: float) -> float:
    """What a wire price costs on a step of ``step_ms``: the price is a share ``price / compute`` of each step's
    progress, so about ``step / compute x price`` ms per step."""
    return step_ms * price_ms / compute_ms if compute_ms > 0 else 0.0


def narrowing_pays(saved_ms: float, price_ms: float, step_ms: float, compute_ms: float) -> bool:
    """Whether sending a bucket narrowed pays: the link time it saves per step (``saved_ms``) beats its price
    (``price_ms``, a share ``price / compute`` of each step's progress) on a step of ``step_ms``. A price of
    zero pays for any saving; a bucket that saves nothing never narrows."""
    if saved_ms <= 0:
        return False
    return saved_ms > lost_ms(price_ms, step_ms, compute_ms)


def bucket_link_ms(profile: Profile, bucket: Sequence[int], wire_dtype: str, links: Sequence[LinkCost]) -> float:
    """The fastest link's time for one all-reduce of ``bucket`` sent as ``wire_dtype``."""
    nbytes = sum(profile.params[p].numel * wire_element_bytes(profile.params[p].dtype, wire_dtype, profile.world_size)
                 for p in bucket)
    return min(link.cost(nbytes) for link in links) if links else 0.0


def saved_link_ms(profile: Profile, bucket: Sequence[int], wire_dtype: str, links: Sequence[LinkCost]) -> float:
    """The link time one all-reduce of ``bucket`` saves when sent as ``wire_dtype`` instead of float32."""
    return bucket_link_ms(profile, bucket, WIRE_FULL, links) - bucket_link_ms(profile, bucket, wire_dtype, links)


def bucket_wire_price(profile: Profile, bucket: Sequence[int], prices: dict[str, float]) -> float:
    """A bucket's price at one dtype: the sum of its parameters' (by name; 0 where unpriced)."""
    return sum(prices.get(profile.params[p].name, 0.0) for p in bucket)


def named(profile: Profile, bucket: Sequence[int], patterns: Sequence[str]) -> list[int]:
    """The parameters of ``bucket`` whose names ``patterns`` match (``fnmatch``)."""
    return [p for p in bucket if any(fnmatch.fnmatchcase(profile.params[p].name, pattern) for pattern in patterns)]


def split_kept(profile: Profile, buckets: Sequence[Sequence[int]], keep_float32: Sequence[str]) -> list[list[int]]:
    """``buckets`` with each one that holds parameters ``keep_float32`` names beside others that may narrow cut in
    two, the kept parameters and the others, each keeping its members' order; the two in the order of their first
    members in the bucket. Other buckets as they are."""
    out: list[list[int]] = []
    for bucket in buckets:
        held = named(profile, bucket, keep_float32)
        rest = [p for p in bucket if p not in held]
        if held and any(may_narrow(profile.params[p].dtype) for p in rest):
            out += [held, rest] if bucket[0] in held else [rest, held]
        else:
            out.append(list(bucket))
    return out


def choose_wire(profile: Profile, buckets: Sequence[Sequence[int]], wire_prices: dict[str, dict[str, float]],
                step_ms: float, compute_ms: float, keep_float32: Sequence[str] = (),
                links: Sequence[LinkCost] | None = None) -> list[str]:
    """Each bucket's wire dtype: the dtype of ``wire_prices`` (dtype -> parameter name -> ms per step) whose link
    time saved, net of its price on a step of ``step_ms`` (``lost_ms``), is largest where ``narrowing_pays``,
    float32 otherwise. A bucket holding a parameter ``keep_float32`` names, or a gradient dtype that does not
    narrow, stays float32. A dtype absent from ``wire_prices`` is never chosen (unmeasured: no price, no
    narrowing)."""
    links = list(profile.links if links is None else links)
    choice = []
    for bucket in buckets:
        if not bucket or not all(may_narrow(profile.params[p].dtype) for p in bucket) or named(profile, bucket,
                                                                                                keep_float32):
            choice.append(WIRE_FULL)
            continue
        best, best_net = WIRE_FULL, 0.0
        for dtype in sorted(wire_prices):
            if dtype == WIRE_FULL:
                continue
            price = bucket_wire_price(profile, bucket, wire_prices[dtype])
            saved = saved_link_ms(profile, bucket, dtype, links)
            net = saved - lost_ms(price, step_ms, compute_ms)
            if narrowing_pays(saved, price, step_ms, compute_ms) and (best == WIRE_FULL or net > best_net):
                best, best_net = dtype, net
        choice.append(best)
    return choice
