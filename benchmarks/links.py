"""Real shaped links (docs/LINKS.md): how slow the links are, and what overlap and two links buy.

    sudo python benchmarks/links.py [--size-mb 16] [--repeats 5] [--json out.json]

Needs root and iproute2. Every number comes in pairs measured in the same run
(quote the ratios, not the milliseconds):

1. TCP stream (one socket, one direction) in a namespace whose ``lo`` is shaped
   to 1 Gbit/s vs an unshaped namespace.
2. 2-worker gloo all-reduce of ``--size-mb`` on the shaped vs the unshaped ``lo``.
   A shaped ``lo`` is one shared medium: the ring pushes 2·S bytes through it.
3. Overlap on the shaped ``lo``: all-reduce alone, ~150 ms of matmuls alone, and
   the matmuls placed between the all-reduce's start and its wait.
4. Two hosts joined by link1 (1 Gbit/s) and link2 (500 Mbit/s): the all-reduce
   over link1, over link2, and split 2:1 over both at once (ideal t1·t2/(t1+t2)).
5. alpha/beta fits (``time_ms = alpha + beta·bytes``) per link, for the profiler.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from deft_compile.tools.launcher import run_local_workers
from deft_compile.tools.netns import ShapedLoopback, TwoHostLinks, check_prerequisites, link_group
from deft_compile.planner.link_fit import fit_alpha_beta
from deft_compile.step.profiler import measure_allreduce

MB = 1 << 20
FIT_SIZES = [64 * 1024, 256 * 1024, MB, 4 * MB, 16 * MB]


# --------------------------------------------------------------------------- TCP stream (runs under `ip netns exec`)


def tcp_stream_gbps(seconds: float = 1.5) -> float:
    """One TCP stream over 127.0.0.1 in the current namespace, in Gbit/s (after a 0.3 s warm-up)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    received = [0]

    def sink() -> None:
        connection, _ = server.accept()
        while True:
            data = connection.recv(1 << 20)
            if not data:
                break
            received[0] += len(data)
        connection.close()

    thread = threading.Thread(target=sink)
    thread.start()
    client = socket.create_connection(server.getsockname())
    chunk = b"\0" * (1 << 20)
    started = time.perf_counter()
    mark_bytes, mark_time = 0, None
    while time.perf_counter() - started < seconds + 0.3:
        client.sendall(chunk)
        if mark_time is None and time.perf_counter() - started >= 0.3:
            mark_bytes, mark_time = received[0], time.perf_counter()
    client.close()
    thread.join()
    server.close()
    assert mark_time is not None
    return (received[0] - mark_bytes) * 8 / (time.perf_counter() - mark_time) / 1e9


def _tcp_in(namespace: ShapedLoopback) -> float:
    """Run ``--tcp-probe`` inside ``namespace`` (a subprocess: the benchmark itself must stay in the root namespace)."""
    output = subprocess.run(
        namespace.exec_prefix() + [sys.executable, __file__, "--tcp-probe"], capture_output=True, text=True, check=True
    ).stdout
    return float(output.strip().splitlines()[-1])


# --------------------------------------------------------------------------- workers


def _timed(fn: Any, repeats: int, group: Any = None) -> float:
    """Median over ``repeats`` of ``fn()``, each started after a barrier, slowest rank's time (ms)."""
    times = torch.zeros(repeats, dtype=torch.float64)
    fn()  # warm-up
    for index in range(repeats):
        dist.barrier(group=group)
        started = time.perf_counter()
        fn()
        times[index] = (time.perf_counter() - started) * 1e3
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
    return float(statistics.median(times.tolist()))


def _matmuls_for(target_ms: float) -> tuple[torch.Tensor, int]:
    """A 256x256 operand and how many matmuls take about ``target_ms`` on this core."""
    a = torch.randn(256, 256)
    for _ in range(20):  # warm-up: the first matmuls are slower and would undersize the count
        a @ a
    blocks = []
    for _ in range(5):  # median of blocks: a neighbour's burst of CPU must not skew the count
        started = time.perf_counter()
        for _ in range(10):
            a @ a
        blocks.append((time.perf_counter() - started) * 1e3 / 10)
    per_ms = statistics.median(blocks)
    count = torch.tensor([max(1, round(target_ms / per_ms))])
    dist.broadcast(count, 0)  # same compute on every rank
    return a, int(count)


