"""Drive ``kvelastic.fuzz`` frames into a running daemon, fast, and watch it.

Why a window and not a blocking request per frame: a million frames one round
trip at a time would take the time of a million round trips. Each DEALER
keeps at most ``window`` frames unanswered (the daemon answers nearly every
bad frame with an ``Error``), so the daemon is always busy, yet its ROUTER
never holds more replies for one peer than its send queue takes (it would
drop them, and the counts would lie). At every checkpoint a ``Status`` from a
fresh DEALER must be answered within ``PROBE_TIMEOUT`` (else: a hang), and a
``Status`` on each fuzzing DEALER (answered in order, after every frame sent
before it) settles the books.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import zmq

from kvelastic import protocol as p
from kvelastic.bench.daemon import cpu_seconds, rss_bytes
from kvelastic.fuzz import Fuzzer

PROBE_TIMEOUT = 2.0
SYNC_TIMEOUT = 10.0
SENTINEL = 0x5EED_0F_F022    # the req_id of the settling Status (no generated frame uses it)


class _Reply(msgspec.Struct):
    """All the counts need of a reply (decoding a whole StatusReply is slow)."""

    type: str = ""
    req_id: int = 0
    reason: str = ""


_reply = msgspec.msgpack.Decoder(_Reply)


def dealer(socket_path: str) -> zmq.Socket[bytes]:
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 0)          # replies are never dropped on our side
    sock.setsockopt(zmq.SNDTIMEO, int(SYNC_TIMEOUT * 1000))
    sock.connect(f"ipc://{socket_path}")
    return sock


def probe(socket_path: str, timeout: float = PROBE_TIMEOUT) -> float:
    """Seconds a ``Status`` on a fresh DEALER took to be answered (``inf``: not in ``timeout``)."""
    sock = dealer(socket_path)
    try:
        start = time.monotonic()
        sock.send(p.encode(p.Status(req_id=1)))
        if not sock.poll(int(timeout * 1000)):
            return math.inf
        sock.recv()
        return time.monotonic() - start
    finally:
        sock.close(0)


@dataclasses.dataclass
class FloodResult:
    frames: int = 0
    by_kind: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    replies: collections.Counter = dataclasses.field(default_factory=collections.Counter)   # by type
    errors: collections.Counter = dataclasses.field(default_factory=collections.Counter)    # by reason
    probes: list[float] = dataclasses.field(default_factory=list)
    hangs: list[str] = dataclasses.field(default_factory=list)
    crashed_after: int | None = None     # frames sent when the daemon was found dead
    rss: list[int] = dataclasses.field(default_factory=list)             # the daemon's, at each checkpoint
    # After a crash or hang: the frames sent last (number, kind, first bytes in hex), the culprit among them.
    suspects: list[tuple[int, str, str]] = dataclasses.field(default_factory=list)
    seconds: float = 0.0
    daemon_cpu: float = 0.0              # seconds of the daemon's CPU time the flood took (with ``pid``)

    @property
    def per_second(self) -> float:
        return self.frames / self.seconds if self.seconds else 0.0


class Flood:
    """Frames from ``source`` on ``sockets`` DEALERs, round robin."""

    def __init__(self, socket_path: str, sockets: int = 4, window: int = 256,
                 alive: Callable[[], bool] = lambda: True, pid: int | None = None) -> None:
        self.socket_path, self.window, self.alive, self.pid = socket_path, window, alive, pid
        self.socks = [dealer(socket_path) for _ in range(sockets)]
        self.inflight = [0] * sockets
        self.result = FloodResult()
        self.recent: collections.deque = collections.deque(maxlen=sockets * window + 1)

    def run(self, source: Iterator[tuple[str, list[bytes]]], count: int, checkpoint_every: int) -> FloodResult:
        r = self.result
        start, cpu = time.perf_counter(), cpu_seconds(self.pid) if self.pid else 0.0
        try:
            for n in range(count):
                if n and n % checkpoint_every == 0 and not self.checkpoint(n):
                    break
                kind, parts = next(source)
                i = n % len(self.socks)
                if self.inflight[i] >= self.window and not self._drain(i, PROBE_TIMEOUT):
                    self._stalled(n, f"no reply within {PROBE_TIMEOUT} s to {self.window} frames in flight")
                    break
                try:
                    self.socks[i].send_multipart(parts, copy=len(parts[0]) > 65536)
                except zmq.Again:
                    self._stalled(n, f"could not send within {SYNC_TIMEOUT} s")
                    break
                self.inflight[i] += 1
                self.recent.append((n, kind, parts))
                r.by_kind[kind] += 1
                r.frames += 1
                if n % 64 == 63:
                    self._drain(i, 0)
            else:
                self.checkpoint(count)
        finally:
            r.seconds = time.perf_counter() - start
            if self.pid and self.alive():
                r.daemon_cpu = cpu_seconds(self.pid) - cpu
            for sock in self.socks:
                sock.close(0)
            if r.crashed_after is not None or r.hangs:
                r.suspects = [(n, kind, b"|".join(parts)[:256].hex()) for n, kind, parts in self.recent]
        return r

    def _stalled(self, n: int, what: str) -> None:
        """The daemon stopped answering: dead (a crash) or alive (a hang)."""
        if self.alive():
            self.result.hangs.append(f"frame {n}: {what}")
        else:
            self.result.crashed_after = n

    def checkpoint(self, n: int) -> bool:
        """Is the daemon alive and answering? Then settle every DEALER's books."""
        r = self.result
        if not self.alive():
            r.crashed_after = n
            return False
        latency = probe(self.socket_path)
        r.probes.append(latency)
        if latency > PROBE_TIMEOUT:
            r.hangs.append(f"frame {n}: Status not answered within {PROBE_TIMEOUT} s")
        for sock in self.socks:
            sock.send(p.encode(p.Status(req_id=SENTINEL)))
        for i in range(len(self.socks)):
            if not self._drain(i, SYNC_TIMEOUT, until_sentinel=True):
                r.hangs.append(f"frame {n}: DEALER {i} not settled within {SYNC_TIMEOUT} s")
            self.inflight[i] = 0
        if self.pid is not None and self.alive():
            r.rss.append(rss_bytes(self.pid))
        if not self.alive():
            r.crashed_after = n
        return r.crashed_after is None

    def _drain(self, i: int, wait: float, until_sentinel: bool = False) -> bool:
        """Count the replies waiting on DEALER ``i``; wait up to ``wait`` for
        one (or for the settling Status). False: none came in time."""
        sock, r = self.socks[i], self.result
        deadline = time.monotonic() + wait
        got = False
        while True:
            try:
                reply = _reply.decode(sock.recv(zmq.NOBLOCK))
            except zmq.Again:
                if got and not until_sentinel:
                    return True
                if not sock.poll(max(0, int((deadline - time.monotonic()) * 1000))):
                    return not until_sentinel and (got or wait == 0)
                continue
            if reply.req_id == SENTINEL and reply.type == "StatusReply":
                if until_sentinel:
                    return True
                continue
            got = True
            self.inflight[i] = max(0, self.inflight[i] - 1)
            r.replies[reply.type] += 1
            if reply.type == "Error":
                r.errors[reply.reason] += 1


