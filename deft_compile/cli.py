"""The ``deft-compile`` command line."""

from __future__ import annotations

import argparse
import sys


def _add_demo(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("demo", help="train a small model with torch DDP and deft_compile on 2 local workers")
    parser.add_argument("--steps", type=int, default=60, help="training steps per run (default 60)")
    parser.add_argument("--batch", type=int, default=64, help="batch size per worker (default 64)")

    def run(args: argparse.Namespace) -> int:
        from deft_compile.demo import run_demo

        return run_demo(steps=args.steps, batch=args.batch)

    parser.set_defaults(func=run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deft-compile", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_demo(subparsers)
    try:
        from deft_compile import cli_simulate
    except ImportError:
        cli_simulate = None
    if cli_simulate is not None:
        cli_simulate.add_parser(subparsers)
    from deft_compile import cli_explain

    cli_explain.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
