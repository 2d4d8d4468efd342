"""Session 14 diagnostic: does a small all-reduce on another process group wait behind a large one in flight?

    python benchmarks/results/s14-diag/queue_behind.py     # root: builds a shaped namespace, removes it after

Two gloo workers in a namespace whose loopback is shaped to 500 Mbit/s (the bench's ``network``). Per repeat:
a 1-element all-reduce alone on group B; then a 16 MB all-reduce launched asynchronously on the default group and,
5 ms later, the 1-element all-reduce on group B, timed. Prints each rank's medians (ms).

Recorded (``queue_behind.txt``): alone 0.4 ms; behind the large one 33-46 ms (28-40 ms in a first run); the large
one 510-512 ms. The small collective's packets queue in the shaped link's qdisc behind the gradients, whatever
the group. So a synchronisation between steps gives a plan that leaves communication in flight 30-45 ms of
communication done outside the timed steps: the bench's warm-up all-reduced such a flag after every step until
session 14, while the closed loop timed its trials and duels.
"""
import statistics as st
import time

import torch
import torch.distributed as dist

from deft_compile.tools.bench import network
from deft_compile.tools.launcher import run_local_workers

def worker(rank, ws):
    from deft_compile.tools.emulation import new_group
    a = dist.group.WORLD
    b = new_group(ranks=[0, 1])
    big = torch.ones(4_000_000)  # 16 MB
    small = torch.ones(1)
    out = {"alone": [], "behind": [], "big": []}
    for i in range(6):
        dist.barrier(group=b)
        t = time.perf_counter(); dist.all_reduce(small, group=b); out["alone"].append((time.perf_counter() - t) * 1e3)
        dist.barrier(group=b)
        t0 = time.perf_counter()
        w = dist.all_reduce(big, group=a, async_op=True)
        time.sleep(0.005)
        t = time.perf_counter(); dist.all_reduce(small, group=b); out["behind"].append((time.perf_counter() - t) * 1e3)
        w.wait(); out["big"].append((time.perf_counter() - t0) * 1e3)
    return {k: round(st.median(v), 1) for k, v in out.items()}

if __name__ == "__main__":
    with network("500mbit", 1, 2, None, "deftq") as net:
        print(net["description"])
        print([r.value for r in run_local_workers(worker, 2, (), timeout_s=120, collective_timeout_s=60, **net["launch"])])
