"""Operator commands: one-shot requests to the daemon and their rendering.

``kvelastic status|top|limit|invalidate`` (see ``kvelastic.cli``) talk to the
daemon over its ZMQ socket: a fresh DEALER per request, one frame out, one
frame back. A ZMQ connect to a missing ``ipc://`` path does not fail, so the
socket file is checked first with a plain AF_UNIX connect (a stale file left
by a killed daemon refuses it at once), and every request has a timeout. That
connection also says who listens (``trust.check_daemon``): no request goes to
a process that is not a daemon this user may trust (``UntrustedDaemon``).
"""

from __future__ import annotations

import argparse
import errno
import itertools
import json
import os
import signal
import socket
import sys
import threading
import time
from typing import TextIO

import msgspec
import zmq

from kvelastic import protocol as p
from kvelastic.client.connection import DaemonError, DaemonUnavailable, expect
from kvelastic.client.trust import UntrustedDaemon, check_daemon
from kvelastic.config import Config
from kvelastic.errors import ConfigError

DEFAULT_TIMEOUT = 3.0
_HINT = "start it with 'make run' or 'kvelastic daemon'; KVELASTIC_SOCKET selects the socket"
_req_ids = itertools.count(1)


# ------------------------------------------------------------------ requests
def _unavailable(socket_path: str, what: str = "no daemon is running on") -> DaemonUnavailable:
    return DaemonUnavailable(f"{what} {socket_path} ({_HINT})")


def _probe(socket_path: str) -> None:
    """Fail fast when nobody listens (no socket file, or a stale one), and
    refuse a listener that is not a daemon to trust (``UntrustedDaemon``)."""
    if not os.path.exists(socket_path):
        raise _unavailable(socket_path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(1.0)
    try:
        try:
            sock.connect(socket_path)
        except (ConnectionRefusedError, FileNotFoundError):
            raise _unavailable(socket_path) from None
        except PermissionError:
            raise DaemonUnavailable(f"permission denied on the daemon socket {socket_path} "
                                    "(run as the daemon's user or a member of its group)") from None
        except OSError as exc:
            if exc.errno in (errno.ENOTSOCK, errno.ECONNREFUSED):
                raise _unavailable(socket_path) from None
            # A slow accept queue...: without a connection, nobody can say who listens.
            raise DaemonUnavailable(f"the daemon on {socket_path} did not take a connection ({exc}); "
                                    "try again") from None
        try:
            check_daemon(sock, socket_path)
        except OSError as exc:              # its folder went away under us
            raise _unavailable(socket_path, f"cannot check the daemon's folder ({exc}) on") from None
    finally:
        sock.close()


def request(socket_path: str, msg: p.Msg, timeout: float = DEFAULT_TIMEOUT) -> p.Msg:
    """Send one request and return the daemon's reply.

    Raises ``DaemonUnavailable`` when no daemon answers within ``timeout``
    seconds, ``DaemonError`` (with ``.reason`` and ``.message``) when it answers
    with an ``Error``, ``UntrustedDaemon`` (nothing sent) when the process on
    the socket is not a daemon to trust.
    """
    _probe(socket_path)
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"ipc://{socket_path}")
        msg.req_id = (os.getpid() << 20) + next(_req_ids)
        sock.send(p.encode(msg))
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sock.poll(max(1, int(left * 1000))):
                raise _unavailable(socket_path, f"no daemon answered within {timeout:g} s on")
            try:
                reply = p.decode(sock.recv())
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                raise DaemonError("malformed", f"undecodable reply from the daemon: {exc}") from None
            if reply.req_id == msg.req_id:
                break
    finally:
        sock.close(0)
    if isinstance(reply, p.Error):
        raise DaemonError(reply.reason, reply.message)
    return reply


def get_status(socket_path: str, timeout: float = DEFAULT_TIMEOUT) -> dict:
    """The daemon's ``StatusReport`` as plain data (what ``status --json`` prints)."""
    return msgspec.to_builtins(expect(request(socket_path, p.Status(), timeout), p.StatusReply).status)


def set_limit(socket_path: str, engine_id: str, min_bytes: int, max_bytes: int,
              timeout: float = DEFAULT_TIMEOUT) -> None:
    expect(request(socket_path, p.SetLimit(engine_id=engine_id, min_bytes=min_bytes,
                                            max_bytes=max_bytes), timeout), p.Ok)


def invalidate(socket_path: str, target: str, timeout: float = DEFAULT_TIMEOUT) -> p.Invalidated:
    """Drop the prefix cache of a namespace or an engine: running engines'
    and the kept cache of departed ones."""
    return expect(request(socket_path, p.Invalidate(target=target), timeout), p.Invalidated)


