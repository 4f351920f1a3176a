"""``kvelastic bench fuzz``, sequence mode: well-formed protocol sequences
from several clients against a real daemon, then its books.

Why: a frame at a time tests each message's checks; the books break in
sequences of valid messages (an engine id registered again while its last
registration still waits for its workers' unmaps lost 22 of 64 MiB in 44 s).
Each client, a thread, carries out the session plans of
``kvelastic.fuzz.Sequences``: engines registered under a small pool of ids
(reused, often at once), lifelines and page channels with and without the
right secret, workers that acknowledge maps and unmaps on time, late or
never, grows, journals valid and hostile, returns, reclaim answers,
impostors, abrupt exits, and real worker processes killed with SIGKILL.
Values are type-valid and often extreme.

Checked, with the daemon a subprocess (host backend):
- it never crashes, nor hangs: a ``Status`` from a process of its own every
  20 ms must be answered within 2 s (its p50/p99/max under attack reported);
- no page is ever lost: at every ``Status`` (every 0.5 s) each page created
  is free, in an engine record's slab or in kept cache (``fuzzdrive.books``);
- once every client has gone and every deadline has passed, nothing is held
  but the legitimate engine's slabs, the daemon's page handles match its
  books, no traceback is in its log, and the legitimate engine beside the
  fuzz (``fuzzdrive.Legit``: the target of the impostors and hostile hellos)
  kept its slabs, data and status and still grows, serves and returns.

Replay: ``python -m kvelastic.bench.fuzzseq --seed N [--quick]`` (JSON). The
seed fixes every client's plans, whatever the daemon answers; the daemon's
timing decides how the clients interleave, so a finding is reproduced by
its seed in distribution, and the report's trace shows what led to it.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import functools
import heapq
import itertools
import json
import os
import random
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import IO, Any

import msgspec
import zmq

from kvelastic import protocol as p
from kvelastic.bench import fuzzdrive as fd
from kvelastic.bench.daemon import rss_bytes
from kvelastic.core.stats import COUNTER_NAMES
from kvelastic.fuzz import Sequences, SessionPlan, WorkerPlan
from kvelastic.vmm import fdchannel
from kvelastic.vmm.errors import FdChannelError

MiB = 1 << 20
BUDGET = "64MiB"
# Deadlines of the fuzzed daemon: short, so that many pass in a short run
# (acks late past them, grows answered at them, kept cache expiring).
DAEMON_TIMING = {"KVELASTIC_ACK_TIMEOUT": "2s", "KVELASTIC_GROW_TIMEOUT": "1s", "KVELASTIC_IDLE_GRACE": "1s",
                 "KVELASTIC_ORPHAN_CACHE_TTL": "2s"}
ACK_TIMEOUT, GROW_TIMEOUT = 2.0, 1.0
ORPHAN_TTL = 2.0
FROZEN_AFTER = 3                   # probes in a row not answered within 2 s: the daemon is frozen
BOOKS_EVERY = 0.5                  # seconds between checks of the books during the fuzz
BUSY = getattr(p, "Busy", None)    # a worker's notice that a step holds its unmaps (newer protocols)
REQUESTS = (p.RegisterEngine, p.RegisterWorker, p.Grow, p.Return, p.Unregister, p.Status, p.SetLimit,
            p.Invalidate)


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


def _hello(socket_path: str, engine_id: str, rank: int, token: bytes) -> socket.socket | None:
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


def _block(block_id: int) -> int:
    """A block id as the wire carries it (msgpack ints end at 64 bits)."""
    return min(block_id, 2**63 - 1)


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

    def __init__(self, session: Session, plan: WorkerPlan) -> None:
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
        self.channel = _hello(s.settings.socket_path, s.engine_id, self.plan.hello_rank, token)
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
            pairs = fdchannel.recv_pages(self.channel)
        except (FdChannelError, OSError):
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


class Session:
    """One plan carried out: an engine (its DEALER and lifeline), its workers,
    and what they do until it ends and its last socket closes."""

    def __init__(self, client: Client, plan: SessionPlan) -> None:
        self.client, self.plan = client, plan
        self.settings, self.tally = client.settings, client.tally
        self.rng = random.Random(plan.seed)
        self.engine_id = plan.engine_id
        self.token = plan.token
        self.bps = int(plan.fields["blocks_per_slab"])
        self.dealer: zmq.Socket[bytes] | None = None
        self.sockets: list[zmq.Socket[bytes] | socket.socket] = []   # everything else it opened, closed at its end
        self.lifelines: list[socket.socket] = []
        self.workers: list[RawWorker] = []
        self.children: list[subprocess.Popen] = []
        self.held: list[int] = []
        self.added: set[int] = set()
        self.keys: dict[int, dict[int, bytes]] = {}     # slab -> block -> key
        self.step = self.block_ops = 0
        self.timers: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()
        self._req = itertools.count(1)
        self.pending: dict[int, tuple[str, float, zmq.Socket[bytes]]] = {}
        self.sent: dict[int, str] = {}       # notifications by request id
        self.replies: dict[int, p.Msg] = {}
        self.heartbeats = True
        self.ends_at: float | None = None
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

    def call(self, sock: zmq.Socket[bytes] | None, msg: p.Msg, timeout: float) -> p.Msg | None:
        rid = self.send(sock, msg, request=True)
        if not rid:
            return None
        self.client.pump(timeout, until=lambda: rid in self.replies)
        return self.replies.pop(rid, None)

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

    def pollables(self) -> list[tuple[Any, Callable[[], None]]]:
        if self.closed:
            return []
        out: list[tuple[Any, Callable[[], None]]] = [
            (sock, functools.partial(self.on_engine, sock)) for sock in self.sockets
            if isinstance(sock, zmq.Socket) and not sock.closed and all(sock is not w.dealer for w in self.workers)]
        for w in self.workers:
            out += w.pollables()
        return out

    def open_lifeline(self, token: bytes, rank: int = -1) -> None:
        sock = _hello(self.settings.socket_path, self.engine_id, rank, token)
        if sock is not None:
            self.lifelines.append(sock)

    # ------------------------------------------------------------- the run
    def run(self) -> None:
        plan, rng = self.plan, self.rng
        self.tally.add("sessions", "started")
        if plan.pattern:
            self.tally.add("sessions", plan.pattern)
        self.note(" ".join(("session", plan.pattern)).strip()
                  + f": {plan.ending}, lifeline {plan.lifeline}, {len(plan.workers)} worker(s), "
                  f"token {len(plan.token)} B" + "".join(f", {k}={plan.fields.get(k)}" for k in plan.hostile))
        if plan.lifeline in ("before", "twice"):
            self.open_lifeline(self.token)
        if plan.lifeline == "twice":
            self.open_lifeline(b"")
        if plan.lifeline == "wrong_token":
            self.open_lifeline(rng.randbytes(16))
        self.dealer = self.new_dealer()
        fields = {k: v for k, v in plan.fields.items() if k in p.RegisterEngine.__struct_fields__}
        reply = self.call(self.dealer, p.RegisterEngine(version=p.PROTOCOL_VERSION, engine_id=self.engine_id,
                                                        namespace=plan.namespace, page_size=self.settings.page_size,
                                                        token=self.token, **fields), 3.0)
        if not isinstance(reply, p.Registered):
            why = reply.reason if isinstance(reply, p.Error) else "no answer"
            self.tally.add("registrations", f"refused:{why}")
            self.note(f"registration refused: {why}")
            self.client.pump(rng.uniform(0.02, 0.1))     # then (often) the same id again
            return
        self.tally.add("registrations", "accepted" + (":extreme" if plan.hostile else ""))
        if self.tally.lingering.get(self.engine_id):
            self.tally.add("registrations", "reused_while_departing")   # an earlier engine of that id still lingers
        self.engine_id = reply.engine_id or self.engine_id    # a daemon may qualify a tenant's id
        self.token = reply.token or self.token
        self.held = sorted(plan.fields.get("held", []))        # adopted: it says it holds them
        if plan.lifeline == "after":
            self.open_lifeline(self.token)
        self.at(p.HEARTBEAT_INTERVAL, self.heartbeat)
        for wplan in plan.workers:
            if wplan.process:
                self.spawn_worker(wplan.rank)
            else:
                worker = RawWorker(self, wplan)
                self.workers.append(worker)
                worker.start()
        for name, seed in plan.actions:
            if self.client.stopping():
                break
            self.tally.add("actions", name)
            self.note(f"{name}, holding {sorted(self.held)[:8]}")
            getattr(self, f"do_{name}")(random.Random(seed))
            self.client.pump(rng.uniform(0.01, 0.25))
        if not self.client.stopping():
            self.end()

    def heartbeat(self) -> None:
        if self.heartbeats and self.dealer is not None:
            self.send(self.dealer, p.Heartbeat(engine_id=self.engine_id))
            self.at(p.HEARTBEAT_INTERVAL, self.heartbeat)

    def spawn_worker(self, rank: int) -> None:
        """A real ``WorkerClient`` in a child process (killed -9 by ``kill_worker``
        or the ``kill9`` ending; at the latest when the session closes)."""
        self.children.append(subprocess.Popen(
            [sys.executable, "-m", "kvelastic.bench.fuzzseq", "worker", self.settings.socket_path, self.engine_id,
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

    # ------------------------------------------------ the engine's messages
    def on_engine(self, sock: zmq.Socket[bytes]) -> None:
        for msg in self.receive(sock):
            if isinstance(msg, p.Granted):
                if msg.req_id not in self.replies:
                    self.tally.add("grants", "late")
                for slab in msg.slabs:
                    if slab not in self.held:
                        self.held.append(slab)
            elif isinstance(msg, p.Reclaim) and self.unsolicited(msg):
                self.answer_reclaim(msg)
            elif isinstance(msg, p.ClearIndex) and self.unsolicited(msg):
                self.keys = {s: {} for s in self.keys}
                self.send(self.dealer, p.Journal(engine_id=self.engine_id, ops=[p.ClearKeys()], occupancy={}))
            elif type(msg).__name__ == "Failed":
                self.tally.add("engines", "told_failed")

    def answer_reclaim(self, m: p.Reclaim) -> None:
        how, rng = self.plan.reclaims, self.rng
        self.tally.add("reclaims", how)
        if how == "never":
            return
        mine = [s for s in m.slabs if s in self.held]
        given = [] if how == "refuse" else mine[:len(mine) // 2] if how == "some" else mine
        refused = [s for s in m.slabs if s not in given]
        cached = {s: [p.CachedBlock(b % self.bps, k) for b, k in self.keys.get(s, {}).items()][:4096] for s in given}
        if how == "hostile_cached":
            extreme = self.client.sequences.extreme["offset"]
            cached = {s: [p.CachedBlock(rng.choice((*extreme, self.bps)), rng.randbytes(32))
                          for _ in range(rng.choice((1, 64, 4096)))] for s in given}
        if how == "extra":
            given = [*given, rng.choice(self.client.sequences.extreme["slab"])]
        req_id = m.req_id + 7 if how == "wrong_id" else m.req_id

        def answer() -> None:
            for s in given:
                self.forget_slab(s)
            self.send(self.dealer, p.ReclaimDone(req_id=req_id, engine_id=self.engine_id, given=given,
                                                 refused=refused, cached={s: c for s, c in cached.items() if c}))

        if how == "late":
            self.at(1.5 * p.RECLAIM_TIMEOUT, answer)
        else:
            answer()

    def forget_slab(self, slab: int) -> None:
        if slab in self.held:
            self.held.remove(slab)
        self.added.discard(slab)
        self.keys.pop(slab, None)

    # ------------------------------------------------------------- actions
    def do_grow(self, rng: random.Random) -> None:
        r = rng.random()           # mostly a slab or a few; sometimes enough to fill the budget (reclaims)
        n = rng.choice((1, 1, 1, 2, 3)) if r < 0.75 else rng.choice((4, 8, 16)) if r < 0.9 else \
            rng.choice(self.client.sequences.extreme["grow"])
        self.send(self.dealer, p.Grow(engine_id=self.engine_id, slabs=n, demand=rng.random() < 0.6), request=True)

    def occupancy(self, rng: random.Random, slab: int) -> tuple[int, int, int]:
        cached = min(self.bps, len(self.keys.get(slab, {})))
        live = rng.randint(0, min(2, self.bps - cached))
        return (live, cached, self.bps - live - cached)

    def do_journal(self, rng: random.Random) -> None:
        """What a real engine's journal looks like: its new slabs, keys stored
        in a numbered step (done, mostly), occupancies that add up."""
        ops: list[p.JournalOp] = []
        for s in self.held:
            if s not in self.added:
                ops.append(p.AddSlab(s))
                self.added.add(s)
                self.keys.setdefault(s, {})
        self.step += 1
        ops.append(p.StepBegun(self.step))
        touched = set()
        for _ in range(rng.randint(0, 8) if self.held else 0):
            s = rng.choice(self.held)
            block = _block(s * self.bps + rng.randrange(min(self.bps, 64)))
            key = rng.randbytes(rng.choice((8, 32)))
            if rng.random() < 0.15 and self.keys[s]:
                old_block, old_key = next(iter(self.keys[s].items()))
                ops.append(p.RemoveKey(old_key, old_block))
                del self.keys[s][old_block]
            ops.append(p.StoreKey(key, block))
            self.keys[s][block] = key
            touched.add(s)
        if rng.random() < 0.8:
            ops.append(p.StepDone(self.step))
        self.block_ops += rng.randint(1, 5)
        stats = {"block_ops": self.block_ops} if "block_ops" in COUNTER_NAMES else {}
        self.journal(ops, {s: self.occupancy(rng, s) for s in touched}, stats, sync=rng.random() < 0.2)

    def journal(self, ops: list[p.JournalOp], occupancy: dict[int, tuple[int, int, int]], stats: dict[str, int],
                sync: bool = False, engine_id: str | None = None) -> None:
        msg = p.Journal(engine_id=engine_id or self.engine_id, ops=ops, occupancy=occupancy, stats=stats, sync=sync)
        self.send(self.dealer, msg, request=sync)

    def do_journal_hostile(self, rng: random.Random) -> None:
        """Well-formed journals no honest engine sends."""
        extreme = self.client.sequences.extreme
        key = rng.randbytes(32)
        held = self.held
        kind = rng.choice(("not_held", "huge_block", "add_arbitrary", "many_keys", "huge_step", "stats",
                           "occupancy", "remove_slab", "clear", "foreign"))
        self.tally.add("hostile_journals", kind)
        bps = self.bps
        if kind == "not_held":
            self.journal([p.StoreKey(key, _block((max(held, default=0) + 1 + rng.randrange(100)) * bps))], {}, {})
        elif kind == "huge_block":
            self.journal([p.StoreKey(key, rng.choice(extreme["block"]))], {}, {})
        elif kind in ("add_arbitrary", "many_keys"):
            # Keys for blocks of slabs it adds in the same journal (any ids):
            # as many as a frame holds, in slabs it does not hold.
            size = rng.choice((8, 32, 256)) if kind == "many_keys" else 16
            n = min(19_000, (p.MAX_MESSAGE_BYTES - 65536) // (size + 24)) if kind == "many_keys" \
                else rng.choice((1, 100, 2000))
            base = rng.choice((rng.randrange(1000), *extreme["slab"][:3]))
            ops: list[p.JournalOp] = [p.StepBegun(1)]
            for i in range(n):
                slab = base + i // bps
                if i % bps == 0:
                    ops.append(p.AddSlab(slab))
                ops.append(p.StoreKey(rng.randbytes(size), _block(slab * bps + i % bps)))
                if len(ops) >= 19_990:
                    break
            ops.append(p.StepDone(1))
            self.journal(ops, {base: (0, min(bps, n), bps - min(bps, n))} if rng.random() < 0.5 else {}, {},
                         sync=rng.random() < 0.3)
        elif kind == "huge_step":
            step = rng.choice(extreme["step"])
            ops = [p.StepBegun(step)]
            if held:
                s = rng.choice(held)
                self.keys.setdefault(s, {})[_block(s * bps)] = key
                ops.append(p.StoreKey(key, _block(s * bps)))
            self.journal([*ops, p.StepDone(step)], {}, {})
        elif kind == "stats":
            names = sorted(COUNTER_NAMES)
            stats = {name: rng.choice(extreme["stat"]) for name in rng.sample(names, min(3, len(names)))}
            self.journal([], {}, stats)
        elif kind == "occupancy":
            slab = rng.choice(held) if held and rng.random() < 0.7 else rng.choice(extreme["slab"])
            occ = rng.choice(((bps, 0, 0), (0, bps, 0), (2**62, 0, bps - 2**62), (-1, 0, bps + 1)))
            self.journal([], {slab: occ}, {})
        elif kind == "remove_slab" and held:
            s = rng.choice(held)
            self.journal([p.RemoveSlab(s), p.StoreKey(key, _block(s * bps))], {}, {})
        elif kind == "clear":
            self.journal([p.ClearKeys()], {}, {}, sync=True)
        else:
            self.journal([p.ClearKeys()], {}, {}, engine_id=self.victim(rng))

    def do_return(self, rng: random.Random) -> None:
        if self.held and rng.random() < 0.8:
            slabs = rng.sample(self.held, rng.randint(1, len(self.held)))
            for s in slabs:
                self.forget_slab(s)
        else:
            slabs = rng.choice(([rng.choice(self.client.sequences.extreme["slab"])], [rng.randrange(64)], [],
                                [self.held[0], self.held[0]] if self.held else [0, 0]))
        self.send(self.dealer, p.Return(engine_id=self.engine_id, slabs=slabs), request=True)

    def do_heartbeat(self, rng: random.Random) -> None:
        self.send(self.dealer, p.Heartbeat(engine_id=self.engine_id if rng.random() < 0.8 else self.victim(rng)))

    def do_wait(self, rng: random.Random) -> None:
        self.client.pump(rng.uniform(0.1, 1.0))

    def victim(self, rng: random.Random) -> str:
        """Someone else's engine id: another of the pool's, or the legitimate engine's."""
        seq = self.client.sequences
        others = [i for i in seq.ids if i != self.engine_id] + list(seq.victims) * 3
        return rng.choice(others)

    def do_impostor(self, rng: random.Random) -> None:
        """A message for someone else's engine, from this session's connection or a fresh one."""
        target = self.victim(rng)
        slab = rng.randrange(4)
        msgs: list[p.Msg] = [
            p.Grow(engine_id=target, slabs=1, demand=True), p.Return(engine_id=target, slabs=[slab]),
            p.Unregister(engine_id=target), p.Heartbeat(engine_id=target),
            p.Journal(engine_id=target, ops=[p.ClearKeys()], occupancy={}, sync=True),
            p.ReclaimDone(engine_id=target, given=[slab], refused=[]),
            p.Mapped(engine_id=target, rank=0, slab=slab), p.Unmapped(engine_id=target, rank=0, slab=slab),
            p.RegisterWorker(version=p.PROTOCOL_VERSION, engine_id=target, rank=0, pid=os.getpid(),
                             token=rng.choice((b"", rng.randbytes(16)))),
            p.RegisterEngine(version=p.PROTOCOL_VERSION, engine_id=target, pid=os.getpid(), namespace="seq-ns-a",
                             page_size=self.settings.page_size, pages_per_worker=1, num_workers=0,
                             blocks_per_slab=4, block_bytes=self.settings.page_size // 4,
                             token=rng.choice((b"", rng.randbytes(16))))]
        if BUSY is not None:
            msgs.append(BUSY(engine_id=target, rank=0, slabs=[slab]))
        msg = rng.choice(msgs)
        self.tally.add("impostors", type(msg).__name__)
        sock = self.dealer if rng.random() < 0.7 else self.new_dealer()
        self.send(sock, msg, request=isinstance(msg, REQUESTS) or isinstance(msg, p.Journal))

    def do_operator(self, rng: random.Random) -> None:
        """Limits and invalidation (the fuzz runs as root: an operator), never the legitimate engine's."""
        seq = self.client.sequences
        if rng.random() < 0.6:
            page, budget = self.settings.page_size, self.settings.budget_bytes
            self.send(self.dealer, p.SetLimit(engine_id=rng.choice(seq.ids), min_bytes=rng.choice((0, 0, page, budget)),
                                              max_bytes=rng.choice((0, page, budget, 2**63 - 1))), request=True)
        else:
            target = rng.choice((*seq.ids, self.plan.namespace))
            self.send(self.dealer, p.Invalidate(target=target), request=True)

    def do_status(self, rng: random.Random) -> None:
        self.send(self.dealer, p.Status(), request=True)

    def do_reregister(self, rng: random.Random) -> None:
        """Register again on a new connection: with its secret (a reconnect), none, or a wrong one."""
        token = rng.choices((self.token, b"", rng.randbytes(16)), (6, 2, 2))[0]
        sock = self.new_dealer()
        fields = {k: v for k, v in self.plan.fields.items() if k in p.RegisterEngine.__struct_fields__}
        fields["held"], fields["occupancy"] = sorted(self.held), {}
        reply = self.call(sock, p.RegisterEngine(version=p.PROTOCOL_VERSION, engine_id=self.engine_id,
                                                 namespace=self.plan.namespace, page_size=self.settings.page_size,
                                                 token=token, **fields), 2.0)
        if isinstance(reply, p.Registered) and token == self.token:
            old, self.dealer = self.dealer, sock          # the old connection goes, as a reconnecting client's
            if old is not None:
                self.sockets.remove(old)
                old.close(0)

    def do_extra_lifeline(self, rng: random.Random) -> None:
        sock = _hello(self.settings.socket_path, self.engine_id, -1, rng.choice((self.token, b"", rng.randbytes(16))))
        if sock is not None:
            self.sockets.append(sock)
            self.at(rng.uniform(0.1, 2.0), lambda: self.drop_socket(sock))

    def do_hostile_hello(self, rng: random.Random) -> None:
        """A lifeline or page channel for any engine, with an odd rank, held a while, then closed."""
        target = rng.choice((self.engine_id, self.victim(rng)))
        rank = rng.choice(self.client.sequences.extreme["rank"])
        token = rng.choice((b"", rng.randbytes(16), self.token if target == self.engine_id else b""))
        self.tally.add("hostile_hellos", "rank<-1" if rank < -1 else str(rank) if rank < 2 else "high")
        sock = _hello(self.settings.socket_path, target, rank, token)
        if sock is not None:
            self.sockets.append(sock)
            self.at(rng.uniform(0.05, 2.0), lambda: self.drop_socket(sock))

    def drop_socket(self, sock: socket.socket | zmq.Socket[bytes]) -> None:
        if sock in self.sockets:
            self.sockets.remove(sock)
            _close(sock)

    def do_busy(self, rng: random.Random) -> None:
        live = [w for w in self.workers if not w.closed]
        if live:
            slabs = rng.sample(self.held, min(len(self.held), 2)) if self.held and rng.random() < 0.7 else \
                [rng.choice(self.client.sequences.extreme["slab"])]
            rng.choice(live).busy(slabs)

    def do_close_worker(self, rng: random.Random) -> None:
        live = [w for w in self.workers if not w.closed]
        if live:
            rng.choice(live).close()

    def do_kill_worker(self, rng: random.Random) -> None:
        alive = [c for c in self.children if c.poll() is None]
        if alive:
            rng.choice(alive).send_signal(signal.SIGKILL)
            self.tally.add("workers", "killed_-9")
        else:
            self.do_close_worker(rng)

    # ------------------------------------------------------------ the end
    def end(self) -> None:
        how, linger = self.plan.ending, self.plan.linger
        self.tally.add("endings", how)
        self.note(f"ends: {how}, linger {linger:.2f} s")
        if how in ("unregister", "unregister_linger"):
            self.call(self.dealer, p.Unregister(engine_id=self.engine_id), 2.0)
            self.close_engine()
            if how == "unregister":
                self.client.pump(0.2)
                linger = 0.0
        elif how == "close_all":
            self.close()
            return
        elif how == "lifeline_first":
            self.close_engine()
        elif how == "silent":
            self.heartbeats = False
        elif how == "kill9":
            if self.kill_children():
                self.tally.add("workers", "killed_-9")
            else:
                for w in self.workers[:1]:
                    w.close()
            self.client.pump(0.1)
            self.close_engine()
        elif how == "workers_first":
            self.kill_children()
            for w in self.workers:
                w.close()
        self.ends_at = time.monotonic() + linger
        with self.tally.lock:
            self.tally.lingering[self.engine_id] += 1
        self.lingers = True

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


