"""The ``zbus`` command line."""

from __future__ import annotations

import argparse
import sys


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(nproc_per_node=args.nproc_per_node, steps=args.steps)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zbus", description=(
        "zbus: collective RPC for multi-node GPU programs over shared memory and ZeroMQ."))
    parser.add_argument("--log-level", default=None, help="DEBUG, INFO, WARNING (default: "
                        "$ZBUS_LOG_LEVEL or WARNING)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = sub.add_parser("demo", help="run a small tensor-parallel model on a local cluster")
    demo.add_argument("--nproc-per-node", type=int, default=2, help="workers (default 2)")
    demo.add_argument("--steps", type=int, default=200, help="decode-like steps (default 200)")
    demo.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    from .logs import setup_logging

    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging("cli", args.log_level)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