# ----------------------------------------------------------------- rendering
def fmt_bytes(n: int | float) -> str:
    """``0 B``, ``512 KiB``, ``64.0 MiB``, ``1.50 GiB``."""
    n = float(n)
    if abs(n) < 1024:
        return f"{int(n)} B"
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            value = n / scale
            return f"{value:.2f} {unit}" if unit in ("GiB", "TiB") else f"{value:.1f} {unit}"
    return f"{int(n)} B"  # pragma: no cover


def _hit_rate(stats: dict) -> str:
    """Queried tokens served from the prefix cache, as vLLM counts them."""
    queries = stats.get("query_tokens", 0)
    if not queries:
        return "-"
    return f"{100.0 * stats.get('hit_tokens', 0) / queries:.1f}%"


def _bar(fraction: float, width: int = 30) -> str:
    fraction = min(max(fraction, 0.0), 1.0)
    filled = round(fraction * width)
    return "[" + "#" * filled + "." * (width - filled) + "]"


_COLUMNS = ("ENGINE", "NAMESPACE", "PID", "WORKERS", "SLABS", "HELD", "CACHED", "MIN", "MAX",
            "HIT", "ADOPTED", "GRANTS", "RETURNS", "RECLAIMS")
_RIGHT = {"PID", "WORKERS", "SLABS", "HELD", "CACHED", "MIN", "MAX", "HIT", "ADOPTED", "GRANTS", "RETURNS",
          "RECLAIMS", "BLOCKS", "BYTES", "AGE"}


def _adopted(stats: dict) -> str:
    """Blocks adopted from replicas of the namespace, and how many of them hit."""
    n = stats.get("adopted_blocks", 0)
    return f"{n} ({stats.get('adopted_hits', 0)} hit)" if n else "-"


def _engine_row(e: dict) -> tuple[str, ...]:
    return (str(e["engine_id"]), str(e["namespace"]), str(e.get("pid", "")), str(e.get("workers", 0)),
            str(e["slabs"]), fmt_bytes(e["held_bytes"]), fmt_bytes(e["cached_bytes"]),
            fmt_bytes(e["min_bytes"]), fmt_bytes(e["max_bytes"]) if e["max_bytes"] else "none",
            _hit_rate(e.get("stats", {})), _adopted(e.get("stats", {})), str(e.get("grants", 0)),
            str(e.get("returns", 0)),
            str(e.get("reclaims", 0)))


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    lines = []
    for row in (header, *rows):
        cells = [cell.rjust(w) if name in _RIGHT else cell.ljust(w)
                 for cell, w, name in zip(row, widths, header)]
        lines.append("  ".join(cells).rstrip())
    return lines


def render_status(status: dict) -> str:
    """The daemon's status dict as a human-readable report."""
    budget = status.get("budget_bytes", 0)
    mem = status.get("memory", {})
    pages = status.get("pages", {})
    held = mem.get("held", 0)
    lines = [
        f"device       {status.get('device', '?')} (backend {status.get('backend', '?')}, "
        f"page {fmt_bytes(status.get('page_size', 0))})",
        f"budget       {fmt_bytes(budget)}",
        f"memory       held {fmt_bytes(held)} (cached {fmt_bytes(mem.get('cached', 0))}), "
        f"free {fmt_bytes(mem.get('free', 0))}, orphaned {fmt_bytes(mem.get('orphaned', 0))}, "
        f"unallocated {fmt_bytes(mem.get('unallocated', 0))}",
        f"usage        {_bar(held / budget if budget else 0.0)} {100.0 * held / budget if budget else 0.0:.1f}% held",
        f"pages        created {pages.get('created', 0)}, free {pages.get('free', 0)}, "
        f"adopted {pages.get('adopted', 0)}",
        *_tier_lines(status.get("tier")),
        "",
    ]
    engines = sorted(status.get("engines", []), key=lambda e: e["engine_id"])
    if engines:
        lines += _table(_COLUMNS, [_engine_row(e) for e in engines])
    else:
        lines.append("no engines registered")
    orphans = sorted(status.get("orphans", []), key=lambda o: (o["namespace"], o["device"]))
    if orphans:   # departed engines' cache, waiting for the next engine of its namespace
        lines += ["", *_table(_ORPHAN_COLUMNS, [_orphan_row(o) for o in orphans])]
    return "\n".join(lines)


