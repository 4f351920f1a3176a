"""The clients of the sequence fuzz (``fuzzseq``): each plays planned
sessions against the daemon.

Each client, a thread, carries out the session plans of
``kvelastic_tools.fuzz.Sequences``: engines registered under a small pool of ids
(reused, often at once), lifelines and page channels with and without the
right secret, workers that acknowledge maps and unmaps on time, late or
never, grows, journals valid and hostile, returns, reclaim answers,
impostors, abrupt exits, and real worker processes killed with SIGKILL.
Values are type-valid and often extreme.

``Session`` plays one plan: it registers, starts its workers, takes its
actions (``do_*``), answers the daemon's commands and ends as planned, over
its ``fuzzwire.SessionWire``. ``Client`` serves all of a client's sessions,
the lingering ones too, from its thread.
"""

from __future__ import annotations

import functools
import os
import random
import signal
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import zmq

from kvelastic import protocol as p
from kvelastic.core.stats import COUNTER_NAMES
from kvelastic_tools.bench.fuzzwire import BUSY, RawWorker, SessionWire, Settings, Tally, hello
from kvelastic_tools.fuzz import Sequences, SessionPlan

DIVERGE = getattr(p, "Diverge", None)    # an engine's weights changed in memory (newer protocols)
REQUESTS = (p.RegisterEngine, p.RegisterWorker, p.Grow, p.Return, p.Unregister, p.Status, p.SetLimit,
            p.Invalidate, *([DIVERGE] if DIVERGE is not None else []))


def _block(block_id: int) -> int:
    """A block id as the wire carries it (msgpack ints end at 64 bits)."""
    return min(block_id, 2**63 - 1)


class Session(SessionWire):
    """One plan carried out: an engine (its DEALER and lifeline), its workers,
    and what they do until it ends and its last socket closes."""

    def __init__(self, client: Client, plan: SessionPlan) -> None:
        super().__init__(client.settings, client.tally, plan)
        self.client = client
        self.bps = int(plan.fields["blocks_per_slab"])
        self.held: list[int] = []
        self.added: set[int] = set()
        self.keys: dict[int, dict[int, bytes]] = {}     # slab -> block -> key
        self.step = self.block_ops = 0
        self.ends_at: float | None = None

    # ------------------------------------------------------------ plumbing
    def call(self, sock: zmq.Socket[bytes] | None, msg: p.Msg, timeout: float) -> p.Msg | None:
        rid = self.send(sock, msg, request=True)
        if not rid:
            return None
        self.client.pump(timeout, until=lambda: rid in self.replies)
        return self.replies.pop(rid, None)

    def pollables(self) -> list[tuple[Any, Callable[[], None]]]:
        if self.closed:
            return []
        out: list[tuple[Any, Callable[[], None]]] = [
            (sock, functools.partial(self.on_engine, sock)) for sock in self.sockets
            if isinstance(sock, zmq.Socket) and not sock.closed and all(sock is not w.dealer for w in self.workers)]
        for w in self.workers:
            out += w.pollables()
        return out

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
            if rng.random() < 0.1:      # next to be evicted, and now and then hit again
                ops.append(p.DemoteBlock(block))
                if rng.random() < 0.3:
                    ops.append(p.PromoteBlock(block))
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
        if DIVERGE is not None:
            msgs.append(DIVERGE(engine_id=target, namespace=rng.choice(("seq-ns-a", "seq-ns-a~x"))))
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

    def do_diverge(self, rng: random.Random) -> None:
        """Its weights changed in memory: a namespace of its own, or (hostile) one in use."""
        if DIVERGE is not None:
            namespace = rng.choice((f"{self.plan.namespace}~{rng.getrandbits(64):x}", self.plan.namespace,
                                    "seq-ns-a", "seq-ns-b"))
            self.send(self.dealer, DIVERGE(engine_id=self.engine_id, namespace=namespace), request=True)

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
        sock = hello(self.settings.socket_path, self.engine_id, -1, rng.choice((self.token, b"", rng.randbytes(16))))
        if sock is not None:
            self.sockets.append(sock)
            self.at(rng.uniform(0.1, 2.0), lambda: self.drop_socket(sock))

    def do_hostile_hello(self, rng: random.Random) -> None:
        """A lifeline or page channel for any engine, with an odd rank, held a while, then closed."""
        target = rng.choice((self.engine_id, self.victim(rng)))
        rank = rng.choice(self.client.sequences.extreme["rank"])
        token = rng.choice((b"", rng.randbytes(16), self.token if target == self.engine_id else b""))
        self.tally.add("hostile_hellos", "rank<-1" if rank < -1 else str(rank) if rank < 2 else "high")
        sock = hello(self.settings.socket_path, target, rank, token)
        if sock is not None:
            self.sockets.append(sock)
            self.at(rng.uniform(0.05, 2.0), lambda: self.drop_socket(sock))

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
