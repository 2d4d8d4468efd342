"""Planner speed: solve each policy and simulate one iteration for a 500-bucket profile.

Targets: solving each policy <= 50 ms, simulating one iteration <= 5 ms.
Run: ``python benchmarks/planner_speed.py`` (add ``--buckets N``/``--repeat R``).
The profile has N parameters of 1-4 MiB with DDP limits of 1 MiB, so each
parameter is its own DDP bucket (N buckets); compute and link costs are drawn
so the coverage rate is about 1.5, which exercises DeFT's period search too.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deft_compile.planner.plan import LinkCost, ParamProfile, Profile  # noqa: E402
from deft_compile.planner.simulator import simulate  # noqa: E402
from deft_compile.planner.solvers import POLICIES, solve  # noqa: E402

MiB = 1024 * 1024


def bench_profile(n_buckets: int, seed: int = 0) -> Profile:
    """N parameters of 1-4 MiB, each one DDP bucket at 1 MiB limits; CR about 1.5."""
    rng = np.random.default_rng(seed)
    numels = rng.integers(MiB // 4, MiB, size=n_buckets)  # float32: 1-4 MiB
    params = [ParamProfile(f"p{i}", int(numels[i]), "float32", float(rng.uniform(0.02, 0.1)),
                           float(rng.uniform(0.04, 0.2)), 0.002, layer=n_buckets - 1 - i)
                  for i in range(n_buckets)]
    compute = sum(p.forward_ms + p.backward_ms for p in params)
    total = sum(p.nbytes for p in params)
    link = LinkCost("bench", 0.02, 1.5 * compute / total)
    return Profile(params, [link], world_size=16, name=f"bench-{n_buckets}")


def timed(fn, repeat: int) -> tuple[float, object]:
    times = []
    result = None
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times), result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--buckets", type=int, default=500)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    profile = bench_profile(args.buckets)
    kw = {"first_bucket_bytes": MiB, "bucket_cap_bytes": MiB}
    print(f"profile: {len(profile.params)} params, {len(profile.buckets(MiB, MiB))} DDP buckets, "
          f"median of {args.repeat} runs")
    print(f"{'policy':<14} {'items':>6} {'solve ms':>9} {'sim/iter ms':>12} {'iters':>6}")
    ok = True
    for policy in POLICIES:
        options = kw if policy in ("wfbp", "deft") else {}
        solve_ms, plan = timed(lambda: solve(profile, policy, **options), args.repeat)
        timeline = simulate(profile, plan, record=False)
        steps = timeline.measured[1]
        sim_ms, _ = timed(lambda: simulate(profile, plan, record=False, check=False), args.repeat)
        per_iteration = sim_ms / steps
        ok &= solve_ms <= 50 and per_iteration <= 5
        print(f"{policy:<14} {len(plan.items):>6} {solve_ms:>9.2f} {per_iteration:>12.3f} {steps:>6}")
    print("targets met" if ok else "TARGETS MISSED (solve <= 50 ms, simulate <= 5 ms/iteration)")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
