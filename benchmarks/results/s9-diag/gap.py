import json, os, sys
os.environ["DEFT_EMULATE_ACCELERATOR"] = "1"
from deft_compile.tools.bench import run_config
import statistics as st
if __name__ == "__main__":
    out = sys.argv[1]
    r = run_config("resnet50", "228mbit", policies=sys.argv[2].split(","), steps=16, warmup=10, rounds=4, progress=False)
    res = {k: r[k] for k in ("warm_log", "consecutive_ms", "samples_ms", "rows", "plan_history")}
    json.dump(res, open(out, "w"), default=str)
    for name, xs in r["consecutive_ms"].items():
        half = len(xs)//2
        s = r["samples_ms"][name]
        print(f"{name:14s} consec-before med {st.median(xs[:half]):7.1f} mean {st.mean(xs[:half]):7.1f} | blocks med {st.median(s):7.1f} mean {st.mean(s):7.1f} | consec-after med {st.median(xs[half:]):7.1f} mean {st.mean(xs[half:]):7.1f}")
        print("   before", [round(x) for x in xs[:half]])
        print("   blocks", [round(x) for x in s])
        print("   after ", [round(x) for x in xs[half:]])
    