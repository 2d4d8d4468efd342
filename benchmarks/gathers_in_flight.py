"""How many gloo all-gathers may be in flight at once: the reproduction behind the 8-bit wire's chained gathers.

    sudo python benchmarks/gathers_in_flight.py --out benchmarks/results/tta/gathers-in-flight-<commit>.json

Two gloo workers on a loopback shaped to ``--rate`` (root and iproute2). Each of ``--rounds`` rounds launches
``--in-flight`` functional collectives (``torch.ops._c10d_functional``) of 2.6-15 KB each, with a matrix product on
the step's two intra-op threads between launches, then waits for them all and checks every value. Modes
(``--modes``):

* ``gather``: ``all_gather_into_tensor`` of ``uint8`` tensors, all in flight at once (what the 8-bit wire's step did
  before its gathers were chained);
* ``chain``: the same, each gather first waiting for the previous one (``passes/schedule.py``, ``_chain_gathers``):
  one in flight at a time, beside the compute;
* ``reduce``: in-place ``all_reduce_`` of ``float32`` tensors, all in flight at once (what the float32 and 16-bit
  wires do).

Per mode: whether both workers finished, their exit codes, the number of wrong values, and the failure's last
line (a worker that corrupts its heap dies with ``malloc(): unaligned tcache chunk detected``: exit code -6 or
-11).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def worker(rank: int, world_size: int, mode: str, in_flight: int, rounds: int) -> int:
    """One rank: ``rounds`` rounds of ``in_flight`` collectives of ``mode``; returns the number of wrong results."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(2)
    c10d = torch.ops._c10d_functional
    name = dist.new_group(backend="gloo").group_name
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    wrong = 0
    for round_ in range(rounds):
        launched = []
        for k in range(in_flight):
            value = (rank + k + round_) % 200
            numel = 2600 + 260 * (k % 50)
            if mode == "reduce":
                launched.append((k, c10d.all_reduce_(torch.full((numel,), float(rank + 1)), "sum", name)))
            else:
                if mode == "chain" and launched:
                    launched[-1] = (launched[-1][0], c10d.wait_tensor(launched[-1][1]))
                sent = torch.full((numel,), value, dtype=torch.uint8)
                launched.append((k, c10d.all_gather_into_tensor(sent, world_size, name)))
            (a @ b).sum()
        for k, out in launched:
            out = c10d.wait_tensor(out)
            if mode == "reduce":
                wrong += int(not bool((out == world_size * (world_size + 1) / 2).all()))
            else:
                rows = out.view(world_size, -1)
                wrong += sum(int(not bool((rows[r] == (r + k + round_) % 200).all())) for r in range(world_size))
    return wrong


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", nargs="+", default=["gather", "chain", "reduce"])
    parser.add_argument("--rate", default="200mbit")
    parser.add_argument("--in-flight", type=int, default=70)
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    from deft_compile.tools.bench import network
    from deft_compile.tools.launcher import run_local_workers
    from deft_compile.tools.provenance import provenance, script_command

    report = {"provenance": provenance(command=script_command(__file__, argv)), "rate": args.rate,
              "in_flight": args.in_flight, "rounds": args.rounds, "modes": {}}
    for mode in args.modes:
        with network(args.rate, 1, 2, prefix="deftgather") as net:
            results = run_local_workers(worker, 2, (mode, args.in_flight, args.rounds), **net["launch"],
                                        timeout_s=900, raise_on_failure=False)
        report["modes"][mode] = [{"ok": r.ok, "exit_code": r.exitcode, "wrong": r.value,
                                  "error": (r.error or "").strip().splitlines()[-1:]} for r in results]
        print(mode, report["modes"][mode], flush=True)
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