def frames(fuzzer: Fuzzer) -> Iterator[tuple[str, list[bytes]]]:
    while True:
        yield fuzzer.frame()


def status_frames() -> Iterator[tuple[str, list[bytes]]]:
    """The baseline: valid ``Status`` requests."""
    n = 0
    while True:
        n += 1
        yield "status", [p.encode(p.Status(req_id=n))]


def channel_fuzz(socket_path: str, fuzzer: Fuzzer, count: int, concurrency: int = 16) -> dict[str, int]:
    """``count`` page-channel connections, ``concurrency`` open at a time: each
    sends its plan's first bytes, the rest a moment later, and closes abruptly."""
    path = p.fd_socket_path(socket_path)
    by_kind: collections.Counter = collections.Counter()
    failed = 0
    open_: list[tuple[socket.socket, bytes]] = []

    def finish() -> None:
        for sock, then in open_:
            try:
                if then:
                    sock.sendall(then)
            except OSError:
                pass
            sock.close()
        open_.clear()

    for _ in range(count):
        kind, plan = fuzzer.channel()
        by_kind[kind] += 1
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(5.0)
        try:
            sock.connect(path)
            if plan.first:
                sock.sendall(plan.first)
        except OSError:               # the daemon closed it first (a bad hello), or it is busy
            failed += 1
        open_.append((sock, plan.then))
        if len(open_) >= concurrency:
            finish()
    finish()
    return {**dict(sorted(by_kind.items())), "send_failed": failed}


def in_background(fn: Callable[..., Any], *args: Any) -> Callable[[], Any]:
    """Run ``fn(*args)`` on a thread (page channels fuzzed while the control
    socket floods); the function returned joins it and gives its result."""
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(fn(*args)), daemon=True)
    thread.start()

    def join() -> Any:
        thread.join()
        if not out:
            raise RuntimeError(f"{fn.__name__} failed (its traceback is above)")
        return out[0]

    return join


def stalled_hellos(socket_path: str, fuzzer: Fuzzer, count: int = 16) -> int:
    """``count`` connections that send part of a hello and wait: how many the
    daemon closed within its hello deadline (plus a second)."""
    sockets = []
    for _ in range(count):
        _, plan = fuzzer.channel("partial")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(p.fd_socket_path(socket_path))
        sock.sendall(plan.first)
        sockets.append(sock)
    deadline = time.monotonic() + p.HELLO_TIMEOUT + 1.0
    closed = 0
    for sock in sockets:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            closed += sock.recv(1) == b""
        except ConnectionResetError:
            closed += 1
        except TimeoutError:
            pass
        sock.close()
    return closed


def beyond_maxmsgsize(socket_path: str, count: int = 2) -> None:
    """Frames over the ROUTER's 16 MiB limit: libzmq drops the connection (no reply)."""
    sock = dealer(socket_path)
    try:
        for _ in range(count):
            sock.send(b"\x00" * (16 * p.MAX_MESSAGE_BYTES + 1))
        time.sleep(0.2)
    finally:
        sock.close(0)