class Client(threading.Thread):
    """One client: its sessions one after another, each leaving its lingering
    workers behind while the next one starts (perhaps under the same id)."""

    def __init__(self, index: int, settings: Settings, sequences: Sequences, tally: Tally, stop: threading.Event,
                 deadline: float) -> None:
        super().__init__(name=f"fuzzseq-client-{index}", daemon=True)
        self.index, self.settings, self.sequences, self.tally = index, settings, sequences, tally
        self.stop, self.deadline = stop, deadline
        self.sessions: list[Session] = []

    def stopping(self) -> bool:
        return self.stop.is_set() or time.monotonic() >= self.deadline

    def run(self) -> None:
        plans = self.sequences.sessions(self.index)
        try:
            while not self.stopping():
                session = Session(self, next(plans))
                self.sessions.append(session)
                try:
                    session.run()
                except Exception:  # noqa: BLE001 - a bug of the fuzzer itself: counted and shown, the run goes on
                    self.tally.add("problems", "fuzzer_errors")
                    self.tally.note(self.index, "FUZZER ERROR " + traceback.format_exc(limit=4).replace("\n", " | "))
                    session.close()
                if session.ends_at is None:
                    session.close()
        finally:
            for session in self.sessions:
                session.close()
            self.sessions.clear()

    def pump(self, seconds: float, until: Callable[[], bool] | None = None) -> None:
        """Serve every session of this client (replies, commands, timers,
        lingering ones ending) for ``seconds``, or until ``until()``."""
        end = time.monotonic() + seconds
        while True:
            now = time.monotonic()
            for session in list(self.sessions):
                session.run_timers(now)
                if session.ends_at is not None and now >= session.ends_at:
                    session.close()
                if session.closed:
                    self.sessions.remove(session)
            if (until is not None and until()) or now >= end or self.stop.is_set():
                return
            poller = zmq.Poller()
            handlers: dict[Any, Callable[[], None]] = {}
            for session in self.sessions:
                for sock, fn in session.pollables():
                    poller.register(sock, zmq.POLLIN)
                    handlers[sock] = fn
            wake = min([end, now + 0.05, *(s.next_timer() for s in self.sessions)])
            for sock, _ in poller.poll(int(max(0.0, wake - now) * 1000)):
                handler = handlers.get(sock)
                if handler is not None:
                    handler()


