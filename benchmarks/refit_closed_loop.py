"""Re-fit the closed loop's profile refinement from a suite results file, with and without the prior.

The bench JSON keeps, per launch, ``deft``'s refined profile and the closed loop's record (the factors it
fitted and every measured plan's time). This script undoes the recorded factors to get the profile as measured,
re-solves the synchronous plans the loop timed (DDP's buckets, ByteScheduler's, US-Byte's; matched by plan hash),
and fits them again with ``refine_scales`` under four settings: γ held at the profile's or fitted, each with no
prior (``prior_weight=0``) and with ``PRIOR_WEIGHT``; where the launch recorded the compute floor it fitted
under (``min_compute``), both γ settings with it; and where it recorded the step thread's run-queue delays,
``refine_from_threads``: compute and contention measured, the link's per-byte and per-message factors fitted.
Each plan's predicted time on that last refinement is printed beside its measured one (docs/PLANNER.md and
benchmarks/results/clock-probes/ quote these fits).

    python benchmarks/refit_closed_loop.py benchmarks/results/clock-probes/probe-resnet-normal.json \
        --out benchmarks/results/clock-probes/probe-resnet-normal.refit.txt
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from deft_compile.planner.plan import Profile
from deft_compile.planner.simulator import simulate
from deft_compile.planner.solvers import solve
from deft_compile.planner.stability import predicted_ms
from deft_compile.planner.refine import (PRIOR_WEIGHT, refine_from_threads, refine_scales, scaled_parts,
                                         scaled_profile)


def measured_synchronous_plans(run: dict[str, Any], variant: str = "deft"):
    """(profile as measured, [(plan, measured ms)], recorded (compute, link, contention), candidates recorded) of
    one launch, or None when the launch's closed loop recorded no candidates. A recorded plan that re-solving does
    not reproduce (by hash) is left out: the last number says how many there were."""
    records = [entry["closed_loop"] for entry in run["plan_history"].get(variant, [])
               if isinstance(entry.get("closed_loop"), dict) and entry["closed_loop"].get("candidates")]
    if not records:
        return None
    compute, link = records[0]["scales"]
    contention = records[0].get("contention") or 0.0
    latency = records[0].get("latency_scale") or link
    refined = Profile.from_json(run["profiles"][variant])
    base = scaled_profile(refined, 1.0 / compute, 1.0 / link, 0.0, latency=1.0 / latency)
    plans = {plan.hash()[:12]: plan for plan in (solve(base, variant, max_staleness=0), solve(base, "bytescheduler"),
                                                 solve(base, "usbyte"))}
    measured = [(plans[h], c["measured_ms"]) for h, c in records[0]["candidates"].items() if h in plans]
    return base, measured, (compute, link, contention), len(records[0]["candidates"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", help="a suite results JSON (benchmarks/suite.py writes them)")
    parser.add_argument("--out", default=None, help="also write what this prints to this file, after a first line "
                                                    "with its provenance (deft_compile.tools.provenance)")
    args = parser.parse_args(argv)
    if args.out:
        import contextlib
        import io
        from pathlib import Path

        from deft_compile.tools.provenance import TEXT_PREFIX, provenance

        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            main([args.results])
        print(printed.getvalue(), end="")
        Path(args.out).write_text(TEXT_PREFIX + json.dumps(provenance()) + "\n" + printed.getvalue())
        return
    data = json.load(open(args.results))
    settings = [("gamma held, no prior", {"contention": 0.0, "prior_weight": 0.0}),
                ("gamma held, prior", {"contention": 0.0}),
                ("gamma fitted, no prior", {"prior_weight": 0.0}),
                ("gamma fitted, prior", {})]
    print(f"PRIOR_WEIGHT = {PRIOR_WEIGHT:.2e}")
    for entry in data["results"]:
        print(f"== {entry['model']} ({entry.get('rate')})")
        for index, run in enumerate(entry["runs"]):
            found = measured_synchronous_plans(run)
            if found is None:
                print(f"  launch {index}: no closed-loop record")
                continue
            base, measured, recorded, recorded_plans = found
            times = ", ".join(f"{ms:.1f}" for _, ms in measured)
            print(f"  launch {index}: {len(measured)} of {recorded_plans} recorded plans re-solved, measured {times} ms; "
                  f"recorded compute {recorded[0]:.2f} link {recorded[1]:.2f} "
                  f"contention {recorded[2]:.2f}")

            parts = scaled_parts(base)

            floor = next((entry["closed_loop"].get("min_compute") for entry in run["plan_history"].get("deft", [])
                          if isinstance(entry.get("closed_loop"), dict) and entry["closed_loop"].get("min_compute")),
                         None)
            floored = [(f"gamma held, prior, compute >= {floor:.2f}", {"contention": 0.0, "min_compute": floor}),
                       (f"gamma fitted, prior, compute >= {floor:.2f}", {"min_compute": floor})] if floor else []
            for label, options in settings + floored:
                fitted = refine_scales(measured, parts, **options)
                print(f"    {label:24s} compute {fitted.compute:.2f}  link {fitted.link:.2f}  "
                      f"contention {fitted.contention:.2f}  rms miss {100 * fitted.error:.1f} %")
            candidates = next(entry["closed_loop"]["candidates"] for entry in run["plan_history"]["deft"]
                              if isinstance(entry.get("closed_loop"), dict) and entry["closed_loop"].get("candidates"))
            threads = [(c["compute_cpu_ms"], c["run_queue_ms"]) if "run_queue_ms" in c else None
                       for c in (candidates[plan.hash()[:12]] for plan, _ in measured)]
            fitted = refine_from_threads(measured, parts, lambda plan, base=base: simulate(
                    base, plan, record=False, check=False).compute_ms, threads)
            if fitted is None:
                continue
            print(f"    {'from the thread clocks':24s} compute {fitted.compute:.2f}  link {fitted.link:.2f}  latency "
                  f"{fitted.latency:.2f}  contention {fitted.contention:.2f} (run-queue share "
                  f"{fitted.run_queue_share:.2f})  rms miss {100 * fitted.error:.1f} %")
            refined_profile = scaled_profile(base, fitted.compute, fitted.link, fitted.contention, latency=fitted.latency)
            for (plan, ms), timed in zip(measured, threads):
                print(f"      {plan.policy:14s} measured {ms:7.1f} ms (CPU {timed[0]:6.1f}, run queue {timed[1]:5.1f})"
                      f"  predicted {predicted_ms(refined_profile, plan):7.1f} ms")


if __name__ == "__main__":
    main()
