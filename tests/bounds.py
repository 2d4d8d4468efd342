"""Bounds for tests that compare a step run by Inductor with a reference, derived on the machine that runs them.

Inductor fuses kernels and sums float32 values in other orders than eager ATen, and the order depends on the CPU's
vector width and kernels (``ATEN_CPU_CAPABILITY``, Inductor's ``cpp.simdlen``). A constant tolerance tuned on one
CPU fails on another, or hides a defect on a third. Every Inductor bound in the suite comes from one of:

1. A yardstick measured in the same run (:func:`check_within_drift`): the reference computation itself with the
   model compiled by ``torch.compile`` (Inductor, Dropout drawn from ATen's generator), against the eager
   reference, on the same model, data, optimizer and steps. deft's largest difference from the eager reference
   over the run may be at most ``DRIFT_MULTIPLE`` times the yardstick's largest. Both are round-off of the same
   computation in other orders, so they differ by small factors (deft's was 1.0x to 1.7x the yardstick's on a
   2-core AMD EPYC with AVX2 and with the scalar kernel set, torch 2.13.0); 10 leaves room for other CPUs and still
   fails on a defect, whose difference is of the order of one update (the learning rate over the weights'
   magnitude, 1e-3 and more in these tests) or, for memory read before it is written, arbitrary. Where Adam or
   RMSprop divide by ``sqrt(v)``, round-off in an element whose gradients nearly cancel is amplified by an amount
   that depends on model, data and step: the yardstick measures exactly that amplification.
2. A written round-off analysis (:func:`summation_bound`), for a value that is a sum computed in another order: a
   sum of ``n`` float32 terms, each within a few units of round-off ``u = 2**-24`` of its exact value, is within
   ``(n + 2) u sum|terms|`` of the exact sum in any order (Higham, Accuracy and Stability of Numerical
   Algorithms, 2nd ed., 4.2); two orders are within twice that of each other.

A yardstick of exactly zero (the compiled reference gave eager's numbers bit for bit over the whole run) gives no
scale: the check then fails and says so, rather than accept any difference or none.
"""

from __future__ import annotations

from typing import Iterable

#: deft's difference from its reference may be this many times the yardstick's (derivation above)
DRIFT_MULTIPLE = 10
#: float32's unit round-off
UNIT_ROUND_OFF = 2.0 ** -24


def worst(entries: Iterable[dict]) -> float:
    """The largest ``max_rel`` of comparison entries (``workers._compare``'s)."""
    return max(entry["max_rel"] for entry in entries)


def check_within_drift(entries: Iterable[dict], drift: float, where: str, multiple: float = DRIFT_MULTIPLE) -> None:
    """Every entry (per-tensor relative differences, ``workers._compare``'s) within ``multiple`` times ``drift``,
    the yardstick's largest relative difference over the same run."""
    assert drift > 0, f"{where}: torch.compile gave eager's numbers exactly: no drift to bound by"
    bound = multiple * drift
    for entry in entries:
        assert entry["missing"] == [] and entry["compared"] > 0, f"{where}: {entry}"
        assert entry["max_rel"] <= bound, (f"{where} step {entry.get('step', 'after flush')}: worst {entry['worst']} "
                                           f"{entry['max_rel']:.3g} > {multiple} x torch.compile's {drift:.3g}")


def summation_bound(terms: int, magnitude: float) -> float:
    """How far two float32 evaluation orders of a sum of ``terms`` terms whose absolute values add up to
    ``magnitude`` may differ: ``2 (terms + 2) u magnitude`` (derivation above)."""
    return 2.0 * (terms + 2) * UNIT_ROUND_OFF * magnitude
