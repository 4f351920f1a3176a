"""The ``kvelastic`` command: ``daemon``, ``config``, ``bench``, ``router``, and the operator
commands ``status``, ``top``, ``limit`` and ``invalidate`` (logic in ``kvelastic.ctl``)."""

from __future__ import annotations

import argparse
import json
import sys

from kvelastic import __version__, benchmarks
from kvelastic.errors import ConfigError


def _cmd_bench(args: argparse.Namespace) -> int:
    if args.scale is not None and args.name != "sim":
        print(f"kvelastic bench: --scale applies to the sim benchmark only, not {args.name!r}", file=sys.stderr)
        return 2
    options = {"scale": args.scale} if args.scale is not None else {}
    try:
        result = benchmarks.run(args.name, quick=args.quick, **options)
    except benchmarks.UnknownBenchmark:
        known = sorted(benchmarks.available())
        print(f"kvelastic bench: unknown benchmark {args.name!r}; "
              + (f"choose one of: {', '.join(known)}" if known else
                 "none is installed (they come with the tools package, tools/: `make setup` installs it)"),
              file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result, sort_keys=True))
    else:
        for key, value in sorted(result.items()):
            print(f"{key:40s} {value}")
    return 0


def _cmd_daemon(args: argparse.Namespace) -> int:
    from kvelastic.daemon.main import main as daemon_main

    return daemon_main()


def _cmd_keeper(args: argparse.Namespace) -> int:
    from kvelastic.keeper.main import main as keeper_main

    return keeper_main(linger=args.linger, with_daemon=args.with_daemon)