# ---------------------------------------------------------------- the run
def drive(settings: Settings, seed: int, clients: int, seconds: float, alive: Callable[[], bool],
          victims: tuple[str, ...] = (), ids: int = 5, log_tail: Callable[[], list[str]] = list) -> dict[str, Any]:
    """Run ``clients`` clients for ``seconds`` against the daemon at
    ``settings.socket_path``, checking its books every ``BOOKS_EVERY`` s.
    ``log_tail``: the daemon's last log lines, shown with a finding."""
    tally, stop = Tally(), threading.Event()
    sequences = Sequences(seed, settings.page_size, settings.budget_bytes, ids=ids, victims=victims,
                          ack_timeout=settings.ack_timeout)
    probe = fd.StatusProbe(settings.socket_path)
    deadline = time.monotonic() + seconds
    threads = [Client(i, settings, sequences, tally, stop, deadline) for i in range(clients)]
    for t in threads:
        t.start()
    out: dict[str, Any] = {"crashed": False, "frozen": False}
    samples, worst, first = 0, 0, None
    try:
        while any(t.is_alive() for t in threads):
            if not alive():
                out["crashed"] = True
                out["trace_before_the_crash"] = tally.snapshot()
                out["log_before_the_crash"] = log_tail()
                break
            unanswered = probe.unanswered_in_a_row()
            if unanswered and "first_hang_at_s" not in out:
                out["first_hang_at_s"] = round(time.monotonic() - tally.t0 - unanswered * probe.timeout, 1)
                out["trace_before_the_first_hang"] = tally.snapshot()
                out["log_before_the_first_hang"] = log_tail()
            if unanswered >= FROZEN_AFTER:
                out["frozen"] = True
                out["trace_before_the_freeze"] = tally.snapshot()
                out["log_before_the_freeze"] = log_tail()
                break
            report = fd.status(settings.socket_path)
            if report is not None:
                samples += 1
                b = fd.books(report)
                if abs(b["unbooked"]) > abs(worst):
                    worst = b["unbooked"]
                if b["unbooked"] and first is None:
                    first = {"at_s": round(time.monotonic() - tally.t0, 2), "books": b,
                             "trace": tally.snapshot(), "daemon_log": log_tail()}
            time.sleep(BOOKS_EVERY)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
        figures = probe.stop()
    counts = {group: dict(sorted(c.items())) for group, c in sorted(tally.counts.items())}
    out.update({
        "seconds": round(time.monotonic() - tally.t0, 1), **figures,
        "books_checks": samples, "unbooked_pages_max": worst, "first_unbooked": first,
        "grow_answer_max_s": round(tally.grow_wait_max, 3), "counts": counts})
    return out