def allreduce_worker(rank: int, world_size: int, size_bytes: int, repeats: int, overlap_ms: float | None) -> dict:
    tensor = torch.ones(size_bytes // 4)
    result = {"allreduce_ms": _timed(lambda: dist.all_reduce(tensor), repeats)}
    if overlap_ms is not None:
        a, count = _matmuls_for(overlap_ms)

        def compute() -> None:
            for _ in range(count):
                a @ a

        def overlapped() -> None:
            work = dist.all_reduce(tensor, async_op=True)
            compute()
            work.wait()

        result["compute_ms"] = _timed(compute, repeats)
        result["overlapped_ms"] = _timed(overlapped, repeats)
    result["fit_samples"] = measure_allreduce(None, FIT_SIZES, repeats=3)
    return result


def two_links_worker(rank: int, world_size: int, size_bytes: int, repeats: int) -> dict:
    group2 = link_group("link2")
    tensor = torch.ones(size_bytes // 4)
    first = tensor[: 2 * tensor.numel() // 3]
    second = tensor[2 * tensor.numel() // 3 :]

    def split() -> None:
        works = [dist.all_reduce(first, async_op=True), dist.all_reduce(second, group=group2, async_op=True)]
        for work in works:
            work.wait()

    return {
        "link1_ms": _timed(lambda: dist.all_reduce(tensor), repeats),
        "link2_ms": _timed(lambda: dist.all_reduce(tensor, group=group2), repeats),
        "split_ms": _timed(split, repeats),
        "link1_samples": measure_allreduce(None, FIT_SIZES, repeats=3),
        "link2_samples": measure_allreduce(group2, FIT_SIZES, repeats=3),
    }


# --------------------------------------------------------------------------- driver


def _fit(samples: list) -> dict:
    alpha, beta = fit_alpha_beta([tuple(s) for s in samples])
    return {"alpha_ms": round(alpha, 3), "beta_ms_per_MB": round(beta * MB, 3), "samples": samples}


def run(size_mb: float, repeats: int, rate1: str, rate2: str) -> dict:
    size = int(size_mb * MB)
    out: dict[str, Any] = {"size_bytes": size, "repeats": repeats}
    with ShapedLoopback(rate=None) as plain, ShapedLoopback(rate=rate1) as shaped:
        out["tcp_gbps"] = {"unshaped": round(_tcp_in(plain), 2), "shaped": round(_tcp_in(shaped), 2)}
        unshaped_run = run_local_workers(allreduce_worker, 2, (size, repeats, None), timeout_s=300, **plain.launch_kwargs(2))[0].value
        shaped_run = run_local_workers(allreduce_worker, 2, (size, repeats, 150.0), timeout_s=300, **shaped.launch_kwargs(2))[0].value
    out["loopback"] = {
        "unshaped_ms": round(unshaped_run["allreduce_ms"], 1),
        "shaped_ms": round(shaped_run["allreduce_ms"], 1),
        "compute_ms": round(shaped_run["compute_ms"], 1),
        "overlapped_ms": round(shaped_run["overlapped_ms"], 1),
        "hidden_ms": round(shaped_run["allreduce_ms"] + shaped_run["compute_ms"] - shaped_run["overlapped_ms"], 1),
        "fit_unshaped": _fit(unshaped_run["fit_samples"]),
        "fit_shaped": _fit(shaped_run["fit_samples"]),
    }
    with TwoHostLinks(rates=(rate1, rate2)) as links:
        two = run_local_workers(two_links_worker, 2, (size, repeats), timeout_s=300, **links.launch_kwargs(2))[0].value
        sent = {link: links.sent_bytes(0, link) for link in links.interfaces}
    t1, t2 = two["link1_ms"], two["link2_ms"]
    out["two_links"] = {
        "rates": [rate1, rate2],
        "link1_ms": round(t1, 1),
        "link2_ms": round(t2, 1),
        "split_ms": round(two["split_ms"], 1),
        "ideal_split_ms": round(t1 * t2 / (t1 + t2), 1),
        "tx_bytes_rank0": sent,
        "fit_link1": _fit(two["link1_samples"]),
        "fit_link2": _fit(two["link2_samples"]),
    }
    return out


def report(out: dict) -> str:
    lo, two, tcp = out["loopback"], out["two_links"], out["tcp_gbps"]
    size_mb = out["size_bytes"] / MB
    lines = [
        f"TCP stream on lo: shaped {tcp['shaped']} Gbit/s, unshaped {tcp['unshaped']} Gbit/s "
        f"(unshaped/shaped {tcp['unshaped'] / tcp['shaped']:.1f}x)",
        f"{size_mb:g} MB all-reduce, 2 workers: shaped lo {lo['shaped_ms']} ms, unshaped {lo['unshaped_ms']} ms "
        f"(shaped/unshaped {lo['shaped_ms'] / lo['unshaped_ms']:.1f}x)",
        f"overlap on shaped lo: comm {lo['shaped_ms']} ms + compute {lo['compute_ms']} ms -> together {lo['overlapped_ms']} ms "
        f"(hidden {lo['hidden_ms']} ms = {lo['hidden_ms'] / lo['compute_ms']:.0%} of the compute)",
        f"two links {two['rates']}: link1 {two['link1_ms']} ms, link2 {two['link2_ms']} ms "
        f"(link2/link1 {two['link2_ms'] / two['link1_ms']:.2f}x), split 2:1 {two['split_ms']} ms "
        f"(ideal {two['ideal_split_ms']} ms, split/link1 {two['split_ms'] / two['link1_ms']:.2f}x)",
    ]
    for key, fit in (("shaped lo", lo["fit_shaped"]), ("unshaped lo", lo["fit_unshaped"]),
                     ("link1", two["fit_link1"]), ("link2", two["fit_link2"])):
        lines.append(f"fit {key}: alpha {fit['alpha_ms']} ms, beta {fit['beta_ms_per_MB']} ms/MB")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=float, default=16.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rate1", default="1gbit")
    parser.add_argument("--rate2", default="500mbit")
    parser.add_argument("--json", help="also write the raw numbers here")
    parser.add_argument("--tcp-probe", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.tcp_probe:
        print(tcp_stream_gbps())
        return
    check_prerequisites()
    out = run(args.size_mb, args.repeats, args.rate1, args.rate2)
    print(report(out))
    if args.json:
        from deft_compile.tools.provenance import provenance

        with open(args.json, "w") as handle:
            json.dump({"provenance": provenance(), **out}, handle, indent=2)


if __name__ == "__main__":
    main()
