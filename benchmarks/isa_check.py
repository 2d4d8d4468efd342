"""The first call with Inductor's vector-ISA check started when the step is made, against started by the first
compile.

    python benchmarks/isa_check.py [--model transformer|trainer] [--launches 3] [--steps 3] [--out isa_check_out]

Two gloo ranks on one host run the defaults (``deft_compile`` with ``DeftConfig()``) for ``--steps`` calls on a
warm Inductor cache (one unmeasured launch fills it first); ``--model trainer``: ``DeftTrainer``'s dynamic-padding
fine-tune of ``benchmarks/shapes.py`` for ``--steps`` optimizer steps instead, its ``train()`` timed whole.
``background``: as shipped (``start_isa_check`` when the step is made: ``deft_compile/step/isa_key.py``);
``first-compile``: the check left to the first compile.
The variants alternate launch by launch, each launch in fresh interpreters. Reported per launch (rank 0): the first
call's seconds, the step's construction, ``step.overheads``' compile seconds, and the median of the later calls.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from first_steps import first_steps_worker  # noqa: E402  (benchmarks/first_steps.py)
from shapes import trainer_worker  # noqa: E402  (benchmarks/shapes.py)

VARIANTS = ("background", "first-compile")


def worker(rank: int, world_size: int, model: str, steps: int, variant: str) -> dict[str, Any]:
    from deft_compile.step import lowering

    if variant == "first-compile":
        lowering.start_isa_check = lambda: None  # the first compile checks the ISAs itself
    if model == "trainer":
        with tempfile.TemporaryDirectory(prefix="deft-isa-check-trainer-") as output:
            result = trainer_worker(rank, world_size, "deft-dynamic", steps, output)
        return {"variant": variant, "construct_s": 0.0, "first_call_s": result["train_s"], "later_median_s": None,
                "compile_s": result["overheads"].get("compile_seconds"), "overheads": result["overheads"]}
    result = first_steps_worker(rank, world_size, model, steps)  # the defaults, every call timed
    times = result["times"]
    return {"variant": variant, "construct_s": result["construct_s"], "first_call_s": times[0],
            "later_median_s": statistics.median(times[1:]) if len(times) > 1 else None,
            "compile_s": result["overheads"].get("compile_seconds"), "overheads": result["overheads"]}


def launch(model: str, steps: int, variant: str, cache: str) -> list[dict[str, Any]]:
    from deft_compile.tools.launcher import run_local_workers

    return [r.value for r in run_local_workers(worker, 2, (model, steps, variant), timeout_s=1800,
                                               collective_timeout_s=600, env={"TORCHINDUCTOR_CACHE_DIR": cache},
                                               start_method="spawn")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="transformer",
                        help="a benchmarks/first_steps.py model, or trainer (DeftTrainer: first_call_s is train())")
    parser.add_argument("--launches", type=int, default=3, help="launches of each variant (alternating)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default="isa_check_out")
    args = parser.parse_args(argv)
    from deft_compile.tools import provenance

    runs = []
    with tempfile.TemporaryDirectory(prefix="deft-isa-check-cache-") as cache:
        launch(args.model, args.steps, VARIANTS[0], cache)  # fills the cache; not measured
        for index in range(args.launches):
            order = VARIANTS if index % 2 == 0 else tuple(reversed(VARIANTS))
            for variant in order:
                ranks = launch(args.model, args.steps, variant, cache)
                runs.append({"launch": index, **ranks[0], "rank1": ranks[1]})
                print(f"#{index} {variant}: first call {ranks[0]['first_call_s']:.2f} s, compile "
                      f"{ranks[0]['compile_s']:.2f} s", flush=True)
    summary = {}
    for variant in VARIANTS:
        firsts = [r["first_call_s"] for r in runs if r["variant"] == variant]
        summary[variant] = {"first_call_s_median": statistics.median(firsts), "first_call_s_range": [min(firsts),
                                                                                                   max(firsts)]}
    result = {"provenance": provenance.provenance(provenance.script_command(__file__, argv)), "model": args.model,
              "steps": args.steps, "cache": "warm", "runs": runs, "summary": summary}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "isa_check.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