def _tier_lines(tier: dict | None) -> list[str]:
    """The node's tier, when one is configured (KVELASTIC_TIER_DIR or KVELASTIC_TIER_HOST_SIZE)."""
    if not tier:
        return []
    counters = tier.get("counters", {})
    failed = sum(n for name, n in counters.items() if name.startswith("failures_"))
    levels = tier.get("levels") or []
    media = " (" + ", ".join(f"{lv['medium']} {fmt_bytes(lv['bytes'])} of {fmt_bytes(lv['budget_bytes'])}"
                             for lv in levels) + ")" if len(levels) > 1 else ""
    return [f"tier         {tier.get('medium', 'disk')}: {tier['blocks']} block(s), {fmt_bytes(tier['bytes'])} of "
            f"{fmt_bytes(tier['budget_bytes'])}{media}, "
            f"{len(tier.get('namespaces', {}))} namespace(s); demoted {counters.get('demotions', 0)}, "
            f"promoted {counters.get('promotions', 0)}, lost {failed}"]


_ORPHAN_COLUMNS = ("ORPHANED CACHE", "DEVICE", "SLABS", "BLOCKS", "BYTES", "AGE")


def _orphan_row(o: dict) -> tuple[str, ...]:
    return (str(o["namespace"]), str(o["device"]), str(o["slabs"]), str(o["blocks"]), fmt_bytes(o["bytes"]),
            f"{o['oldest_seconds']:.0f} s")


# ----------------------------------------------------------------------- top
CLEAR = "\x1b[H\x1b[2J"
HIDE_CURSOR, SHOW_CURSOR = "\x1b[?25l", "\x1b[?25h"


def top(socket_path: str, interval: float = 1.0, iterations: int | None = None,
        out: TextIO | None = None, timeout: float = DEFAULT_TIMEOUT) -> int:
    """Redraw the status every ``interval`` seconds until Ctrl-C (exit 0) or
    ``iterations`` refreshes. The first request failing raises
    ``DaemonUnavailable``; later failures are shown and retried."""
    out = out or sys.stdout
    tty = out.isatty()
    count = 0
    # Ctrl-C ends the loop between refreshes: raised inside a ZMQ call, a
    # KeyboardInterrupt could leave a socket open and hang the exit.
    stop = threading.Event()
    previous = (signal.signal(signal.SIGINT, lambda *_: stop.set())
                if threading.current_thread() is threading.main_thread() else None)
    try:
        if tty:
            out.write(HIDE_CURSOR)
        while (iterations is None or count < iterations) and not stop.is_set():
            try:
                body = render_status(get_status(socket_path, timeout))
            except (DaemonUnavailable, DaemonError, UntrustedDaemon) as exc:
                if count == 0:
                    raise
                body = f"kvelastic: {getattr(exc, 'message', exc)}"
            count += 1
            header = (f"kvelastic top  {socket_path}  {time.strftime('%H:%M:%S')}  "
                      f"every {interval:g} s (Ctrl-C quits)")
            out.write((CLEAR if tty else ("\n" if count > 1 else "")) + header + "\n\n" + body + "\n")
            out.flush()
            if iterations is not None and count >= iterations:
                break
            stop.wait(interval)
    except KeyboardInterrupt:   # a Ctrl-C before the handler was in place
        pass
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
        if tty:
            out.write(SHOW_CURSOR)
            out.flush()
    return 0


# ---------------------------------------------------------------- commands
def run_command(args: argparse.Namespace) -> int:
    """``kvelastic status|top|limit|invalidate``: 0 done, 1 no daemon or the
    daemon refused, 2 bad configuration."""
    try:
        path = args.socket or Config.from_env().socket
    except ConfigError as exc:
        print(f"kvelastic: configuration error: {exc}", file=sys.stderr)
        return 2
    try:
        if args.command == "status":
            status = get_status(path)
            print(json.dumps(status, sort_keys=True) if args.json else render_status(status))
        elif args.command == "top":
            return top(path, interval=args.interval, iterations=args.iterations)
        elif args.command == "limit":
            set_limit(path, args.engine, args.min, args.max)
            cap = fmt_bytes(args.max) if args.max else "none"
            print(f"engine {args.engine}: min {fmt_bytes(args.min)}, max {cap}")
        elif args.command == "invalidate":
            done = invalidate(path, args.target)
            print(f"invalidated the prefix cache of {args.target}: {done.engines} running engine(s), "
                  f"{done.kept_blocks} kept block(s) dropped"
                  + (f", {done.tier_blocks} block(s) of the tier dropped" if done.tier_blocks else ""))
        else:  # pragma: no cover - the parser only routes the commands above
            raise ValueError(args.command)
    except DaemonUnavailable as exc:
        print(f"kvelastic: {exc}", file=sys.stderr)
        return 1
    except DaemonError as exc:
        print(f"kvelastic {args.command}: {getattr(exc, 'message', exc)}", file=sys.stderr)
        return 1
    except UntrustedDaemon as exc:
        print(f"kvelastic {args.command}: refused: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:          # e.g. `kvelastic status | head -1`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    return 0
