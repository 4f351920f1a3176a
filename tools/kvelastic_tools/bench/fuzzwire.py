"""A fuzz session's side of the wire, for the sequence fuzz (``fuzzseq``).

Its one job: what a session opens to the daemon and how it talks there, so
that ``fuzzsession.Session`` only plays its plan. ``SessionWire``: the
sockets (an engine's DEALERs, lifelines, page channels) and worker processes
a session opens, its messages, its requests waiting for their replies (all
counted in the run's ``Tally``), its timers and heartbeat, and the closing of
all it opened. ``RawWorker``: a worker spoken by hand, on a DEALER and a page
channel of its own, acknowledging maps and unmaps as its plan says.
``Settings``: the daemon a run fuzzes.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import itertools
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import zmq

from kvelastic import protocol as p
from kvelastic.vmm import fdchannel
from kvelastic.vmm.errors import FdChannelError
from kvelastic_tools.fuzz import SessionPlan, WorkerPlan

# The fuzzed daemon's ack and grow deadlines (set by ``fuzzseq.DAEMON_TIMING``).
ACK_TIMEOUT, GROW_TIMEOUT = 2.0, 1.0
BUSY = getattr(p, "Busy", None)    # a worker's notice that a step holds its unmaps (newer protocols)


class Tally:
    """What every client saw, counted under one lock, and a trace of the last
    steps of all of them (what led to a finding)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.trace: collections.deque[str] = collections.deque(maxlen=300)
        self.grow_wait_max = 0.0
        self.lingering: collections.Counter[str] = collections.Counter()   # engine id -> sessions ending
        self.t0 = time.monotonic()

    def add(self, group: str, key: str, n: int = 1) -> None:
        with self.lock:
            self.counts[group][key] += n

    def note(self, client: int, text: str) -> None:
        self.trace.append(f"{time.monotonic() - self.t0:7.2f}s c{client} {text}")

    def snapshot(self, last: int = 60) -> list[str]:
        return list(self.trace)[-last:]


@dataclasses.dataclass(frozen=True)
class Settings:
    socket_path: str
    page_size: int
    budget_bytes: int
    ack_timeout: float = ACK_TIMEOUT
    grow_timeout: float = GROW_TIMEOUT


def _dealer(socket_path: str) -> zmq.Socket[bytes]:
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"ipc://{socket_path}")
    return sock


