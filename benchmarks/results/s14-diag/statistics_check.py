"""Session 14 diagnostic: the statistic of the bench's rounds, and the closed loop's time of the same plan.

    python benchmarks/results/s14-diag/statistics_check.py OUT.json resnet50 249mbit wfbp,deft   # EMU=0: normal mode

One launch (floor, DDP, the policies; 12 timed steps in 3 rounds, 10 warm-up steps, accelerator emulation unless
EMU=0). Prints per variant the bench's statistic (the median over blocks of the block's mean of the per-step
maximum over ranks), the same with each rank's own block mean (the slower rank's), the larger of the ranks'
medians, and the closed loop's own time of the plan that ran.

Recorded (ResNet-50 at 249 Mbit/s, coverage rate about 1, emulation):
- ``flags-resnet50.*``: the code of ``ec00a9c`` plus every rank's samples, whose warm-up all-reduced a flag after
  every step. The per-step maximum and the ranks' own block means agree within 1.6 %; ``deft`` ran 142.4 ms in
  the rounds, and its closed loop had timed that plan at 116.2 ms (the flags' queueing: ``queue_behind.py``).
- ``noflags-resnet50.*``: the same with the warm-up deciding locally (what ``27496f8`` ships): within 1.8 %;
  ``deft`` (settled on US-Byte's plan) 137.5-139.5 ms in the rounds, 125.3 ms in the closed loop's trial.
"""
import json, os, sys, statistics as st
os.environ["DEFT_EMULATE_ACCELERATOR"] = os.environ.get("EMU", "1")
from deft_compile.tools.bench import run_config
if __name__ == "__main__":
    out, model, rate, pols = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4].split(",")
    comp = sys.argv[5] if len(sys.argv) > 5 else "aten"
    r = run_config(model, rate, policies=pols, steps=12, warmup=10, rounds=3, progress=False, compiler=comp)
    json.dump({k: r[k] for k in ("samples_ms", "samples_by_rank_ms", "rows", "plan_history", "steps")}, open(out, "w"), default=str)
    block = r["steps"]["block"]
    for name, per_rank in r["samples_by_rank_ms"].items():
        mx = r["samples_ms"][name]
        nb = len(mx) // block
        elem = st.median(st.fmean(mx[b*block:(b+1)*block]) for b in range(nb))
        rankwise = st.median(max(st.fmean(pr[b*block:(b+1)*block]) for pr in per_rank) for b in range(nb))
        medmax = max(st.median(pr) for pr in per_rank)
        print(f"{name:18s} elementwise-max block-mean {elem:8.1f} | max-rank block-mean {rankwise:8.1f} | max of rank medians {medmax:8.1f} | closed loop {r['rows'][name].get('closed_loop_ms')}")
        for pr in per_rank: print("     ", [round(x) for x in pr])
