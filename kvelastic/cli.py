"""The ``kvelastic`` command: ``daemon``, ``bench``, and (later) status/top/limit."""

from __future__ import annotations

import argparse
import json
import sys

from kvelastic import __version__, bench
from kvelastic.errors import ConfigError


def _cmd_bench(args: argparse.Namespace) -> int:
    try:
        result = bench.run(args.name, quick=args.quick)
    except KeyError:
        print(f"kvelastic bench: unknown benchmark {args.name!r}; "
              f"choose one of: {', '.join(sorted(bench.BENCHMARKS))}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result, sort_keys=True))
    else:
        for key, value in sorted(result.items()):
            print(f"{key:40s} {value}")
    return 0


def _cmd_daemon(args: argparse.Namespace) -> int:
    try:
        from kvelastic.daemon.main import main as daemon_main
    except ImportError:
        print("kvelastic daemon: the daemon is not built yet in this version", file=sys.stderr)
        return 1
    return daemon_main()


def _cmd_config(args: argparse.Namespace) -> int:
    from kvelastic.config import Config, markdown_table

    if args.markdown:
        print(markdown_table())
        return 0
    try:
        config = Config.from_env()
    except ConfigError as exc:
        print(f"kvelastic: configuration error: {exc}", file=sys.stderr)
        return 2
    for key, value in vars(config).items():
        print(f"{key:24s} {value}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvelastic",
        description="Elastic virtual-memory KV-cache allocator for LLM serving.",
    )
    parser.add_argument("--version", action="version", version=f"kvelastic {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("daemon", help="run the per-node daemon in the foreground")
    p.set_defaults(func=_cmd_daemon)

    p = sub.add_parser("config", help="print the configuration read from KVELASTIC_* variables")
    p.add_argument("--markdown", action="store_true", help="print the variables as a Markdown table")
    p.set_defaults(func=_cmd_config)

    p = sub.add_parser("bench", help="run a benchmark against its baseline")
    p.add_argument("name", help=f"one of: {', '.join(sorted(bench.BENCHMARKS))}")
    p.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    p.add_argument("--quick", action="store_true", help="a shorter run (used by the test suite)")
    p.set_defaults(func=_cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return args.func(args)