@contextlib.contextmanager
def _daemon(folder: str, log: IO[bytes], metrics_port: int,
            pythonpath: str | None = None) -> Iterator[subprocess.Popen]:
    """The fuzzed daemon: host pages, ``BUDGET``, the short ``DAEMON_TIMING``.
    ``pythonpath``: another tree's ``kvelastic`` for the daemon (an older one, to see it fail)."""
    sock = os.path.join(folder, "kvelastic.sock")
    env = dict(os.environ, KVELASTIC_SOCKET=sock, KVELASTIC_MEMORY=BUDGET, KVELASTIC_BACKEND="host",
               KVELASTIC_METRICS_PORT=str(metrics_port), KVELASTIC_METRICS_ADDR="127.0.0.1",
               KVELASTIC_LOG_LEVEL="info", **DAEMON_TIMING)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    proc = subprocess.Popen([sys.executable, "-m", "kvelastic", "daemon"], env=env, stdout=log,
                            stderr=subprocess.STDOUT, cwd=pythonpath)    # ``-m`` puts the folder it runs in first
    try:
        deadline = time.monotonic() + 20
        while fd.status(sock, 0.5) is None:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the fuzzed daemon did not start")
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:     # frozen: it reads no signal
                proc.kill()
                proc.wait(10)


def settle(socket_path: str, legit_pages: int, timeout: float) -> tuple[dict[str, int] | None, list[str]]:
    """Wait (up to ``timeout``) until nothing is held but the legitimate
    engine's pages, nothing is kept, quarantined or adopted; the books then,
    and who is still registered."""
    deadline = time.monotonic() + timeout
    b: dict[str, int] | None = None
    engines: list[str] = []
    while True:
        report = fd.status(socket_path)
        if report is not None:
            b = fd.books(report)
            engines = sorted(e.engine_id for e in report.engines)
            if engines == [fd.LEGIT_ID] and b["held"] == legit_pages and not (b["orphaned"] or b["quarantined"]
                                                                                 or b["adopted"]):
                return b, engines
        if time.monotonic() > deadline:
            return b, engines
        time.sleep(0.25)


