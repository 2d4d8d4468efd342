"""Bounds for tests that compare a step run by Inductor with a reference, derived on the machine that runs them.

Inductor fuses kernels and sums float32 values in other orders than eager ATen, and the order depends on the CPU's
vector width and kernels (``ATEN_CPU_CAPABILITY``, Inductor's ``cpp.simdlen``). A constant tolerance tuned on one
CPU fails on another, or hides a defect on a third. Every Inductor bound in the suite (the regional default route,
``compiler="inductor"``, the whole-graph ``"inductor-graph"``, the ``torch.compile`` backend) comes from one of:

1. A yardstick measured in the same launch (:func:`check_within_drift`, :func:`check_scalars_within_drift`): the
   reference computation itself with the model compiled by ``torch.compile`` (Inductor, Dropout drawn from ATen's
   generator), against the eager reference, on the same model, data, optimizer, learning-rate schedule, clipping,
   accumulation and steps: DDP around ``torch.compile(model)`` against DDP (``default_route_workers.
   compile_beside_ddp``), the eager reference of the delayed semantics with its model compiled against the eager
   one (``default_route_workers.delayed_beside_compile``), ``Trainer(torch_compile=True)`` against ``Trainer``; in
   one process, the compiled model and the eager one, each with its eager optimizer. deft's largest difference from
   the reference over the run (every tensor, every step, after ``flush()``) may be at most ``DRIFT_MULTIPLE`` times
   the yardstick's largest, measured the same way.

   Both are round-off of the same computation in other orders, so they differ by small factors (deft's was 0.3x to
   2x the yardstick's on a 2-core AMD EPYC with AVX2 and with the scalar kernel set, torch 2.13.0); 10 leaves room
   for other CPUs and still fails on a defect, whose difference is of the order of one update (the learning rate
   over the weights' magnitude, 1e-3 and more in these tests) or, for memory read before it is written, arbitrary.
   Measured yardsticks, and what a defect costs against them: SGD in float32 1e-7 to 4e-7 (Inductor's round-off,
   which SGD does not amplify; one SGD update is 1e-3 and more); Adam and AdamW on the transformers 5e-7 to 3e-6
   (one AdamW update is 1e-3 and more, 30x the bound at least). Where Adam or RMSprop divide by ``sqrt(v)``,
   round-off in an element whose gradients nearly cancel is amplified by an amount that depends on model, data and
   step: the yardstick measures exactly that amplification. Under fp16 autocast Inductor computes a chain of fp16
   pointwise ops in float32 and rounds once (``torch._inductor.config.emulate_precision_casts`` off) where eager
   rounds after every op, so any Inductor-compiled step differs from eager by fp16 round-off (yardstick 8e-4 with
   SGD), far above float32's, and only the yardstick knows by how much; a wrong loss scale or a missed skip is off
   by orders of magnitude more.

   A parameter whose gradient is mathematically zero and numerically round-off, such as an attention key bias
   (softmax ignores a shift common to all keys), is no such computation under Adam: Adam turns the round-off into
   steps of size lr whose signs depend on the order of the sums, in any two implementations. The tests keep such
   parameters out of the Adam models or bound them apart (absolutely, against the yardstick's own difference there).

2. A written round-off analysis (:func:`summation_bound`), next to the assertion, for a value that is a sum computed
   in another order (a loss, a gradient norm, one kernel's output) where a yardstick would cost a launch or a compile
   of its own: a sum of ``n`` float32 terms, each within a few units of round-off ``u = 2**-24`` of its exact value,
   is within ``(n + 2) u sum|terms|`` of the exact sum in any order (Higham, Accuracy and Stability of Numerical
   Algorithms, 2nd ed., 3.1 and 4.2; a dot product's products are such terms); two orders are within twice that of
   each other. The term count and ``sum|terms|`` come from the test's own data.

A yardstick of exactly zero (the compiled reference gave eager's numbers bit for bit over the whole run) gives no
scale: the check then fails and says so, rather than accept any difference or none. Scalars a run logs as Python
floats (losses, gradient norms) may agree bit for bit with eager's where a whole tensor run does not; there the
yardstick counts as at least one float32 ulp (``FLOAT32_ULP`` relative, the spacing of float32 values at 1.0): a
bound no CPU can round under.
"""

from __future__ import annotations

from typing import Iterable

import torch

#: deft's difference from its reference may be this many times the yardstick's (derivation above)
DRIFT_MULTIPLE = 10
#: float32's unit round-off
UNIT_ROUND_OFF = 2.0 ** -24
#: the spacing of float32 values at 1.0: one float32 ulp, relative
FLOAT32_ULP = 2.0 ** -23


def worst(entries: Iterable[dict]) -> float:
    """The largest ``max_rel`` of comparison entries (``workers._compare``'s)."""
    return max(entry["max_rel"] for entry in entries)


def check_difference(difference: float, drift: float, where: str, multiple: float = DRIFT_MULTIPLE) -> None:
    """deft's ``difference`` from its reference within ``multiple`` times ``drift``, the yardstick's measured the same
    way over the same run; a zero yardstick fails. Prints both and their ratio (``pytest -rP`` shows it)."""
    assert drift > 0, f"{where}: torch.compile gave eager's numbers exactly: no drift to bound by"
    print(f"{where}: deft {difference:.3g}, torch.compile {drift:.3g}, ratio {difference / drift:.3g}")
    assert difference <= multiple * drift, f"{where}: {difference:.3g} > {multiple} x torch.compile's {drift:.3g}"


def check_within_drift(entries: Iterable[dict], drift: float, where: str, multiple: float = DRIFT_MULTIPLE) -> None:
    """Every entry (per-tensor relative differences, ``workers._compare``'s) within ``multiple`` times ``drift``,
    the yardstick's largest relative difference over the same run."""
    assert drift > 0, f"{where}: torch.compile gave eager's numbers exactly: no drift to bound by"
    entries = list(entries)
    for entry in entries:
        assert entry["missing"] == [] and entry["compared"] > 0, f"{where}: {entry}"
    largest = max(entries, key=lambda entry: entry["max_rel"])
    check_difference(largest["max_rel"], drift,
                     f"{where} step {largest.get('step', 'after flush')} worst {largest['worst']}", multiple)


def relative(actual: Iterable[float], expected: Iterable[float]) -> list[float]:
    """``|a - e| / |e|`` of each pair (logged scalars: losses, gradient norms)."""
    return [abs(a - e) / abs(e) for a, e in zip(actual, expected, strict=True)]


def check_scalars_within_drift(differences: Iterable[float], yardstick: Iterable[float], where: str,
                               multiple: float = DRIFT_MULTIPLE) -> float:
    """deft's relative differences of a logged scalar within ``multiple`` times the yardstick's largest, which counts
    as at least ``FLOAT32_ULP`` (derivation above); returns that yardstick."""
    drift = max(max(yardstick), FLOAT32_ULP)
    check_difference(max(differences), drift, where, multiple)
    return drift


def summation_bound(terms: int, magnitude: float | torch.Tensor) -> float | torch.Tensor:
    """How far two float32 evaluation orders of a sum of ``terms`` terms whose absolute values add up to
    ``magnitude`` may differ: ``2 (terms + 2) u magnitude`` (derivation above). ``magnitude`` may be a tensor: a
    bound per element."""
    return 2.0 * (terms + 2) * UNIT_ROUND_OFF * magnitude
