"""The ``deft-compile`` command line."""

from __future__ import annotations

import argparse
import sys


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
    from deft_compile.tools import explain as cli_explain

    cli_explain.add_parser(subparsers)
    bench.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "bench" and getattr(args, "time_to_accuracy", False):  # a benchmark of its own
        from deft_compile.tools.time_to_accuracy import run_cli

        return int(run_cli(args) or 0)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