def _tail(path: str, lines: int = 40) -> list[str]:
    with open(path, "rb") as f:
        f.seek(max(0, os.fstat(f.fileno()).st_size - 16384))
        text = f.read().decode(errors="replace")
    return [line[11:].replace(" kvelastic.daemon:", "") for line in text.splitlines()[-lines:]]


def run(quick: bool = False, seed: int = 0, clients: int | None = None, seconds: float | None = None,
        daemon_pythonpath: str | None = None) -> dict[str, Any]:
    """The sequence section of ``kvelastic bench fuzz``: its own daemon, the
    legitimate engine, ``clients`` clients for ``seconds``, then the checks."""
    clients = clients or (4 if quick else 8)
    seconds = seconds if seconds is not None else (10.0 if quick else 60.0)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    port = fd.free_port()
    ids = max(5, clients)          # a few engine ids for all the clients: each is reused, often at once
    out: dict[str, Any] = {"seed": seed, "clients": clients, "engine_ids": ids,
                           "daemon": {"budget": BUDGET, **DAEMON_TIMING}}
    with tempfile.TemporaryDirectory() as tmp:
        log_path = os.path.join(tmp, "daemon.log")
        with open(log_path, "wb") as log, _daemon(tmp, log, port, daemon_pythonpath) as proc:
            sock = os.path.join(tmp, "kvelastic.sock")
            first = fd.status(sock)
            assert first is not None
            settings = Settings(sock, first.page_size, first.budget_bytes)
            legit = fd.Legit(sock, page_size=first.page_size)
            try:
                rss0 = rss_bytes(proc.pid)
                result = drive(settings, seed, clients, seconds, lambda: proc.poll() is None, victims=(fd.LEGIT_ID,),
                               ids=ids, log_tail=lambda: _tail(log_path))
                out.update(result)
                if not result["crashed"] and not result["frozen"] and all(
                        fd.status(sock) is None for _ in range(FROZEN_AFTER)):
                    out["frozen"] = True              # it stopped answering at the very end
                stuck = out["crashed"] or out["frozen"]
                if not stuck:
                    _, engines = settle(sock, legit.pages_held, settings.ack_timeout + settings.grow_timeout
                                        + ORPHAN_TTL + p.HEARTBEAT_TIMEOUT + 5.0)
                    time.sleep(0.5)                           # stale free pages released, a batch a tick
                    report = fd.status(sock)
                    end = fd.books(report) if report is not None else None
                    if end is not None:
                        out["end"] = {**end, "engines": engines, "legit_pages": legit.pages_held,
                                      "page_handles": fd.page_handles(proc.pid)}
                        # Counted against the budget, yet neither free nor the legitimate engine's.
                        out["pages_lost"] = end["created"] + end["adopted"] - end["free"] - legit.pages_held
                        out["pages_lost_mib"] = round(out["pages_lost"] * settings.page_size / MiB, 1)
                        out["handles_not_in_books"] = out["end"]["page_handles"] - end["created"]
                    out["rss_growth_mib"] = round((rss_bytes(proc.pid) - rss0) / MiB, 1)
                    out["legitimate_engine"] = legit.check()
                stuck = stuck or proc.poll() is not None
            finally:
                legit.close(unregister=proc.poll() is None and not out.get("frozen"))
            out["crashed"] = out["crashed"] or proc.poll() is not None
        out["daemon_log_tracebacks"], first_traceback = fd.tracebacks(log_path)
        if first_traceback:
            out["first_traceback"] = first_traceback
    unbooked = max(abs(out.get("unbooked_pages_max", 0)), abs(out.get("end", {}).get("unbooked", 0)))
    out.setdefault("pages_lost", None)
    out["crashes"] = int(out["crashed"])
    out["hangs"] = out.get("hangs", 0) + int(out["frozen"])
    out["unbooked_pages"] = unbooked
    internal = out["counts"].get("problems", {}).get("internal_errors", 0)
    legit_ok = out.get("legitimate_engine", {}).get("ok", False)
    out["ok"] = (not out["crashes"] and not out["hangs"] and out["pages_lost"] == 0 and not unbooked
                 and not internal and not out["daemon_log_tracebacks"] and legit_ok
                 and not out.get("handles_not_in_books"))
    return out


def _worker_main(socket_path: str, engine_id: str, rank: int, token: str) -> None:
    """A real worker process (``spawn_worker``): it registers, maps and
    acknowledges as vLLM's would, until it is killed."""
    from kvelastic.client.worker import WorkerClient
    from kvelastic.vmm import get_backend

    worker = WorkerClient(get_backend("host"), socket_path=socket_path, engine_id=engine_id, rank=rank,
                          token=bytes.fromhex(token))
    with contextlib.suppress(Exception):
        worker.start(timeout=10)
    threading.Event().wait()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["worker"]:
        _worker_main(args[1], args[2], int(args[3]), args[4])
        return 0
    parser = argparse.ArgumentParser(prog="python -m kvelastic.bench.fuzzseq",
                                     description="the sequence fuzz of kvelastic bench fuzz, one seed")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--clients", type=int, default=None)
    parser.add_argument("--seconds", type=float, default=None)
    parser.add_argument("--daemon-pythonpath", default=None,
                        help="run the daemon from another tree (e.g. an older commit's, to see it fail)")
    ns = parser.parse_args(args)
    print(json.dumps(run(ns.quick, ns.seed, ns.clients, ns.seconds, ns.daemon_pythonpath), sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