def _cmd_router(args: argparse.Namespace) -> int:
    import logging

    from kvelastic.errors import IndexerError
    from kvelastic.router.policy import Policy
    from kvelastic.router.proxy import serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        server = serve(args.listen, args.engine, args.indexer, args.model, args.block_size, Policy(args.policy),
                       args.tier or [], args.tier_weight)
    except IndexerError as exc:
        print(f"kvelastic router: cannot register the engines with the indexer at {args.indexer}: {exc}",
              file=sys.stderr)
        return 1
    except ValueError as exc:    # tiers that name no engine of the router, or an engine's id
        print(f"kvelastic router: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"kvelastic router: cannot listen on {args.listen}: {exc}", file=sys.stderr)
        return 1
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


def _tier(text: str):  # -> NodeTier
    from kvelastic.router.tiers import parse_tier

    try:
        return parse_tier(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _tier_weight(text: str) -> float:
    try:
        weight = float(text)
    except ValueError:
        weight = -1.0
    if not 0.0 <= weight < 1.0:
        raise argparse.ArgumentTypeError(f"expected a number at least 0 and below 1, got {text!r}")
    return weight


def _engine(text: str):  # -> Engine
    from kvelastic.router.proxy import parse_engine

    try:
        return parse_engine(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _listen(text: str) -> str:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return text


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


def _size(text: str) -> int:
    from kvelastic.config import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _max_size(text: str) -> int:
    """Like ``_size``; ``0``, ``none`` or ``unlimited`` mean no cap (sent as 0)."""
    from kvelastic.config import parse_optional_size

    try:
        return parse_optional_size(text) or 0
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def _ops(args: argparse.Namespace) -> int:
    from kvelastic import ctl

    return ctl.run_command(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvelastic",
        description="Elastic virtual-memory KV-cache allocator for LLM serving.",
    )
    parser.add_argument("--version", action="version", version=f"kvelastic {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("daemon", help="run the per-node daemon in the foreground")
    p.set_defaults(func=_cmd_daemon)

    p = sub.add_parser("keeper", help="hold the daemon's page descriptors so its pages outlive it (a warm restart)")
    p.add_argument("--linger", type=float, default=None, metavar="SECONDS",
                   help="exit, letting go of the pages, this long after the last daemon left "
                        "(how the daemon starts one; default: stay until stopped)")
    p.add_argument("--with-daemon", action="store_true",
                   help="run the daemon as a child, started again whenever it dies, its pages kept "
                        "(a container's main process: the image's entrypoint)")
    p.set_defaults(func=_cmd_keeper)

    p = sub.add_parser("config", help="print the configuration read from KVELASTIC_* variables")
    p.add_argument("--markdown", action="store_true", help="print the variables as a Markdown table")
    p.set_defaults(func=_cmd_config)

    p = sub.add_parser("bench", help="run a benchmark against its baseline")
    p.add_argument("name", help=f"one of: {', '.join(sorted(benchmarks.available())) or 'none installed'}")
    p.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    p.add_argument("--quick", action="store_true", help="a shorter run (used by the test suite)")
    p.add_argument("--scale", choices=("seeds", "node"), default=None,
                   help="sim only: 'seeds' (default) many small seeded runs with faults; 'node' one "
                        "trace-driven day of 8 engines on an 80 GiB device")
    p.set_defaults(func=_cmd_bench)

    p = sub.add_parser("router", help="a KV-aware router in front of vLLM engines (asks Dynamo's KV indexer)")
    p.add_argument("--listen", type=_listen, default="127.0.0.1:8000", metavar="HOST:PORT",
                   help="where to serve OpenAI requests (default 127.0.0.1:8000)")
    p.add_argument("--indexer", default="http://127.0.0.1:8090", metavar="URL",
                   help="Dynamo's KV indexer (default http://127.0.0.1:8090)")
    p.add_argument("--model", required=True, help="the served model name the engines publish events for")
    p.add_argument("--block-size", type=_positive_int, required=True, metavar="N",
                   help="the engines' --block-size (tokens per block)")
    p.add_argument("--engine", type=_engine, action="append", required=True,
                   metavar="ID=URL[,EVENTS[,REPLAY]]",
                   help="an engine: a positive integer id, its http://HOST:PORT, and its vLLM KV event "
                        "endpoints (registered with the indexer at start); repeat for each engine")
    p.add_argument("--policy", choices=("kv", "round-robin"), default="kv",
                   help="kv (default): the longest cached prefix, ties by load; round-robin: a baseline")
    p.add_argument("--tier", type=_tier, action="append", metavar="ID=ENGINE[+ENGINE...],EVENTS[,REPLAY]",
                   help="a node's tier stream (its daemon's ipc://SOCKET.kv-tier), registered with the indexer "
                        "as worker ID; what it matches counts for the engines listed (those of its node); "
                        "repeat for each node with a tier")
    from kvelastic.router.policy import TIER_WEIGHT  # no I/O, no dependencies: cheap at parse time

    p.add_argument("--tier-weight", type=_tier_weight, default=TIER_WEIGHT, metavar="W",
                   help="what a token in a node's tier is worth beside one in an engine's device memory "
                        "(1), to be loaded instead of computed (0); default %(default)s")
    p.set_defaults(func=_cmd_router)

    socket_opt = argparse.ArgumentParser(add_help=False)
    socket_opt.add_argument("--socket", metavar="PATH", help="daemon socket (default: KVELASTIC_SOCKET)")

    p = sub.add_parser("status", parents=[socket_opt], help="engines, memory and cache of the running daemon")
    p.add_argument("--json", action="store_true", help="print the daemon's status as JSON")
    p.set_defaults(func=_ops)

    p = sub.add_parser("top", parents=[socket_opt], help="a live view of the daemon's status")
    p.add_argument("--interval", type=_positive_float, default=1.0, metavar="S",
                   help="seconds between refreshes (default 1)")
    p.add_argument("--iterations", type=_positive_int, default=None, metavar="N",
                   help="exit after N refreshes (default: until Ctrl-C)")
    p.set_defaults(func=_ops)

    p = sub.add_parser("limit", parents=[socket_opt], help="set an engine's guaranteed and maximum memory")
    p.add_argument("engine", metavar="ENGINE", help="engine id")
    p.add_argument("min", metavar="MIN", type=_size, help="guaranteed memory, e.g. 1GiB or bytes")
    p.add_argument("max", metavar="MAX", type=_max_size, help="maximum memory, e.g. 8GiB; 0 means no cap")
    p.set_defaults(func=_ops)

    p = sub.add_parser("invalidate", parents=[socket_opt],
                       help="drop the prefix cache of a namespace or an engine")
    p.add_argument("target", metavar="TARGET", help="a namespace or an engine id")
    p.set_defaults(func=_ops)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return args.func(args)
