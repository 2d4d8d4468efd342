"""Soak `examples/train_hf_trainer.py` under torchrun: launch it N times in a row and count the crashes.

Each launch is one `torchrun --standalone --nproc-per-node 2` run of the example (`--tiny`, a few updates, a
checkpoint halfway); every second launch resumes from the checkpoint the launch before it wrote, so both the fresh
and the resumed path are soaked. Output goes to pipes, as under pytest. A launch crashes when torchrun's exit code
is not 0; for a crash the result keeps every rank's exit code as torchrun reports it (a negative code is the signal
that ended the rank: -6 is SIGABRT), the tail of its output, and the core files the ranks left (`--cores`).

    nice -n 10 python benchmarks/soak_trainer_example.py --launches 50 \
        --out benchmarks/results/soak/trainer_example.json

The results JSON records its provenance (`deft_compile.tools.provenance`: the command, the commit of the checkout
that ran and whether its tree was clean, the date, the torch version, the machine), the launches and the crashes.
`--source DIR` runs the example and deft_compile from another checkout (a clone at the commit to soak) instead of
this one; the provenance then names that checkout's commit and state.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def rank_exit_codes(output: str) -> dict[str, int]:
    """Each failed rank's exit code from torchrun's failure summary (``rank : 0 (local_rank: 0)`` then
    ``exitcode : -6``)."""
    codes = {}
    for rank, code in re.findall(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)", output):
        codes[rank] = int(code)
    return codes


def launch(source: Path, work: Path, args: argparse.Namespace, resume: str | None, cores: bool) -> dict:
    torchrun = shutil.which("torchrun")
    launcher = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]
    command = [*launcher, "--standalone", "--nproc-per-node", "2", str(source / "examples" / "train_hf_trainer.py"),
               "--tiny", "--steps", str(args.steps), "--save-steps", str(args.save_steps), "--output-dir", "out",
               "--policy", args.policy]
    if resume is not None:
        command += ["--resume", resume]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONFAULTHANDLER": "1",
           "DEFT_COMPILER": args.compiler, "PYTHONPATH": os.pathsep.join(
               [str(source), *filter(None, [os.environ.get("PYTHONPATH")])])}

    def allow_cores() -> None:
        resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))

    started = time.monotonic()
    try:
        completed = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout_s, cwd=work, env=env,
                                   preexec_fn=allow_cores if cores else None)
        returncode, output = completed.returncode, completed.stdout + completed.stderr
    except subprocess.TimeoutExpired as expired:
        returncode = "timeout"
        output = "".join(x.decode() if isinstance(x, bytes) else (x or "") for x in (expired.stdout, expired.stderr))
    seconds = time.monotonic() - started
    finished = bool(re.search(r"final eval loss \S+ after \d+ updates", output))
    return {"command": command, "returncode": returncode, "seconds": round(seconds, 1), "finished": finished,
            "output": output}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--launches", type=int, default=50)
    parser.add_argument("--steps", type=int, default=4, help="the example's --steps")
    parser.add_argument("--save-steps", type=int, default=2, help="the example's --save-steps (the resumed checkpoint)")
    parser.add_argument("--policy", default="deft")
    parser.add_argument("--compiler", default="aten", help="DEFT_COMPILER for the ranks (aten: no Inductor compile)")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="a launch running longer counts as a hang")
    parser.add_argument("--source", type=Path, default=ROOT, help="the checkout to run (its examples/ and deft_compile)")
    parser.add_argument("--cores", type=Path, default=None,
                        help="keep the core files of crashed ranks here (core dumps on; the kernel's core_pattern "
                             "must write them into the working directory)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "soak" / "trainer_example.json")
    args = parser.parse_args(argv)
    source = args.source.resolve()

    from deft_compile.tools.provenance import provenance

    result = {
        "provenance": provenance(root=source),  # the commit and tree state of the checkout that ran
        "example": {"steps": args.steps, "save_steps": args.save_steps, "policy": args.policy,
                    "compiler": args.compiler, "processes": 2},
        "launches": [],
        "crashes": [],
    }
    checkpoint = None
    scratch = tempfile.mkdtemp(prefix="soak-")  # kept where a launch crashed: its output and cores stay there
    for index in range(args.launches):
        resumed = index % 2 == 1 and checkpoint is not None
        work = Path(scratch) / f"launch{index:03d}"
        if resumed:
            shutil.copytree(checkpoint, work)
        else:
            work.mkdir()
        outcome = launch(source, work, args, f"out/checkpoint-{args.save_steps}" if resumed else None,
                         args.cores is not None)
        crashed = outcome["returncode"] != 0 or not outcome["finished"]
        entry = {"launch": index, "resumed": resumed, "returncode": outcome["returncode"],
                 "seconds": outcome["seconds"], "crashed": crashed}
        result["launches"].append(entry)
        if crashed:
            (work / "launch.log").write_text(outcome["output"])
            print(outcome["output"][-3000:], flush=True)
            cores = sorted(str(p) for p in work.glob("core*"))
            if args.cores is not None and cores:
                args.cores.mkdir(parents=True, exist_ok=True)
                cores = [str(shutil.copy(core, args.cores / f"launch{index:03d}-{Path(core).name}"))
                         for core in cores]
            result["crashes"].append({**entry, "rank_exit_codes": rank_exit_codes(outcome["output"]),
                                      "cores": cores, "output_tail": outcome["output"][-6000:]})
        elif not resumed:
            checkpoint = work
        print(f"launch {index + 1}/{args.launches}{' (resumed)' if resumed else ''}: exit code "
              f"{outcome['returncode']}, {outcome['seconds']:.0f} s{' CRASHED' if crashed else ''}", flush=True)
        if resumed:  # the checkpoint it resumed from is done with, and the launch too unless it crashed
            if not crashed:
                shutil.rmtree(work, ignore_errors=True)
            shutil.rmtree(checkpoint, ignore_errors=True)
            checkpoint = None
    if not result["crashes"]:
        shutil.rmtree(scratch, ignore_errors=True)
    result["summary"] = {"launches": len(result["launches"]), "crashes": len(result["crashes"]),
                         "exit_codes": sorted({str(c["returncode"]) for c in result["crashes"]})}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{len(result['crashes'])} crash(es) in {len(result['launches'])} launches; results: {args.out}")
    return 0 if not result["crashes"] else 1


if __name__ == "__main__":
    sys.exit(main())
