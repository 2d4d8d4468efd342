"""DeFT: delayed updates chosen by two 0/1 knapsacks, adaptive period, several links.

Algorithm (our reading of Meng & Sun, see docs/PLANNER.md §3):

1. Items are DDP's buckets in DDP order; they are never reordered or merged.
   With several links each bucket is cut into per-link shares sized so all
   shares finish together (x_l = (T - α_l)/β_l with Σ x_l = bytes; links whose
   share would be negative are dropped), if that beats the best single link.
   The bucket's weight is then its share time (the shares run in parallel).
2. Period K: if the coverage rate CR = (busiest link's comm per step) /
   (T_F + T_B) exceeds 1/(1 + margin), pick the smallest K <= max_period for
   which making the largest buckets periodic (greedily, largest first) brings
   the per-step load under (T_F + T_B)/(1 + margin); their offsets are
   balanced over the K phases (largest first onto the lightest phase). Knapsack
   weights are amortised: c_i / K_i.
3. Two knapsacks. Forward knapsack: capacity T_F (merged forward compute),
   weight = comm time, value = comm time minus ``staleness_penalty_ms`` and minus the
   bucket's measured ``staleness_prices`` (the Preserver's trade; ``update_prices``
   price the updates a period skips);
   chosen buckets get d=1, window ``forward-next`` (issued at the start of the
   next forward, waited before the next update). Backward knapsack: capacity
   T_B minus the comm time of the synchronous buckets that must also cross the
   link during backward, chosen buckets get d=1, window ``backward-next``. The
   rest stays d=0 exactly as in WFBP. Only a suffix of the buckets (the last
   ready, input side: those WFBP leaves exposed) is eligible; the suffix start
   is searched over up to ``suffix_candidates`` values. One DP pass in reverse
   bucket order gives the forward knapsack of every suffix at once. Per suffix
   one more candidate delays every worthwhile bucket of it from the start of the
   next forward: such a bucket may use T_F and T_B, which the two capacities
   split (a bucket larger than either still hides).
4. Every candidate is scored by the simulator and its staleness price (zero
   unless priced): predicted step time / (1 - price / compute time), the time
   per step of synchronous progress (``priced_step_ms``); the cheapest wins, and among those within ``tie_tolerance``
   the one delaying the fewest bytes (then no period). If it is not cheaper
   than WFBP, the WFBP plan is returned, so the DeFT plan is never slower than
   WFBP in simulation.

Costs are the link's bytes: with ``wire_dtype`` every bucket whose gradients
narrow crosses the link in that 16-bit dtype, and its weight is the time of
its narrowed bytes (DDP's buckets are still sized by the gradients' bytes).
With ``wire_prices`` (the Preserver's measured price of each 16-bit dtype per
parameter) each bucket's wire dtype is chosen first, by the link time it
saves against its price (``planner.wire.choose_wire``), and kept only if the
synchronous plan with those buckets narrowed is faster, priced, than the
float32 one; delays and periods are then chosen on the narrowed buckets. The
same wire choice holds in every candidate and in the synchronous plan the
result is compared with, so its price cancels there.

The knapsack DP is exact on weights discretised to ``capacity/units`` ms
(weights rounded up, capacity down: a chosen set never over-fills the real
capacity); ``units`` defaults to 1024.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any
from dataclasses import dataclass

import numpy as np

from deft_compile.planner.bucketing import DDP_BUCKET_CAP_BYTES, DDP_FIRST_BUCKET_BYTES
from deft_compile.planner.plan import (
    UPDATE_AT_NEXT_STEP,
    UPDATE_AT_STEP,
    WAIT_BEFORE_NEXT_UPDATE,
    WAIT_END_OF_BACKWARD,
    WINDOW_BACKWARD,
    WINDOW_BACKWARD_NEXT,
    WINDOW_FORWARD_NEXT,
    WIRE_FULL,
    CommItem,
    LinkCost,
    Plan,
    Profile,
    wire_element_bytes,
)
from deft_compile.planner.simulator import BucketScheduleEvaluator, simulate
from deft_compile.planner.solvers.common import finish, split_slices, wire_option
from deft_compile.planner.solvers.knapsack import DEFAULT_UNITS, discretise, knapsack_01
from deft_compile.planner.solvers.wfbp import wfbp_items
from deft_compile.planner.wire import bucket_wire_price, choose_wire, named, split_kept

# bucket kinds; chosen equal to the simulator's window codes (forward-next,
# backward-next, backward) so a kind array is directly a window array
_FWD, _BWD_NEXT, _SYNC = 0, 1, 2


def link_shares(numel: int, element_bytes: int, links: list[LinkCost],
                link_ids: list[int]) -> list[tuple[int, int]]:
    """Split ``numel`` elements over links so that all shares end together.

    Returns [(link index, element count)], in link order; a single
    (fastest link, numel) when splitting does not pay: the time saved must
    exceed the latency α the added links spend (small buckets stay whole).
    """
    nbytes = numel * element_bytes
    single = min(link_ids, key=lambda l: (links[l].cost(nbytes), l))
    if len(link_ids) < 2 or any(links[l].beta_ms_per_byte <= 0 for l in link_ids):
        return [(single, numel)]
    use = sorted(link_ids)
    while True:
        inv = sum(1.0 / links[l].beta_ms_per_byte for l in use)
        finish_ms = (nbytes + sum(links[l].alpha_ms / links[l].beta_ms_per_byte for l in use)) / inv
        shares = {l: (finish_ms - links[l].alpha_ms) / links[l].beta_ms_per_byte for l in use}
        negative = [l for l, x in shares.items() if x <= 0]
        if not negative:
            break
        use = [l for l in use if l not in negative]
        if len(use) < 2:
            return [(single, numel)]
    counts = {l: int(shares[l] // element_bytes) for l in use}
    counts[single if single in counts else use[0]] += numel - sum(counts.values())
    result = [(l, c) for l, c in sorted(counts.items()) if c > 0]
    split_ms = max(links[l].cost(c * element_bytes) for l, c in result)
    # the time saved must pay for the extra latency every added link spends on it
    extra_alpha = sum(links[l].alpha_ms for l, _ in result if l != single)
    if len(result) < 2 or split_ms + extra_alpha >= links[single].cost(nbytes):
        return [(single, numel)]
    return result


def suffix_knapsacks(weights: list[int], values: list[float], capacity: int):
    """0/1 knapsack of every suffix {k..n-1} of the items from one DP pass.

    Items are added in reverse order, so after adding item k the table is
    the optimum over the suffix starting at k. Returns ``chosen(k)``.
    """
    n = len(weights)
    best = np.zeros(max(capacity, 0) + 1)
    taken = np.zeros((n, max(capacity, 0) + 1), dtype=bool)
    for i in range(n - 1, -1, -1):
        w, v = int(weights[i]), float(values[i])
        if v <= 0 or w > capacity:
            continue
        if w == 0:
            best += v
            taken[i] = True
            continue
        candidate = best[:-w] + v
        np.greater(candidate, best[w:], out=taken[i, w:])
        np.maximum(best[w:], candidate, out=best[w:])

    def chosen(k: int) -> list[int]:
        result = []
        c = max(capacity, 0)
        for i in range(k, n):
            if taken[i, c]:
                result.append(i)
                c -= int(weights[i])
        return result

    return chosen


#: the largest share of progress a priced plan may lose in the score (a plan losing more scores as 20x slower)
MAX_LOST_PROGRESS = 0.95


def priced_step_ms(iteration_ms: float, price_ms: float, compute_ms: float) -> float:
    """What a plan costs per step of synchronous progress: time to a loss is steps x step time, and a plan whose
    staleness and skipped updates lose the share L = price / compute of each step's progress needs 1 / (1 - L)
    times the steps. (Prices are in the compute step time, ``deft_compile.preserver.pricing``.) Not the linear
    ``iteration + price``: at L = 0.6 that says 1.6x where the steps needed are 2.5x."""
    if price_ms <= 0 or compute_ms <= 0:
        return iteration_ms
    return iteration_ms / (1.0 - min(MAX_LOST_PROGRESS, price_ms / compute_ms))


def skipped_share(period: Any, noise: Any = 0.0) -> Any:
    """The share of a parameter's progress an update period K loses where its gradient noise ratio is ``noise``
    (b = tr(Σ)/‖G‖² of the step's batch): an update with the mean of K gradients makes (1 + b)/(1 + b/K) times
    one's progress, so K steps make (1 + b)/(K + b) of K updates' and lose (K − 1)/(K + b); (1 − 1/K) with an exact
    gradient (b = 0). Scalars or numpy arrays (``deft_compile.preserver.pricing``)."""
    return (period - 1) / (period + noise)


@dataclass
class _Candidate:
    iteration_ms: float
    price_ms: float  # the convergence price of its staleness, ms per step
    compute_ms: float  # the step's compute, the unit prices are in
    delayed_bytes: int
    periodic: bool
    suffix: int
    kind: np.ndarray
    period: np.ndarray
    offset: np.ndarray

    @property
    def cost_ms(self) -> float:
        """What candidates are ranked by: predicted step time per step of synchronous progress."""
        return priced_step_ms(self.iteration_ms, self.price_ms, self.compute_ms)


def _period_config(costs: np.ndarray, share_loads: np.ndarray, capacity: float, margin: float,
                   max_period: int, pinned: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Smallest K (and which buckets) that brings the busiest link under capacity/(1+margin).

    ``pinned`` buckets (kept synchronous) never get a period; their load stays whole.
    """
    n = len(costs)
    target = capacity / (1.0 + margin)
    movable = [i for i in range(n) if pinned is None or not pinned[i]]
    by_size = sorted(movable, key=lambda i: (-costs[i], i))
    chosen_k, chosen_set = max_period, list(by_size)
    total = share_loads.sum(axis=0)
    # load_m = total - (1 - 1/k) * (loads of the m largest buckets), m = 0..n
    largest_first = np.vstack([np.zeros(share_loads.shape[1]),
                               np.cumsum(share_loads[by_size], axis=0)])
    for k in range(2, max_period + 1):
        busiest = (total - (1.0 - 1.0 / k) * largest_first).max(axis=1)
        fits = np.flatnonzero(busiest <= target)
        if len(fits):
            chosen_k, chosen_set = k, by_size[: int(fits[0])]
            break
    period = np.ones(n, dtype=np.int64)
    offset = np.zeros(n, dtype=np.int64)
    phase_load = [0.0] * chosen_k
    for i in sorted(chosen_set, key=lambda i: (-costs[i], i)):
        phase = min(range(chosen_k), key=lambda p: (phase_load[p], p))
        phase_load[phase] += costs[i]
        period[i] = chosen_k
        offset[i] = phase
    return period, offset


def solve_deft(
    profile: Profile,
    *,
    first_bucket_bytes: int = DDP_FIRST_BUCKET_BYTES,
    bucket_cap_bytes: int = DDP_BUCKET_CAP_BYTES,
    max_staleness: int = 1,
    allow_period: bool = True,
    max_period: int = 4,
    period_margin: float = 0.1,
    staleness_penalty_ms: float = 0.0,
    staleness_prices: dict[str, float] | None = None,
    update_prices: dict[str, float] | None = None,
    update_noise: dict[str, float] | None = None,
    keep_synchronous: list[str] | tuple[str, ...] = (),
    links: list[int] | None = None,
    units: int = DEFAULT_UNITS,
    suffix_candidates: int = 10,
    tie_tolerance: float = 0.002,
    wire_dtype: str = WIRE_FULL,
    wire_prices: dict[str, dict[str, float]] | None = None,
    keep_float32: list[str] | tuple[str, ...] = (),
) -> Plan:
    """DeFT's plan (see module docstring). ``max_staleness=0`` returns WFBP's items (narrowed where
    ``wire_prices`` choose it).

    Args:
        max_staleness: 0 forbids every deviation from synchronous DDP (no
            delays, no period, no link split); 1 allows d=1.
        allow_period, max_period: adaptive update period K in 2..max_period.
        period_margin: safety margin on the capacity when choosing K.
        staleness_penalty_ms: subtracted from each delayed bucket's value, so a
            bucket is delayed only if it hides more than this.
        staleness_prices: parameter name -> ms per step that one step of
            staleness on that parameter costs in convergence (the Preserver's
            measured trade, :mod:`deft_compile.preserver.pricing`). A bucket's
            price is the sum over its parameters, times its mean staleness
            (d + (K - 1)/2). Prices enter the knapsack values and the score
            every candidate (and WFBP) is ranked by: predicted step time plus
            price.
        update_prices: parameter name -> ms per step that losing all of the
            parameter's updates costs (the Preserver's trade). A period K costs
            each parameter's update price times ``skipped_share(K, b)``.
        update_noise: parameter name -> gradient noise ratio b = tr(Σ)/‖G‖² of
            the step's batch (``preserver.pricing.noise_ratios``; 0 where absent).
        keep_synchronous: parameter names (``fnmatch`` patterns) whose buckets
            stay exactly as in DDP: never delayed, never periodic. The
            Preserver fills it with the buckets whose staleness error it
            measured to be too high; users may name staleness-sensitive
            parameters (e.g. a tied embedding) up front.
        links: link indices DeFT may use (default: all links of the profile).
        units: knapsack resolution, capacity/units ms.
        suffix_candidates: how many suffix starts to try.
        tie_tolerance: relative time difference treated as a tie.
        wire_dtype: the dtype buckets of float32 gradients cross the link in.
        wire_prices: 16-bit dtype -> parameter name -> ms per step its rounding costs
            (the Preserver's, :mod:`deft_compile.preserver.wire_pricing`): the solver
            chooses each bucket's wire dtype (``planner.wire``). Not with ``wire_dtype``.
        keep_float32: parameter names (``fnmatch`` patterns) that never narrow under
            ``wire_prices``: their bucket stays float32, or is cut in two where that is
            faster priced (``planner.wire.split_kept``).
    """
    options = _options(first_bucket_bytes=first_bucket_bytes, bucket_cap_bytes=bucket_cap_bytes,
                       max_staleness=max_staleness, allow_period=allow_period, max_period=max_period,
                       period_margin=period_margin, staleness_penalty_ms=staleness_penalty_ms,
                       staleness_prices=staleness_prices, update_prices=update_prices, update_noise=update_noise,
                       keep_synchronous=keep_synchronous, links=links, units=units,
                       suffix_candidates=suffix_candidates, tie_tolerance=tie_tolerance, wire_dtype=wire_dtype,
                       wire_prices=wire_prices, keep_float32=keep_float32)
    _check_options(max_staleness, wire_dtype, wire_prices)
    buckets = profile.buckets(first_bucket_bytes, bucket_cap_bytes)
    link_ids = list(range(len(profile.links))) if links is None else sorted(set(links))
    buckets, synchronous, wire_metadata = _synchronous_items(profile, buckets, wire_dtype, options, link_ids)
    if max_staleness == 0:
        return finish(profile, "deft", synchronous, options,
                      {"fallback": "max_staleness=0: synchronous DDP buckets", **wire_metadata})

    n = len(buckets)
    share_items, share_loads, costs, bucket_bytes = _bucket_shares(profile, buckets, synchronous, link_ids)
    pinned = np.array([bool(named(profile, bucket, options["keep_synchronous"])) for bucket in buckets], dtype=bool)
    price = _bucket_prices(profile, buckets, options.get("staleness_prices", {}))
    update_cost = _update_costs(profile, buckets, options.get("update_prices", {}), options.get("update_noise", {}),
                                max(2, max_period))
    group = np.array([b for b, _, _ in share_items], dtype=np.int64)
    same_as_wfbp = len(share_items) == n and all(link == 0 for _, link, _ in share_items)
    layout = _layout(synchronous, share_items, same_as_wfbp)
    evaluator = BucketScheduleEvaluator(profile, layout, group)
    evaluator.compute_ms = profile.forward_ms + profile.backward_ms + profile.update_ms  # prices are in this unit

    t_f, t_b = profile.forward_ms, profile.backward_ms
    capacity = t_f + t_b
    coverage = float(share_loads.sum(axis=0).max() / capacity) if capacity > 0 else math.inf
    configs = [(np.ones(n, dtype=np.int64), np.zeros(n, dtype=np.int64))]
    if allow_period and max_period >= 2 and coverage > 1.0 / (1.0 + period_margin):
        configs.append(_period_config(costs, share_loads, capacity, period_margin, max_period,
                                      pinned | _too_dear(costs, price, update_cost)))

    suffixes = (list(range(n + 1)) if n <= suffix_candidates
                else sorted({int(round(x)) for x in np.linspace(0, n, suffix_candidates)}))
    candidates: list[_Candidate] = []
    for period, offset in configs:
        amortised = costs / period
        values = [0.0 if pinned[i] else float(c) - staleness_penalty_ms - float(price[i]) for i, c in enumerate(amortised)]
        for k, kind in _knapsack_kinds(amortised, values, suffixes, t_f, t_b, units):
            candidates.append(_score(evaluator, kind, period, offset, group, bucket_bytes, k, price, update_cost))
    best_cost = min(c.cost_ms for c in candidates)
    best = min((c for c in candidates if c.cost_ms <= best_cost * (1 + tie_tolerance)),
               key=lambda c: (c.delayed_bytes, c.periodic, c.cost_ms, -c.suffix))
    metadata = {"coverage_rate": coverage, "buckets": n, "links_used": link_ids, "candidates": len(candidates),
                **_chosen_metadata(best), "kept_synchronous": int(pinned.sum()), **wire_metadata}
    wfbp_ms = _wfbp_ms(profile, synchronous, evaluator if same_as_wfbp else None)
    items = _items(share_items, best, [item.wire_dtype for item in synchronous])
    plan = finish(profile, "deft", items, options, metadata)
    if best.cost_ms >= wfbp_ms * (1 - tie_tolerance):
        reason = "knapsack plan not faster than WFBP" + (" once its staleness is priced" if best.price_ms else "")
        return finish(profile, "deft", synchronous, options,
                      {**metadata, "fallback": reason, "knapsack_iteration_ms": plan.predicted_iteration_ms,
                       "knapsack_price_ms": best.price_ms, "staleness_price_ms": 0.0})
    return plan


def _options(*, first_bucket_bytes, bucket_cap_bytes, max_staleness, allow_period, max_period, period_margin,
             staleness_penalty_ms, staleness_prices, update_prices, update_noise, keep_synchronous, links, units,
             suffix_candidates, tie_tolerance, wire_dtype, wire_prices, keep_float32) -> dict[str, Any]:
    """The plan's options, normalised (what its hash covers)."""
    options = {"first_bucket_bytes": int(first_bucket_bytes), "bucket_cap_bytes": int(bucket_cap_bytes),
               "max_staleness": int(max_staleness), "allow_period": bool(allow_period),
               "max_period": int(max_period), "period_margin": float(period_margin),
               "staleness_penalty_ms": float(staleness_penalty_ms),
               "keep_synchronous": sorted({str(name) for name in keep_synchronous}),
               "links": None if links is None else [int(l) for l in links], "units": int(units),
               "suffix_candidates": int(suffix_candidates), "tie_tolerance": float(tie_tolerance),
               **wire_option(wire_dtype)}
    for key, given in (("staleness_prices", staleness_prices), ("update_prices", update_prices),
                       ("update_noise", update_noise)):
        if given:  # only when priced, so unpriced plans keep the hashes they always had
            options[key] = {str(k): float(v) for k, v in sorted(given.items())}
    if wire_prices:  # likewise: only when the wire is chosen by price
        options["wire_prices"] = {str(dtype): {str(k): float(v) for k, v in sorted(prices.items())}
                                  for dtype, prices in sorted(wire_prices.items()) if dtype != WIRE_FULL}
    if keep_float32:
        options["keep_float32"] = sorted({str(name) for name in keep_float32})
    return options


def _check_options(max_staleness: int, wire_dtype: str, wire_prices: dict | None) -> None:
    if max_staleness not in (0, 1):
        raise ValueError("max_staleness must be 0 or 1 (delays are at most one step)")
    if wire_prices and wire_dtype != WIRE_FULL:
        raise ValueError(f"wire_dtype={wire_dtype!r} sends every bucket in one dtype; wire_prices choose per bucket: "
                         "give one or the other")


def _chosen_metadata(best: _Candidate) -> dict[str, Any]:
    """What the chosen candidate delays and makes periodic, for the plan's metadata."""
    return {"suffix": best.suffix, "period": int(best.period.max()), "delayed_buckets": int((best.kind != _SYNC).sum()),
            "forward_knapsack": int((best.kind == _FWD).sum()), "backward_knapsack": int((best.kind == _BWD_NEXT).sum()),
            "periodic_buckets": int((best.period > 1).sum()), "staleness_price_ms": best.price_ms}


def _synchronous_items(profile: Profile, buckets: list[list[int]], wire_dtype: str, options: dict[str, Any],
                       link_ids: list[int]) -> tuple[list[list[int]], list[CommItem], dict[str, Any]]:
    """WFBP's items in the wire dtypes the plan sends, with their buckets and the metadata recording the choice:
    ``wire_dtype`` for every bucket, or with ``wire_prices`` each bucket's choice (``_narrowed``). With
    ``keep_float32`` too, the buckets cut where kept parameters sit beside others that may narrow
    (``wire.split_kept``) where that plan is faster, priced, than the whole buckets' (an extra message against the
    narrowed bytes of the kept parameters' neighbours)."""
    if not options.get("wire_prices"):
        return buckets, wfbp_items(profile, buckets, wire_dtype=wire_dtype), {}
    items, metadata, priced_ms = _narrowed(profile, buckets, options, link_ids)
    split = split_kept(profile, buckets, options.get("keep_float32", ()))
    if len(split) > len(buckets):
        split_items, split_metadata, split_ms = _narrowed(profile, split, options, link_ids)
        if split_ms < priced_ms:
            return split, split_items, {**split_metadata, "kept_float32_split": len(split) - len(buckets)}
    return buckets, items, metadata


def _narrowed(profile: Profile, buckets: list[list[int]], options: dict[str, Any],
              link_ids: list[int]) -> tuple[list[CommItem], dict[str, Any], float]:
    """Each bucket in its wire dtype chosen by price (``planner.wire.choose_wire``), kept only where the synchronous
    plan with them is faster, priced, than the float32 one; the metadata; that plan's priced simulated step."""
    full = wfbp_items(profile, buckets)
    compute = profile.forward_ms + profile.backward_ms + profile.update_ms
    full_ms = simulate(profile, Plan("deft", full), record=False, check=False).iteration_ms
    prices = options["wire_prices"]
    chosen = choose_wire(profile, buckets, prices, full_ms, compute, options.get("keep_float32", ()),
                         [profile.links[l] for l in link_ids])
    if all(dtype == WIRE_FULL for dtype in chosen):
        return full, {"narrowed_buckets": 0}, full_ms
    narrowed = [dataclasses.replace(item, wire_dtype=dtype) for item, dtype in zip(full, chosen)]
    narrowed_ms = simulate(profile, Plan("deft", narrowed), record=False, check=False).iteration_ms
    price = sum(bucket_wire_price(profile, bucket, prices[dtype]) for bucket, dtype in zip(buckets, chosen)
                if dtype != WIRE_FULL)
    priced_ms = priced_step_ms(narrowed_ms, price, compute)
    if priced_ms >= full_ms:
        return full, {"narrowed_buckets": 0, "wire_refused": f"narrowed {narrowed_ms:.4g} ms with a price of "
                      f"{price:.3g} ms is not faster than float32's {full_ms:.4g} ms"}, full_ms
    return narrowed, {"narrowed_buckets": sum(dtype != WIRE_FULL for dtype in chosen), "wire_price_ms": price}, priced_ms


def _layout(synchronous: list[CommItem], share_items: list[tuple[int, int, tuple]], same_as_wfbp: bool) -> Plan:
    """The items every candidate schedules: WFBP's where the shares are its buckets, else one per share (bucket
    ``b``'s shares sent in its wire dtype)."""
    if same_as_wfbp:
        return Plan("deft", synchronous)  # same items as WFBP: reuse them
    return Plan("deft", [CommItem(id=i, slices=piece, link=link, order=i, bucket=b, wire_dtype=synchronous[b].wire_dtype)
                         for i, (b, link, piece) in enumerate(share_items)])


def _wfbp_ms(profile: Profile, synchronous: list[CommItem], evaluator: BucketScheduleEvaluator | None) -> float:
    """WFBP's predicted step: on the WFBP layout (``evaluator`` given) all synchronous, measured as simulate()
    would; else simulated."""
    if evaluator is not None:
        n = len(synchronous)
        ones, zeros = np.ones(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
        return evaluator.iteration_ms(np.full(n, _SYNC), zeros, ones, zeros, np.arange(n), iterations=2, warmup=3)
    return simulate(profile, Plan("wfbp", synchronous), record=False, check=False).iteration_ms


def _bucket_prices(profile: Profile, buckets: list[list[int]], prices: dict[str, float]) -> np.ndarray:
    """Each bucket's price: the sum of its parameters' (by name; 0 where unpriced)."""
    return np.array([sum(prices.get(profile.params[p].name, 0.0) for p in bucket) for bucket in buckets])


def _too_dear(costs: np.ndarray, price: np.ndarray, update_cost: np.ndarray) -> np.ndarray:
    """Buckets never worth a period: a period of 2 saves half a bucket's load and costs its updates' skipped share
    and half a step of staleness, and for these that reaches the communication it saves."""
    return update_cost[:, 2] + price / 2 >= costs / 2


def _update_costs(profile: Profile, buckets: list[list[int]], prices: dict[str, float], noise: dict[str, float],
                  max_period: int) -> np.ndarray:
    """``[b, K]``: what an update period K costs bucket ``b``, ms per step (K = 0..max_period; 0 at K <= 1): the sum
    over its parameters of update price × ``skipped_share(K, noise ratio)``."""
    periods = np.arange(max_period + 1, dtype=np.float64)
    costs = np.zeros((len(buckets), max_period + 1))
    for b, bucket in enumerate(buckets):
        for p in bucket:
            name = profile.params[p].name
            if prices.get(name, 0.0):
                costs[b, 2:] += prices[name] * skipped_share(periods[2:], noise.get(name, 0.0))
    return costs


def _bucket_shares(profile: Profile, buckets: list[list[int]], synchronous: list[CommItem],
                   link_ids: list[int]) -> tuple[list[tuple[int, int, tuple]], np.ndarray, np.ndarray, np.ndarray]:
    """Each bucket's shares over the links DeFT may use: (the items as (bucket, link, slices), each bucket's load
    per link, each bucket's cost (its slowest share), each bucket's bytes), in bytes on the wire (the bucket's
    synchronous item's wire dtype)."""
    n = len(buckets)
    slices = [item.slices for item in synchronous]
    share_items: list[tuple[int, int, tuple]] = []  # (bucket, link, slices)
    share_loads = np.zeros((n, len(profile.links)))
    costs = np.zeros(n)
    bucket_bytes = np.zeros(n, dtype=np.int64)
    for b, bucket in enumerate(buckets):
        numel = sum(profile.params[p].numel for p in bucket)
        element_bytes = wire_element_bytes(profile.params[bucket[0]].dtype, synchronous[b].wire_dtype, profile.world_size)
        shares = link_shares(numel, element_bytes, profile.links, link_ids)
        pieces = split_slices(slices[b], [c for _, c in shares])
        for (link, count), piece in zip(shares, pieces):
            share_items.append((b, link, piece))
            share_loads[b, link] = profile.links[link].cost(count * element_bytes)
        costs[b] = share_loads[b].max()
        bucket_bytes[b] = numel * element_bytes
    return share_items, share_loads, costs, bucket_bytes


def _knapsack_kinds(amortised: np.ndarray, values: list[float], suffixes: list[int], t_f: float, t_b: float,
                    units: int):
    """(suffix start, each bucket's kind) of every candidate for one period configuration: per suffix start k,
    the forward knapsack over the suffix (capacity T_F), the backward knapsack over what it left (capacity T_B
    less the synchronous prefix's load), and the candidate that delays every worthwhile bucket of the suffix to
    the next forward."""
    n = len(amortised)
    f_weights, f_capacity, _ = discretise(amortised, t_f, units)
    forward_of_suffix = suffix_knapsacks(f_weights, values, f_capacity)
    for k in suffixes:
        kind = np.full(n, _SYNC, dtype=np.int64)
        forward = forward_of_suffix(k)
        kind[forward] = _FWD
        rest = [i for i in range(k, n) if kind[i] == _SYNC]
        sync_load = float(amortised[:k].sum())
        b_capacity = t_b - sync_load
        if rest and b_capacity > 0:
            b_weights, b_units, _ = discretise(amortised[rest], b_capacity, units)
            _, picked = knapsack_01(b_weights, [values[i] for i in rest], b_units)
            kind[[rest[j] for j in picked]] = _BWD_NEXT
        yield k, kind
        # The knapsacks give a delayed bucket the forward (T_F) or the backward (T_B) as capacity, but one
        # issued at the start of the next forward may use both: a bucket larger than either still hides.
        # The simulator judges the candidate that delays every worthwhile bucket of the suffix that way.
        whole = [i for i in range(k, n) if values[i] > 0]
        if whole and any(kind[i] != _FWD for i in whole):
            kind = np.full(n, _SYNC, dtype=np.int64)
            kind[whole] = _FWD
            yield k, kind


def _score(evaluator: BucketScheduleEvaluator, kind: np.ndarray, period: np.ndarray,
           offset: np.ndarray, group: np.ndarray, bucket_bytes: np.ndarray, suffix: int,
           price: np.ndarray, update_cost: np.ndarray) -> _Candidate:
    window = kind  # kind codes are the simulator's window codes (0, 1, 2)
    delay = (kind != _SYNC).astype(np.int64)
    rank = _issue_rank(kind, group)
    iteration = evaluator.iteration_ms(window, delay, period, offset, rank)
    staleness = delay + (period - 1) / 2.0  # mean steps by which each bucket's applied gradient lags
    cost = float((price * staleness).sum() + update_cost[np.arange(len(period)), period].sum())
    return _Candidate(iteration, cost, evaluator.compute_ms, int(bucket_bytes[kind != _SYNC].sum()),
                      bool((period > 1).any()), suffix, kind, period, offset)


def _issue_rank(kind: np.ndarray, group: np.ndarray) -> np.ndarray:
    """Issue order: forward-next buckets, backward-next buckets, then synchronous, each in DDP order."""
    keys = kind[group] * (len(group) + 1) + np.arange(len(group))
    rank = np.empty(len(group), dtype=np.int64)
    rank[np.argsort(keys, kind="stable")] = np.arange(len(group))
    return rank


def _items(share_items: list[tuple[int, int, tuple]], best: _Candidate, wire: list[str]) -> list[CommItem]:
    """The chosen candidate's items; bucket ``b``'s shares cross the link as ``wire[b]``."""
    group = np.array([b for b, _, _ in share_items], dtype=np.int64)
    rank = _issue_rank(best.kind, group)
    items = []
    for i, (b, link, piece) in enumerate(share_items):
        kind = int(best.kind[b])
        delayed = kind != _SYNC
        items.append(CommItem(
            id=int(rank[i]), slices=piece, link=link,
            window={_FWD: WINDOW_FORWARD_NEXT, _BWD_NEXT: WINDOW_BACKWARD_NEXT,
                    _SYNC: WINDOW_BACKWARD}[kind],
            delay=int(delayed), period=int(best.period[b]), period_offset=int(best.offset[b]),
            order=int(rank[i]), wait_at=WAIT_BEFORE_NEXT_UPDATE if delayed else WAIT_END_OF_BACKWARD,
            update_at=UPDATE_AT_NEXT_STEP if delayed else UPDATE_AT_STEP, bucket=b, wire_dtype=wire[b]))
    return items
