"""Drive ``kvelastic_tools.fuzz`` frames into a running daemon, fast, and watch it.

Why a window and not a blocking request per frame: a million frames one round
trip at a time would take the time of a million round trips. Each DEALER
keeps at most ``window`` frames unanswered (the daemon answers nearly every
bad frame with an ``Error``), so the daemon is always busy, yet its ROUTER
never holds more replies for one peer than its send queue takes (it would
drop them, and the counts would lie). At every checkpoint a ``Status`` from a
fresh DEALER must be answered within ``PROBE_TIMEOUT`` (else: a hang), and a
``Status`` on each fuzzing DEALER (answered in order, after every frame sent
before it) settles the books.

Shared with the sequence mode (``fuzzseq``): ``StatusProbe`` (``Status``
latency from a process of its own, all run long), ``books`` (does every page
the daemon created have a place?), ``page_handles`` (the pages it really
holds) and ``Legit``, the legitimate engine beside the fuzz.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import logging
import math
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import zmq

from kvelastic import protocol as p
from kvelastic.status_report import StatusReport
from kvelastic.vmm.base import DEFAULT_PAGE_SIZE
from kvelastic_tools.bench.daemon import cpu_seconds, rss_bytes
from kvelastic_tools.figures import percentile
from kvelastic_tools.fuzz import Fuzzer
from kvelastic_tools.ports import free_port as free_port  # re-exported: callers name it here

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


# ------------------------------------------------- what the fuzz modes share
def rejected_total(port: int) -> float:
    """Sum of ``kvelastic_rejected_messages_total`` over every reason."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("kvelastic_rejected_messages_total{"))


def tracebacks(log_path: str) -> tuple[int, str]:
    """Tracebacks in a daemon's log: how many, and the first with its context."""
    with open(log_path, errors="replace") as f:
        text = f.read()
    first = text.find("Traceback")
    return text.count("Traceback"), text[max(0, first - 300):first + 2000] if first >= 0 else ""


def status(socket_path: str, timeout: float = PROBE_TIMEOUT) -> StatusReport | None:
    """The daemon's status from a fresh DEALER (None: no answer in time)."""
    sock = dealer(socket_path)
    try:
        sock.send(p.encode(p.Status(req_id=1)))
        if not sock.poll(int(timeout * 1000)):
            return None
        reply = p.decode(sock.recv())
        return reply.status if isinstance(reply, p.StatusReply) else None
    finally:
        sock.close(0)


def books(report: StatusReport) -> dict[str, int]:
    """Does every page have a place? In pages, summed over devices:
    ``unbooked`` counts against the budget (created or adopted) yet is free
    nowhere, held by no engine record (departing and failed ones included)
    and kept as nobody's cache: lost. It is 0 at every ``Status``, whatever
    is going on (the loop answers between inputs, never inside one)."""
    ps = report.page_size
    out = {"created": 0, "free": 0, "adopted": 0, "held": 0, "orphaned": 0, "quarantined": 0, "unbooked": 0}
    for d in report.devices:
        row = {"created": d.pages.created, "free": d.pages.free, "adopted": d.pages.adopted,
               "held": d.memory.held // ps, "orphaned": getattr(d.memory, "orphaned", 0) // ps,
               "quarantined": d.pages.quarantined}
        row["unbooked"] = row["created"] + row["adopted"] - row["free"] - row["held"] - row["orphaned"]
        for k, v in row.items():
            out[k] += v
    return out


def page_handles(pid: int) -> int:
    """Pages the daemon's process really holds (host backend: memfds)."""
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            n += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/memfd:kvelastic-page")
        except OSError:
            pass
    return n


class StatusProbe:
    """``Status`` every ``interval`` seconds from a process of its own (a
    fresh DEALER each time, as the CLI does), so the fuzz's own threads never
    delay the measurement. ``latencies``: seconds each took, ``inf`` for one
    not answered within ``timeout`` (a hang)."""

    def __init__(self, socket_path: str, interval: float = 0.02, timeout: float = PROBE_TIMEOUT) -> None:
        self.timeout = timeout
        self.latencies: list[float] = []
        self.proc = subprocess.Popen([sys.executable, "-m", "kvelastic_tools.bench.fuzzdrive", "probe", socket_path,
                                      str(interval), str(timeout)], stdout=subprocess.PIPE, text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.latencies.append(float(line))

    def unanswered_in_a_row(self) -> int:
        n = 0
        for latency in reversed(self.latencies):
            if latency <= self.timeout:
                break
            n += 1
        return n

    def stop(self) -> dict[str, Any]:
        """Stop it; its figures (milliseconds; ``hangs``: probes not answered in time)."""
        self.proc.terminate()
        self.proc.wait(10)
        self._reader.join(5)
        answered = [x for x in self.latencies if x <= self.timeout]
        return {"probes": len(self.latencies), "hangs": len(self.latencies) - len(answered),
                "status_p50_ms": round(percentile(answered, 0.5) * 1e3, 2),
                "status_p99_ms": round(percentile(answered, 0.99) * 1e3, 2),
                "status_max_ms": round(max(answered, default=0.0) * 1e3, 2)}


def _probe_main(socket_path: str, interval: float, timeout: float) -> None:
    while True:
        latency = probe(socket_path, timeout)
        print("inf" if math.isinf(latency) else f"{latency:.6f}", flush=True)
        time.sleep(interval)


LEGIT_ID = "fuzz-legitimate-engine"        # longer than any generated name: never fuzzed by accident
LEGIT_NAMESPACE = "fuzz-legitimate-namespace"


class Legit:
    """The legitimate engine beside a fuzz: an ``EngineClient`` and a
    ``WorkerClient`` in this process holding ``slabs`` slabs (guaranteed, and
    every block live, so neither reclaim nor its own idle decay takes them),
    written with a pattern. ``check`` says whether the fuzz left it as it was
    and it still grows, writes, reads and returns a new slab."""

    def __init__(self, socket_path: str, slabs: int = 3, page_size: int = DEFAULT_PAGE_SIZE) -> None:
        from kvelastic.client.engine import EngineClient
        from kvelastic.client.worker import WorkerClient
        from kvelastic.core.pool import SlabPool
        from kvelastic.vmm import get_backend

        self.page_size, self.blocks = page_size, 8
        self.warnings: list[str] = []        # what its clients logged (a dropped engine says so)
        self._log = _Collect(self.warnings)
        logging.getLogger("kvelastic.client").addHandler(self._log)
        self.engine = EngineClient(SlabPool(self.blocks), socket_path=socket_path, engine_id=LEGIT_ID,
                                   namespace=LEGIT_NAMESPACE, page_size=page_size, pages_per_worker=1,
                                   num_workers=1, block_bytes=page_size // self.blocks, low_watermark=0,
                                   keep_idle_slabs=slabs, shrink_grace=3600, min_bytes=slabs * page_size).start()
        try:
            self.worker = WorkerClient(get_backend("host"), socket_path=socket_path, engine_id=LEGIT_ID, rank=0,
                                       token=self.engine.token).start()
        except BaseException:
            self.engine.close()
            logging.getLogger("kvelastic.client").removeHandler(self._log)
            raise
        try:
            if not self.engine.ensure(self.blocks * slabs, timeout=10):
                raise RuntimeError("the legitimate engine could not grow")
            with self.engine.lock:
                self.engine.pool.allocate(self.blocks * slabs)      # all live: its slabs never go
            self.held = sorted(self.engine.pool.slab_ids())
            self.written = self.pages(self.held, 0xA7)
            time.sleep(0.5)                   # its journal and heartbeats settle
            self.before = self.status()
        except BaseException:
            self.close()
            raise

    @property
    def pages_held(self) -> int:
        return len(self.held)

    def status(self) -> dict:
        reply = self.engine.conn.call(p.Status())
        if not isinstance(reply, p.StatusReply):
            raise ValueError(f"no status: {reply!r}")
        [mine] = [e for e in reply.status.engines if e.engine_id == LEGIT_ID]
        # these two follow the clock, not the engine
        return {k: v for k, v in msgspec.to_builtins(mine).items() if k not in ("idle", "starved_seconds")}

    def pages(self, slabs: list[int], value: int | None) -> list[int]:
        """Write ``value`` (unless None) to the first and last byte of every
        page of ``slabs`` in the worker's arena, then read them back."""
        out = []
        with self.worker._mu:
            offsets = [o for s in slabs for o in self.worker.slabs.get(s, [])]
        for offset in offsets:
            for at in (offset, offset + self.page_size - 1):
                cell = ctypes.c_uint8.from_address(self.worker.reserved_arena().base + at)
                if value is not None:
                    cell.value = value
                out.append(cell.value)
        return out

    def check(self) -> dict[str, Any]:
        """Its books, its data, and a new slab grown, served and returned."""
        out: dict[str, Any] = {}
        try:
            after = self.status()
        except Exception as exc:  # noqa: BLE001 - gone, or no answer: a finding, not a fuzz failure
            after = {"error": repr(exc)}
        out["status_unchanged"] = after == self.before
        if not out["status_unchanged"]:
            out["status_diff"] = {k: (v, after.get(k)) for k, v in self.before.items() if after.get(k) != v}
        out["pages_intact"] = self.pages(self.held, None) == self.written
        out["reconnects"] = self.engine.conn.reconnects + self.worker.conn.reconnects
        try:
            reply = self.engine.conn.call(p.Grow(engine_id=LEGIT_ID, slabs=1, demand=True), 10.0)
        except Exception as exc:  # noqa: BLE001 - a refused or unanswered grow is a finding, not a fuzz failure
            reply = p.Error(reason="client", message=repr(exc))
        slabs = list(reply.slabs) if isinstance(reply, p.Granted) else []
        grew = len(slabs) == 1
        served = grew and self.pages(slabs, 0x5A) == [0x5A, 0x5A]
        try:
            back = self.engine.conn.call(p.Return(engine_id=LEGIT_ID, slabs=slabs), 10.0) if grew else None
        except Exception:  # noqa: BLE001 - as above
            back = None
        out.update(grew=grew, served=served, returned=isinstance(back, p.Ok))
        out["ok"] = all(out[k] for k in ("status_unchanged", "pages_intact", "grew", "served", "returned"))
        out["client_warnings"] = len(self.warnings)
        if self.warnings:
            out["client_warning_examples"] = sorted(set(self.warnings))[:5]
        return out

    def close(self, unregister: bool = True) -> None:
        """``unregister``: False when the daemon is dead or frozen (nobody would answer)."""
        try:
            if unregister:
                self.engine.close()      # unregisters first: its worker's channel closing is then no failure
                self.worker.close()
            else:
                self.engine.conn.close()
                self.worker.conn.close()
        finally:
            logging.getLogger("kvelastic.client").removeHandler(self._log)


class _Collect(logging.Handler):
    """Warnings of the legitimate engine's clients, kept (at most 1,000) instead of printed."""

    def __init__(self, into: list[str]) -> None:
        super().__init__(logging.WARNING)
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        if len(self.into) < 1000:
            self.into.append(record.getMessage()[:300])


if __name__ == "__main__" and sys.argv[1:2] == ["probe"]:
    _probe_main(sys.argv[2], float(sys.argv[3]), float(sys.argv[4]))