def hello(socket_path: str, engine_id: str, rank: int, token: bytes) -> socket.socket | None:
    """A page channel or lifeline with its hello sent (built as a map, so that
    a rank the protocol bounds goes out as it is); None if it cannot connect."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(2.0)
        sock.connect(p.fd_socket_path(socket_path))
        body = msgspec.msgpack.encode({"version": p.PROTOCOL_VERSION, "engine_id": engine_id, "rank": rank,
                                       "token": token})
        sock.sendall(len(body).to_bytes(4, "little") + body)
        sock.settimeout(1.0)
        return sock
    except OSError:
        sock.close()
        return None


def _close(sock: socket.socket | zmq.Socket[bytes] | None) -> None:
    if sock is None:
        return
    if isinstance(sock, zmq.Socket):
        sock.close(0)
    else:
        sock.close()


class RawWorker:
    """A worker spoken by hand: its own DEALER and page channel, acknowledging
    as its plan says."""

    def __init__(self, session: SessionWire, plan: WorkerPlan) -> None:
        self.s, self.plan = session, plan
        self.dealer: zmq.Socket[bytes] | None = None
        self.channel: socket.socket | None = None
        self.kept: list[int] = []          # page descriptors it keeps (its plan: "keep")
        self.closed = False

    def start(self) -> None:
        s, plan = self.s, self.plan
        if plan.channel not in ("none", "after"):
            self.open_channel()
        self.dealer = s.new_dealer()
        token = s.token if plan.register_token == "right" else s.rng.randbytes(16)
        s.send(self.dealer, p.RegisterWorker(version=p.PROTOCOL_VERSION, engine_id=s.engine_id, rank=plan.rank,
                                             pid=os.getpid(), token=token), request=True)
        if plan.channel == "after":
            self.open_channel()

    def open_channel(self) -> None:
        s = self.s
        token = {"wrong_token": s.rng.randbytes(16), "no_token": b""}.get(self.plan.channel, s.token)
        self.channel = hello(s.settings.socket_path, s.engine_id, self.plan.hello_rank, token)
        if self.channel is None:
            s.tally.add("channels", "connect_failed")

    def pollables(self) -> list[tuple[Any, Callable[[], None]]]:
        if self.closed:
            return []
        out: list[tuple[Any, Callable[[], None]]] = []
        if self.dealer is not None:
            out.append((self.dealer, self.on_dealer))
        if self.channel is not None and self.plan.fds != "unread":
            out.append((self.channel.fileno(), self.on_channel))
        return out

    def on_dealer(self) -> None:
        for msg in self.s.receive(self.dealer):
            if isinstance(msg, p.MapSlab) and self.s.unsolicited(msg):
                self.ack(self.plan.maps, p.Mapped, msg.slab, msg.req_id)
            elif isinstance(msg, p.UnmapSlab) and self.s.unsolicited(msg):
                self.ack(self.plan.unmaps, p.Unmapped, msg.slab, msg.req_id)

    def ack(self, how: str, cls: type[p.Mapped] | type[p.Unmapped], slab: int, req_id: int) -> None:
        s = self.s
        s.tally.add("acks", f"{cls.__name__}:{how}")
        if how == "never":
            return

        def send(slab: int = slab) -> None:
            if self.dealer is not None and not self.closed:
                fields: dict[str, Any] = dict(req_id=req_id, engine_id=s.engine_id, rank=self.plan.rank, slab=slab)
                if how == "error" and cls is p.Mapped:
                    fields["error"] = "fuzz: this worker could not map it"
                s.send(self.dealer, cls(**fields))

        if how == "wrong_slab":
            send(slab + 1 + s.rng.randrange(3))
        if how == "late":
            s.at(self.plan.delay, send)
            if cls is p.Unmapped and BUSY is not None:   # "in a step": it says so, as a real worker does
                for k in range(1, int(self.plan.delay / (0.4 * s.settings.ack_timeout)) + 1):
                    s.at(k * 0.4 * s.settings.ack_timeout, lambda: self.busy([slab]))
            return
        send()
        if how == "twice":
            send()

    def busy(self, slabs: list[int]) -> None:
        if BUSY is not None and self.dealer is not None and not self.closed:
            self.s.send(self.dealer, BUSY(engine_id=self.s.engine_id, rank=self.plan.rank, slabs=slabs))

    def on_channel(self) -> None:
        assert self.channel is not None
        try:
            pairs, command = fdchannel.recv_batch(self.channel)
            msg = p.decode(command)
        except (FdChannelError, OSError, msgspec.DecodeError):
            self.s.tally.add("channels", "closed_by_daemon")
            _close(self.channel)
            self.channel = None
            return
        self.s.tally.add("channels", "descriptors_received", len(pairs))
        for _, fd_ in pairs:
            if self.plan.fds == "keep":
                self.kept.append(fd_)
            else:
                os.close(fd_)
        if isinstance(msg, p.MapSlab) and self.s.unsolicited(msg):   # it rides with its pages
            self.ack(self.plan.maps, p.Mapped, msg.slab, msg.req_id)
        elif isinstance(msg, p.UnmapSlab) and self.s.unsolicited(msg):
            self.ack(self.plan.unmaps, p.Unmapped, msg.slab, msg.req_id)

    def close(self) -> None:
        """Its process is gone: every socket closed at once."""
        if self.closed:
            return
        self.closed = True
        _close(self.channel)
        _close(self.dealer)
        self.channel = self.dealer = None
        for fd_ in self.kept:
            os.close(fd_)
        self.kept.clear()


class SessionWire:
    """A session's connections to the daemon and what goes over them: the
    engine's DEALERs and lifelines, its workers (by hand or in processes),
    requests waiting for replies, timers; all closed at its end."""

    def __init__(self, settings: Settings, tally: Tally, plan: SessionPlan) -> None:
        self.settings, self.tally, self.plan = settings, tally, plan
        self.rng = random.Random(plan.seed)
        self.engine_id = plan.engine_id
        self.token = plan.token
        self.dealer: zmq.Socket[bytes] | None = None
        self.sockets: list[zmq.Socket[bytes] | socket.socket] = []   # everything else it opened, closed at its end
        self.lifelines: list[socket.socket] = []
        self.workers: list[RawWorker] = []
        self.children: list[subprocess.Popen] = []
        self.timers: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()
        self._req = itertools.count(1)
        self.pending: dict[int, tuple[str, float, zmq.Socket[bytes]]] = {}
        self.sent: dict[int, str] = {}       # notifications by request id
        self.replies: dict[int, p.Msg] = {}
        self.heartbeats = True
        self.lingers = False                 # ended, some of it still open (counted in ``Tally.lingering``)
        self.closed = False

    # ------------------------------------------------------------ plumbing
    def note(self, text: str) -> None:
        self.tally.note(self.plan.client, f"s{self.plan.index} {self.engine_id}: {text}")

    def new_dealer(self) -> zmq.Socket[bytes]:
        sock = _dealer(self.settings.socket_path)
        self.sockets.append(sock)
        return sock

    def send(self, sock: zmq.Socket[bytes] | None, msg: p.Msg, request: bool = False) -> int:
        """Send ``msg``: one without a request id gets a fresh one; a request
        then waits in ``pending`` for its answer."""
        if sock is None or self.closed:
            return 0
        if not msg.req_id:               # a notification gets an id too: its refusal is then told apart
            msg.req_id = next(self._req)
            self.sent[msg.req_id] = type(msg).__name__
        try:
            data = p.encode(msg)
        except (OverflowError, msgspec.EncodeError):     # an int past msgpack's 64 bits: no peer can send it
            self.tally.add("sent", "unencodable")
            return 0
        if request:
            self.pending[msg.req_id] = (type(msg).__name__, time.monotonic(), sock)
        self.tally.add("sent", type(msg).__name__)
        try:
            sock.send(data, zmq.NOBLOCK)
        except zmq.ZMQError:
            self.tally.add("sent", "dropped_here")
        return msg.req_id

    def receive(self, sock: zmq.Socket[bytes] | None) -> Iterator[p.Msg]:
        """Every message waiting on ``sock``, replies to this session's requests counted."""
        while sock is not None and not self.closed and not sock.closed:
            try:
                data = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = p.decode(data)
            except (msgspec.DecodeError, msgspec.ValidationError):
                self.tally.add("replies", "undecodable")
                continue
            asked = self.pending.pop(msg.req_id, None)
            if asked is not None:
                request, sent, _ = asked
                what = msg.reason if isinstance(msg, p.Error) else type(msg).__name__
                self.tally.add("replies", f"{request}:{what}")
                if isinstance(msg, p.Error) and msg.reason == p.Reason.INTERNAL.value:
                    self.tally.add("problems", "internal_errors")
                    self.note(f"INTERNAL error answering {request}: {msg.message}")
                if request == "Grow":
                    with self.tally.lock:
                        self.tally.grow_wait_max = max(self.tally.grow_wait_max, time.monotonic() - sent)
                self.replies[msg.req_id] = msg
                if len(self.replies) > 64:
                    self.replies.pop(next(iter(self.replies)))
            elif isinstance(msg, p.Error):   # a notification refused, or an acknowledgement (the daemon's id)
                self.tally.add("replies", f"{self.sent.get(msg.req_id, 'ack')}:{msg.reason}")
                if msg.reason == p.Reason.INTERNAL.value:
                    self.tally.add("problems", "internal_errors")
            elif not isinstance(msg, (p.MapSlab, p.UnmapSlab, p.Reclaim, p.ClearIndex, p.Granted)):
                self.tally.add("replies", f"unsolicited:{type(msg).__name__}")
            yield msg

    def unsolicited(self, msg: p.Msg) -> bool:
        """A command of the daemon's (its own request ids), not a reply."""
        return msg.req_id not in self.replies

    def at(self, delay: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self.timers, (time.monotonic() + delay, next(self._order), fn))

    def next_timer(self) -> float:
        return self.timers[0][0] if self.timers else float("inf")

    def run_timers(self, now: float) -> None:
        while self.timers and self.timers[0][0] <= now and not self.closed:
            _, _, fn = heapq.heappop(self.timers)
            fn()

    # ---------------------------------------------- lifelines and workers
    def open_lifeline(self, token: bytes, rank: int = -1) -> None:
        sock = hello(self.settings.socket_path, self.engine_id, rank, token)
        if sock is not None:
            self.lifelines.append(sock)

    def heartbeat(self) -> None:
        if self.heartbeats and self.dealer is not None:
            self.send(self.dealer, p.Heartbeat(engine_id=self.engine_id))
            self.at(p.HEARTBEAT_INTERVAL, self.heartbeat)

    def spawn_worker(self, rank: int) -> None:
        """A real ``WorkerClient`` in a child process (killed -9 by ``kill_worker``
        or the ``kill9`` ending; at the latest when the session closes)."""
        self.children.append(subprocess.Popen(
            [sys.executable, "-m", "kvelastic_tools.bench.fuzzseq", "worker", self.settings.socket_path, self.engine_id,
             str(rank), self.token.hex()], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL))
        self.tally.add("workers", "processes_started")

    def kill_children(self) -> int:
        killed = 0
        for child in self.children:
            if child.poll() is None:
                child.send_signal(signal.SIGKILL)
                killed += 1
            child.wait(10)
        self.children.clear()
        return killed

    # ------------------------------------------------------------ the end
    def drop_socket(self, sock: socket.socket | zmq.Socket[bytes]) -> None:
        if sock in self.sockets:
            self.sockets.remove(sock)
            _close(sock)

    def close_engine(self) -> None:
        """The engine's process is gone: its connection, lifelines and whatever else it opened."""
        self.heartbeats = False
        for lifeline in self.lifelines:
            lifeline.close()
        self.lifelines.clear()
        workers = {id(w.dealer) for w in self.workers}
        for sock in [s for s in self.sockets if id(s) not in workers]:
            self.drop_socket(sock)
        self.dealer = None

    def close(self) -> None:
        if self.closed:
            return
        now = time.monotonic()
        for request, sent, sock in self.pending.values():   # asked and not answered, on a connection still open
            if not sock.closed and now - sent > (self.settings.grow_timeout + 1.0 if request == "Grow" else 3.0):
                self.tally.add("unanswered", request)
        self.kill_children()
        for w in self.workers:
            w.close()
        self.close_engine()
        self.closed = True
        if self.lingers:
            with self.tally.lock:
                self.tally.lingering[self.engine_id] -= 1
