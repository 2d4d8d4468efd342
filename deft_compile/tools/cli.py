"""The ``deft-compile`` command line: ``demo``, ``bench``, ``explain``, ``simulate``.

Everything these run for users is in the package (``deft_compile.tools``). One option is not:
``bench --time-to-accuracy`` runs the time-to-accuracy benchmark, whose harness (``benchmarks/tta.py``: a
training loop, a corpus, plots and a docs writer, about 900 lines) is benchmark code, not library code. It runs
from a checkout of the repository (an editable install, or ``python -m deft_compile.tools.cli`` from the
repository's root): the command finds ``benchmarks/`` beside the package and says so where there is none, rather
than carrying the harness in every install for one benchmark.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _add_demo(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo", help="torch DDP and deft_compile side by side on 2 local workers (shaped link when root and tc)")
    parser.add_argument("--steps", type=int, default=40, help="timed steps per run (default 40)")
    parser.add_argument("--batch", type=int, default=None, help="batch size per worker (default 64)")
    parser.add_argument("--bandwidth", default="3gbit",
                        help="tc rate of the namespace's loopback, or 'none' for unshaped (default 3gbit)")
    parser.add_argument("--out", default="deft-demo", help="folder for the timeline PNGs and results.json")
    parser.add_argument("--no-progress", action="store_true")

    def run(args: argparse.Namespace) -> int:
        from deft_compile.tools.bench import parse_rate
        from deft_compile.tools.demo import run_demo

        return run_demo(steps=args.steps, batch=args.batch, bandwidth=parse_rate(args.bandwidth), out=args.out,
                        progress=not args.no_progress)

    parser.set_defaults(func=run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deft-compile", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_demo(subparsers)
    try:
        from deft_compile.tools import simulate as cli_simulate
    except ImportError:
        cli_simulate = None
    if cli_simulate is not None:
        cli_simulate.add_parser(subparsers)
    from deft_compile.tools import bench
    from deft_compile.tools import convert_checkpoint
    from deft_compile.tools import explain as cli_explain

    cli_explain.add_parser(subparsers)
    bench.add_parser(subparsers)
    convert_checkpoint.add_parser(subparsers)
    return parser


def checkout_benchmarks() -> Path | None:
    """The ``benchmarks/`` folder of the checkout this package runs from, on ``sys.path``; None when installed
    without one."""
    folder = Path(__file__).resolve().parents[2] / "benchmarks"
    if not (folder / "tta.py").is_file():
        return None
    if str(folder) not in sys.path:
        sys.path.append(str(folder))
    return folder


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "bench" and getattr(args, "time_to_accuracy", False):  # a benchmark of its own
        if checkout_benchmarks() is None:
            print("deft-compile bench --time-to-accuracy runs from a checkout of the repository (its harness is "
                  "benchmarks/tta.py); there, run python benchmarks/time_to_accuracy.py", file=sys.stderr)
            return 2
        from tta import run_cli

        return int(run_cli(args) or 0)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
