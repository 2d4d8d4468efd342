"""The Preserver's price of a narrower wire: what a bucket's rounding on the link costs, in ms per step.

A bucket sent in a 16-bit dtype is divided by the world size, rounded to the wire dtype, summed by the
all-reduce and widened back (DDP's compression hooks do the same); one sent on the 8-bit wire is divided by the
world size, rounded per block to 8-bit integers with a float32 scale, gathered and summed in float32. The averaged gradient ḡ then carries an
error E. Rank r rounds its share g_r / W with an error ε_r (measured: ``wire_error.cast_error_norms``), and the
all-reduce's own additions round W − 1 partial sums, each by at most the unit round-off u of the dtype::

    ‖E_p‖ ≤ Σ_r ‖ε_r,p‖ + (W − 1) · u · Σ_r ‖g_r,p‖ / W

The same first-order model prices staleness (:mod:`deft_compile.preserver.pricing`): a step's progress is
``Σ_p ḡ_p · Δw_p``, an error E_p in the gradient applied to p changes p's part by at most ``‖E_p‖ · ‖ḡ_p‖``,
so the share of each step's progress the wire loses on p is at most

    s_p = ‖E_p‖ · ‖ḡ_p‖ / Σ_q ‖ḡ_q‖²

with ``‖ḡ_p‖`` taken as the ranks' root mean square ``√(Σ_r ‖g_r,p‖² / W)`` (an upper bound of the mean's
norm). The price is ``staleness_price × s_p × compute_ms``, the unit the solver ranks plans in. Rounding a
float32 gradient to bfloat16 changes it by about 2⁻⁹ relative, so its price is about 0.2 % of p's share of
progress at most: the link time saved wins wherever communication is a visible part of the step. Where the
gradient is too small for float16 (below 2⁻¹⁴ it loses digits, below 2⁻²⁴ it is flushed to zero), ‖ε‖
approaches ‖g / W‖ and the price approaches p's whole share: the bucket stays float32.

Norms are in the optimizer's metric where it has one (``wire_error.metric_weights``: Adam divides each element
by √v̂, so elements with small gradients move as far as large ones and their rounding counts as much).

Pure Python, no torch: ``wire_error`` measures, this prices.
"""

from __future__ import annotations

import math
from typing import Sequence

#: unit round-off of the sums of each wire dtype (round to nearest): half the gap between 1 and the next number; the
#: 8-bit wire's ranks are summed locally in float32
UNIT_ROUND_OFF = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11, "int8": 2.0 ** -24}


def wire_shares(names: Sequence[str], dtypes: Sequence[str], sums: Sequence[float],
                world_size: int) -> dict[str, dict[str, float]]:
    """Per 16-bit dtype and parameter, the share of each step's progress its rounding on the wire loses at most
    (module docstring). ``sums`` are rank sums laid out as ``wire_error.cast_error_norms`` lays one rank's
    numbers: per parameter ``‖g‖``, ``‖g‖²``, then ``‖ε‖`` per dtype."""
    width = 2 + len(dtypes)
    if len(sums) != width * len(names):
        raise ValueError(f"expected {width * len(names)} numbers for {len(names)} parameters, got {len(sums)}")
    rows = [sums[i * width:(i + 1) * width] for i in range(len(names))]
    total = sum(max(row[1], 0.0) for row in rows) / world_size
    shares: dict[str, dict[str, float]] = {dtype: {} for dtype in dtypes}
    for name, row in zip(names, rows):
        norm_sum, square_sum = max(row[0], 0.0), max(row[1], 0.0)
        rms = math.sqrt(square_sum / world_size)
        for k, dtype in enumerate(dtypes):
            error = max(row[2 + k], 0.0) + (world_size - 1) * UNIT_ROUND_OFF[dtype] * norm_sum / world_size
            shares[dtype][name] = error * rms / total if total > 0 else 0.0
    return shares


def wire_prices(shares: dict[str, dict[str, float]], compute_ms: float,
                price_factor: float = 1.0) -> dict[str, dict[str, float]]:
    """Per dtype and parameter, ms per step: ``price_factor`` (the Preserver's κ) × share × the compute step,
    to 4 significant digits (a re-measurement of the same gradients gives the same options)."""
    return {dtype: {name: float(f"{price_factor * share * compute_ms:.4g}") for name, share in by_name.items()}
            for dtype, by_name in shares.items()}


def harmful_buckets(items: Sequence[tuple[tuple[str, ...], str, float]], prices: dict[str, dict[str, float]],
                    step_ms: float, compute_ms: float) -> list[tuple[tuple[str, ...], str, float, float]]:
    """The narrowed buckets a new measurement prices as harmful: ``items`` are (parameter names, wire dtype, link
    ms saved per step by narrowing) of the running plan's narrowed buckets; a bucket is harmful where its price
    at its dtype no longer pays for the time it saves (``planner.wire.narrowing_pays``). Returns (names, dtype,
    price, saved) of each."""
    from deft_compile.planner.wire import narrowing_pays

    harmful = []
    for names, dtype, saved in items:
        price = sum(prices.get(dtype, {}).get(name, 0.0) for name in names)
        if not narrowing_pays(saved, price, step_ms, compute_ms):
            harmful.append((names, dtype, price, saved))
    return harmful
