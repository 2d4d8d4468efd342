"""The time to DDP's final validation loss, DDP vs deft, on a shaped link (docs/TIME_TO_ACCURACY.md).

    sudo python benchmarks/time_to_accuracy.py                        # GPT-2, calibrated to coverage rate ~1, seeds 0 1
    sudo python benchmarks/time_to_accuracy.py --workload gpt2 cnn --coverage 1 2 3 --steps 2000
    sudo python benchmarks/time_to_accuracy.py --size small --buckets scaled --coverage 2   # ~20 buckets
    benchmarks/run_tta_campaign.sh                                    # the documented campaign
    python benchmarks/time_to_accuracy.py --bandwidth none --size tiny --steps 40 --docs '' --out /tmp/tta

Workloads: a GPT-2 (``transformers`` config, random weights, bytes) trained with AdamW on this Python's
standard-library sources, and a BatchNorm ResNet trained with SGD momentum on teacher-labelled images
(``tta_cnn.py``); 2 gloo workers; the variants (``--variants``) from the same initial weights on the same batches,
interleaved in chunks in one process pair. One launch per workload, coverage rate and seed. Writes
``<out>/tta_<workload>_<size>[_scaled][_noise<p>]_cr<rate>.json`` (``tta.run_stem``) and its ``..._time.png`` /
``..._steps.png`` per workload and coverage rate, prints the tables and rewrites the results section of ``--docs`` between ``<!-- tta:begin -->`` and
``<!-- tta:end -->`` (an overview, then one section per workload and rate). Everything is in
``benchmarks/tta.py``; ``deft-compile bench --time-to-accuracy`` runs the same code from a checkout.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def write_docs(docs: Path, records: list[dict]) -> None:
    """The results section of ``docs``: the overview of every set, then one section per workload and rate."""
    from tta import OVERVIEW_NOTE, measured_lines, overview_table, results_section, write_docs_section

    sections = [*measured_lines(records), overview_table(records), "", OVERVIEW_NOTE, ""]
    for record in records:
        measured, target = record.get("coverage_rate"), record.get("coverage_target")
        sections += [f"### {record['config']['workload']} {record['config']['size']}, DDP's coverage rate "
                     + (f"{measured:.2f}" if measured is not None else "not measured")
                     + (f" (calibrated to {target:g})" if target else ""),
                     "", results_section(record, docs.parent), ""]
    write_docs_section(docs, "\n".join(sections))
    print(f"docs: {docs}")


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(ROOT))
    from deft_compile.compilers import COMPILERS
    from deft_compile.tools.bench import parse_rate
    from tta import DEFAULT_VARIANTS, VARIANTS, WORKLOADS, TTAConfig, run_benchmark, run_stem

    defaults = TTAConfig()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--eval-every", type=int, default=defaults.eval_every)
    parser.add_argument("--chunk", type=int, default=defaults.chunk,
                        help="steps a variant trains before the next one runs (round-robin, rotating order)")
    parser.add_argument("--bandwidth", default=None,
                        help="tc rate (e.g. 300mbit) or 'none' for the unshaped loopback; default: calibrate the "
                             "rate so that DDP's coverage rate is --coverage (root and iproute2)")
    parser.add_argument("--coverage", type=float, nargs="+", default=[1.0],
                        help="DDP's coverage rates to calibrate the link to, one set of launches each")
    parser.add_argument("--workload", nargs="+", choices=list(WORKLOADS), default=[defaults.workload])
    parser.add_argument("--size", default=defaults.size, help="a size of every workload (tiny, small, medium)")
    parser.add_argument("--batch", type=int, default=defaults.batch,
                        help="windows (gpt2) or images (cnn) per worker and step")
    parser.add_argument("--lr", type=float, default=None, help="default: the workload's (AdamW 1e-3, SGD 0.05)")
    parser.add_argument("--val-windows", type=int, default=defaults.val_windows)
    parser.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--bucket-cap-mb", type=float, default=None,
                        help="bucket cap for DDP and every deft variant (default: DDP's 25 MiB)")
    parser.add_argument("--buckets", choices=("ddp", "scaled"), default=defaults.buckets,
                        help="scaled: DDP's cap scaled by the model's gradient bytes over GPT-2 124M's (about 20 "
                             "buckets, as DDP's defaults give GPT-2 124M)")
    parser.add_argument("--label-noise", type=float, default=defaults.label_noise,
                        help="cnn: share of labels replaced by a random class (training and validation)")
    parser.add_argument("--powersgd-rank", type=int, default=defaults.powersgd_rank,
                        help="ddp-powersgd's matrix approximation rank")
    parser.add_argument("--compiler", choices=COMPILERS, default=defaults.compiler,
                        help="the deft variants' DeftConfig.compiler (default: the library's); compiles count in the "
                             "training clock and are reported apart")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--emulate-accelerator", action="store_true",
                        help="compute thread on core 0, gloo's threads on core 1 (DESIGN.md section 5)")
    parser.add_argument("--out", default=str(ROOT / "docs" / "img"), help="folder of the PNGs (and default JSON)")
    parser.add_argument("--json", default=None, help="results file (default <out>/<tta.run_stem>.json)")
    parser.add_argument("--docs", default=str(ROOT / "docs" / "TIME_TO_ACCURACY.md"),
                        help="markdown file whose tta section is rewritten ('' to skip)")
    parser.add_argument("--timeout", type=float, default=6 * 3600.0, help="seconds per launch (one seed)")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--render", nargs="+", default=None, metavar="JSON",
                        help="run nothing: rewrite the --docs section from these results files (one per workload "
                             "and coverage rate, as this script writes them; .json or .json.gz)")
    args = parser.parse_args(argv)
    if args.render:
        import json

        if not args.docs:
            parser.error("--render needs --docs")
        import gzip

        from tta import summarise

        records = [json.loads(gzip.decompress(Path(path).read_bytes()) if path.endswith(".gz") else Path(path).read_text())
                   for path in args.render]
        for record, path in zip(records, args.render):  # the docs' provenance lines name the file read
            record["results_file"] = path
        for record in records:  # the summary as this code computes it, from the saved runs
            if record.get("runs"):
                runs = {int(seed): value for seed, value in record["runs"].items()}
                record["summary"] = summarise(runs, coverage=record.get("coverage_target"))
        write_docs(Path(args.docs), records)
        return 0
    if args.emulate_accelerator:
        os.environ["DEFT_EMULATE_ACCELERATOR"] = "1"  # inherited by the spawned workers
    try:
        bandwidth = "calibrate" if args.bandwidth is None else parse_rate(args.bandwidth)
        configs = [TTAConfig(workload=workload, size=args.size, steps=args.steps, eval_every=args.eval_every,
                             chunk=args.chunk, batch=args.batch, lr=args.lr, val_windows=args.val_windows,
                             compiler=args.compiler, bucket_cap_mb=args.bucket_cap_mb, buckets=args.buckets,
                             label_noise=args.label_noise if workload == "cnn" else 0.0,
                             powersgd_rank=args.powersgd_rank, variants=tuple(args.variants),
                             progress=not args.no_progress)
                   for workload in args.workload]
    except ValueError as error:
        parser.error(str(error))
    if args.json and len(configs) * len(args.coverage) > 1:
        parser.error("--json names one results file: give one --workload and one --coverage, or leave it out")
    out = Path(args.out)
    # quoted as a shell reads it: the recorded command re-runs as written (``--docs ''`` keeps its empty argument)
    from deft_compile.tools.provenance import script_command
    command = script_command(__file__, argv)
    records = []
    try:
        for cfg in configs:
            for coverage in args.coverage:
                stem = run_stem(cfg, coverage)
                records.append(run_benchmark(
                    cfg, args.seeds, bandwidth=bandwidth, coverage=coverage, workers=args.workers,
                    timeout_s=args.timeout, json_path=args.json or out / f"{stem}.json", plot_dir=out,
                    plot_stem=stem, command=command))
        if args.docs:
            write_docs(Path(args.docs), records)
    except RuntimeError as error:
        print(f"time_to_accuracy: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
