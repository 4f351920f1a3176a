"""A simulated node: the real ``Allocator`` and real engine-side ``SlabPool``s,
with simulated engines, workers, pages and transports on a fake clock.

The loop's part is played here: effects are performed on a fake device whose
pages remember what KV each block's place holds (which namespace's, of which
key, and whether the step writing it finished), messages travel with random
delays but in order per connection (what ZMQ and AF_UNIX guarantee), and faults
are injected at any step. Everything is driven by one ``random.Random(seed)``,
so a seed replays exactly.

Engines work in numbered model steps, as the vLLM plugin does: a step is
scheduled (blocks allocated, evicting cached ones when free ones run out, and
keyed: ``SlabPool.begin_step``), sealed (``EngineClient.seal_step``: a key
dropped since the daemon last acknowledged the journal is acknowledged before
the step may rewrite its block), run (its blocks' KV written, torn until it
ends) and ended (``SlabPool.end_step``). Whatever an engine adopts with a slab
(handed on by a replica, or kept from a departed engine: the orphaned cache)
is checked against the device: KV of exactly that key, of the taker's
namespace, written whole by a step that finished and not rewritten since, on
pages no other engine maps.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections import deque

from kvelastic import protocol as p
from kvelastic.client.engine import SYNC_BACKOFF, SYNC_TIMEOUT, give_up, wire_key
from kvelastic.core.block import BlockRecord
from kvelastic.core.pool import SlabPool
from kvelastic.daemon import effects as fx
from kvelastic.daemon.allocator import Allocator, Timing
from kvelastic.daemon.orphans import OrphanCache, OrphanSlab
from kvelastic.daemon.state import SlabShape
from kvelastic.vmm.base import DEFAULT_PAGE_SIZE as PAGE

BLOCKS_PER_SLAB = 4
CLIENT_GROW_TIMEOUT = 2.0          # an engine gives up waiting for a grow after this
UNREGISTER_TIMEOUT = 2.0           # an exiting engine waits this long for its Unregister's answer
PROMPTS = 12                       # prompt families per namespace: requests share prefixes
MAX_REQUEST_BLOCKS = 8
WORKERS = (1, 1, 2)                # engine i's workers (its slab shape)


@dataclasses.dataclass
class Envelope:
    due: float
    msg: p.Msg


class Wire:
    """Messages between the daemon and one client identity: FIFO each way."""

    def __init__(self) -> None:
        self.to_daemon: deque[Envelope] = deque()
        self.to_client: deque[Envelope] = deque()


@dataclasses.dataclass(eq=False)
class KV:
    """What one block's place in a page holds: the KV of ``key`` (None: a
    block not full yet, no key) in ``namespace``, written by ``writer`` in its
    model step ``step``; ``complete`` once that step finished (until then the
    place is torn: a kill -9 leaves it so)."""

    namespace: str
    writer: str
    key: bytes | None
    step: int
    complete: bool = False


class Device:
    """Fake physical pages: ``content[page]`` is the engine (and its namespace)
    that last wrote it; ``kv[(page, offset)]`` what block ``offset`` of the slab
    the page lies in holds (each worker's page of a slab holds its share of
    every block of it)."""

    def __init__(self) -> None:
        self.pages: set[int] = set()
        self.content: dict[int, tuple[str, str]] = {}
        self.kv: dict[tuple[int, int], KV] = {}
        self.fail_creation = False

    def forget(self, page: int) -> None:
        self.content.pop(page, None)
        for offset in range(BLOCKS_PER_SLAB):
            self.kv.pop((page, offset), None)


@dataclasses.dataclass
class SimWorker:
    rank: int
    identity: bytes
    mapped: dict[int, list[int]] = dataclasses.field(default_factory=dict)   # slab -> pages
    channel: deque = dataclasses.field(default_factory=deque)                  # page ids sent, not yet taken
    stuck_until: float = 0.0          # withholds every answer until then (a hung worker)
    token: bytes = b""                # the secret its page channel showed
    deferred: list = dataclasses.field(default_factory=list)                   # unmaps waiting for the step
    registered: bool = False


@dataclasses.dataclass(eq=False)
class Request:
    """A running request: its blocks in order, the first ``keyed`` of them full
    and keyed (key ``i`` names the KV of prompt ``prompt`` up to block ``i``)."""

    prompt: int
    blocks: list[BlockRecord]
    keyed: int


@dataclasses.dataclass(eq=False)
class Step:
    """A model step: scheduled, then (sealed and) running, then ended."""

    n: int
    writes: list[tuple[BlockRecord, bytes | None]]     # the blocks it writes, with their keys
    sync_req: int = 0                # sealing: the sync journal whose Ok it waits for
    sync_sent: float = 0.0
    running: bool = False
    torn: list[tuple[tuple[int, int], KV]] = dataclasses.field(default_factory=list)   # written, not complete


class SimEngine:
    def __init__(self, world: World, name: str, workers: int, demand_share: float) -> None:
        self.world = world
        self.name = name
        # Two namespaces (engines alternate; one may come back in the other):
        # cached slabs change hands within one only.
        self.namespace = f"ns{int(name.lstrip('e') or 0) % 2}"
        self.incarnation = 0
        self.pool = SlabPool(BLOCKS_PER_SLAB, block_size=16)
        self.workers = [SimWorker(r, b"") for r in range(workers)]
        self.live: list[Request] = []         # running requests
        self.pending: dict[int, tuple[float, bool]] = {}   # Grow req_id -> (sent at, demand)
        self.alive = False
        self.dying = False                     # a worker died: the engine follows it shortly (as vLLM does)
        self.registered = False
        self.step: Step | None = None          # a model step in flight: unmaps wait for its end
        self.demand_share = demand_share
        self.next_req = 0
        self.token = b""                       # its secret, from its first registration
        self.identity = b""
        self.max_slabs = 0
        # The seal (as EngineClient.seal_step): the daemon keeps departed
        # engines' cache, so a dropped key is acknowledged before a step runs.
        self.orphan_ttl = 0.0
        self.removal_unacked = False
        self.sync_failed_at = -1e9
        self.leaving = 0                       # the Unregister it waits for (a graceful exit)
        self.leave_sent = 0.0

    @property
    def stepping(self) -> bool:
        return self.step is not None

    # ------------------------------------------------------------- lifecycle
    def start(self, held: list[int] | None = None) -> None:
        self.incarnation += 1
        self.alive = True
        self.identity = f"E:{self.name}:{self.incarnation}".encode()
        if self.step is not None and self.step.sync_req:
            self.sync_answered(ok=False)     # the connection it waited on is gone: the call fails
        self.world.connect(self.identity)
        self.world.open_peer(self, -1)
        self.send(p.RegisterEngine(version=p.PROTOCOL_VERSION, engine_id=self.name, pid=1000 + self.incarnation,
                                   namespace=self.namespace, page_size=PAGE, pages_per_worker=1,
                                   num_workers=len(self.workers),
                                   blocks_per_slab=BLOCKS_PER_SLAB, block_bytes=PAGE // BLOCKS_PER_SLAB,
                                   held=self.pool.slab_ids() if held is None else held,
                                   occupancy=self.pool.occupancies(), token=self.token))
        if self.pool.slab_ids():     # as the real client: a new daemon gets the step state, then the whole index
            self.pool.take_journal()
            ops = [p.ClearKeys(), *p.journal_ops(self.pool.journal.resync())]
            ops += [p.StoreKey(key=wire_key(key), block=block) for key, block in self.pool.cached_keys()]
            self.removal_unacked = False       # every drop so far is in what this sends
            self.world.client_send(self.identity, p.Journal(engine_id=self.name, ops=ops,
                                                            occupancy=self.pool.occupancies()))
        if self.token:               # workers know the secret already (a reconnect); else they wait for it
            for w in self.workers:
                self.start_worker(w)

    def start_worker(self, w: SimWorker) -> None:
        w.identity = f"W:{self.name}:{w.rank}:{self.incarnation}:{self.world.rng.random():.6f}".encode()
        w.stuck_until, w.deferred, w.registered = 0.0, [], False
        w.channel.clear()                      # a new connection: what the old one carried is gone
        w.token = self.token
        self.world.connect(w.identity)
        self.world.open_peer(self, w.rank, w.token)
        self.world.client_send(w.identity, p.RegisterWorker(version=p.PROTOCOL_VERSION, engine_id=self.name,
                                                            rank=w.rank, pid=2000 + w.rank, mapped=sorted(w.mapped),
                                                            token=w.token))

    def kill_worker(self, w: SimWorker) -> None:
        """One worker dies (kill -9, OOM): its mappings vanish; the engine is
        doomed (a step in flight never ends: the others wait on the dead one)."""
        self.dying = True
        w.mapped.clear()                       # the process is gone, then its sockets close
        w.channel.clear()
        if w.identity in self.world.wires:
            self.world.close(w.identity)
            self.world.close_peer(self, w.rank, w.token)

    def disconnect(self) -> None:
        """Close every connection still open (a dead worker's already is)."""
        for identity, rank, token in [(self.identity, -1, b"")] + [(w.identity, w.rank, w.token)
                                                                   for w in self.workers]:
            if identity in self.world.wires:
                self.world.close(identity)
                self.world.close_peer(self, rank, token)

    def crash(self) -> None:
        """kill -9 of the engine and its workers: every connection closes, mappings
        vanish, and what a step in flight was writing stays torn."""
        self.alive = self.registered = self.dying = False
        for w in self.workers:                 # the processes are gone, then their sockets close
            w.mapped.clear()
            w.channel.clear()
            w.deferred = []
        self.disconnect()
        self.token = b""                       # a new process registers afresh
        self.pool = SlabPool(BLOCKS_PER_SLAB, block_size=16)
        self.live.clear()
        self.pending.clear()
        self.step = None
        self.removal_unacked, self.sync_failed_at, self.leaving = False, -1e9, 0

    def leave(self) -> None:
        """A graceful exit between steps (as ``EngineClient.close``): the last
        steps' completions first, then Unregister; the processes exit once it
        is answered (or after a while). Its requests end: their full blocks
        stay cached, for the daemon to keep."""
        for req in self.live:
            self.pool.free(req.blocks[::-1])
        self.live.clear()
        self.flush_journal()
        self.leaving = self.send(p.Unregister(engine_id=self.name))
        self.leave_sent = self.world.now

    def gone(self) -> None:
        """The exiting engine's processes are gone; it comes back later."""
        self.crash()
        self.world.restart_at[self.name] = self.world.now + self.world.rng.uniform(0.1, 2.0)

    def reconnect(self, held: list[int] | None = None) -> None:
        """The daemon went away: re-register with what the pool holds (adoption);
        ``held``: a corrupted list instead (a buggy or hostile client)."""
        self.registered = False
        self.pending.clear()
        self.start(held)

    def send_bad_journal(self, rng: random.Random) -> None:
        """A hostile journal: a plausible STORE for a block it holds, then one
        for a block of a slab it does not hold."""
        slabs = self.pool.slab_ids()
        if slabs:
            block = rng.choice(slabs) * BLOCKS_PER_SLAB
            ops: list[p.JournalOp] = [p.StoreKey(key=b"forged", block=block),
                                      p.StoreKey(key=b"forged", block=10**6)]
            self.world.client_send(self.identity, p.Journal(engine_id=self.name, ops=ops, occupancy={}))

    # ------------------------------------------------------------- messages
    def send(self, msg: p.Msg) -> int:
        self.next_req += 1
        msg.req_id = self.next_req
        self.world.client_send(self.identity, msg)
        return self.next_req

    def flush_journal(self) -> None:
        batch = self.pool.take_journal()
        self.removal_unacked |= batch.removed
        if batch:
            self.world.client_send(self.identity, p.Journal(engine_id=self.name, ops=p.journal_ops(batch.ops),
                                                            occupancy=batch.occupancy,
                                                            stats={"block_ops": self.pool.stats.block_ops}))

    def on_message(self, msg: p.Msg) -> None:
        step = self.step
        if step is not None and step.sync_req and msg.req_id == step.sync_req and isinstance(msg, (p.Ok, p.Error)):
            self.sync_answered(ok=isinstance(msg, p.Ok))
            return
        if self.leaving and msg.req_id == self.leaving and isinstance(msg, (p.Ok, p.Error)):
            self.gone()
            return
        if isinstance(msg, p.Registered):
            first = not self.token
            self.registered, self.max_slabs, self.token = True, msg.max_slabs, msg.token
            self.orphan_ttl = msg.orphan_ttl
            self.sync_failed_at = -1e9         # as the client: this daemon answers seals
            if first:                          # its workers get the secret now (vLLM: with the KV config)
                for w in self.workers:
                    self.start_worker(w)
            return
        if isinstance(msg, p.Error) and msg.reason == p.Reason.BAD_ADOPTION.value:
            if not self.dying:                   # refused: reconnect and register what it really holds
                self.disconnect()
                self.start()
            return
        if isinstance(msg, (p.Granted, p.Error)) and msg.req_id in self.pending:
            del self.pending[msg.req_id]
        if isinstance(msg, p.Granted):
            for slab_id in msg.slabs:
                if slab_id not in self.pool.slab_ids():
                    self.pool.add_slab(slab_id)
                    if not self.dying and not self.leaving:
                        self.world.check_slab_mapped(self, slab_id)
                        if msg.cached.get(slab_id):
                            self.world.check_adoption(self, slab_id, msg.cached[slab_id])
                            self.pool.adopt(slab_id, [(c.offset, c.key) for c in msg.cached[slab_id]])
        elif isinstance(msg, p.Reclaim):
            given, refused, cached = give_up(self.pool, msg.slabs)
            self.flush_journal()
            self.world.client_send(self.identity, p.ReclaimDone(req_id=msg.req_id, engine_id=self.name,
                                                                given=given, refused=refused, cached=cached))

    def on_worker_message(self, w: SimWorker, msg: p.Msg) -> None:
        if isinstance(msg, p.Registered):
            w.registered = True
        elif isinstance(msg, p.Error) and not w.registered:   # its engine is not registered yet: retry
            self.world.client_send(w.identity, p.RegisterWorker(version=p.PROTOCOL_VERSION, engine_id=self.name,
                                                                rank=w.rank, pid=2000 + w.rank,
                                                                mapped=sorted(w.mapped)))
        elif isinstance(msg, p.MapSlab):
            pages = [page for page, _offset in msg.pages]
            if any(page not in w.channel for page in pages):
                self.world.violation(f"engine {self.name}: MapSlab names pages that never came on the channel")
            for page in pages:
                if page in w.channel:
                    w.channel.remove(page)
            for page in pages:
                wrote = self.world.device.content.get(page)
                if wrote is not None and wrote[1] != self.namespace:
                    self.world.violation(f"engine {self.name} ({self.namespace}) mapped page {page} holding "
                                         f"{wrote[0]}'s data (namespace {wrote[1]})")
            w.mapped[msg.slab] = pages
            self.world.client_send(w.identity, p.Mapped(req_id=msg.req_id, engine_id=self.name, rank=w.rank,
                                                        slab=msg.slab))
        elif isinstance(msg, p.UnmapSlab):
            if self.stepping:
                w.deferred.append(msg)
            else:
                self.unmap(w, msg)

    def unmap(self, w: SimWorker, msg: p.UnmapSlab) -> None:
        occupancy = self.pool.occupancy(msg.slab)     # None: a slab the pool does not hold
        if not self.dying and occupancy is not None and occupancy[0]:
            self.world.violation(f"engine {self.name}: slab {msg.slab} unmapped under a live block")
        w.mapped.pop(msg.slab, None)
        self.world.client_send(w.identity, p.Unmapped(req_id=msg.req_id, engine_id=self.name, rank=w.rank,
                                                      slab=msg.slab))

    # ------------------------------------------------------------- workload
    def work(self, rng: random.Random, now: float) -> None:
        """One thing the engine does: between steps the scheduler schedules
        one or ends requests; any time the I/O thread ships the journal or
        returns an idle slab."""
        if not self.registered or self.dying or self.leaving:
            return
        op = rng.random()
        if self.step is None and op < 0.5:
            self.schedule_step(rng)
        elif self.step is None and op < 0.75 and self.live:
            req = self.live.pop(rng.randrange(len(self.live)))
            self.pool.free(req.blocks[::-1])   # the tail first: it is evicted first
        elif 0.8 <= op < 0.9:
            idle = self.pool.idle_slabs()
            if idle:
                slab_id = rng.choice(idle)
                self.pool.take_slab_back(slab_id, reason="return")
                self.flush_journal()
                self.send(p.Return(engine_id=self.name, slabs=[slab_id]))
        elif op >= 0.9:
            self.flush_journal()
        self.expire_grows(now)

    def key(self, prompt: int, i: int) -> bytes:
        return f"{self.namespace}:{prompt}:{i}".encode()

    def schedule_step(self, rng: random.Random) -> None:
        """Schedule a model step: a new request (its prefix hits, the rest
        allocated, the full blocks keyed) or one more block of a running one.
        Allocating evicts cached blocks when free ones run out: the step then
        rewrites them. Short of blocks, it asks the daemon instead."""
        pool = self.pool
        growing = [r for r in self.live if len(r.blocks) < MAX_REQUEST_BLOCKS or r.keyed < len(r.blocks)]
        if growing and rng.random() < 0.4:
            req = rng.choice(growing)
            if req.keyed < len(req.blocks):            # its last block fills up: keyed now, written by the step
                n = pool.begin_step()
                blk, key = req.blocks[-1], self.key(req.prompt, req.keyed)
                pool.cache([blk], [key])
                req.keyed += 1
                writes: list[tuple[BlockRecord, bytes | None]] = [(blk, key)]
            else:
                if pool.num_available < 1:
                    self.grow(1, demand=rng.random() < self.demand_share)
                    return
                n = pool.begin_step()
                blk = pool.allocate(1)[0]
                req.blocks.append(blk)
                writes = [(blk, None)]
        else:
            prompt, length = rng.randrange(PROMPTS), rng.randint(1, 6)
            keys = [self.key(prompt, i) for i in range(length)]
            hits = pool.lookup(keys[:length - 1])      # the last block is computed, never hit (as vLLM)
            need = length - len(hits)
            short = need - (pool.num_available - sum(1 for blk in hits if not blk.ref_cnt))
            if short > 0:
                self.grow(math.ceil(short / BLOCKS_PER_SLAB), demand=rng.random() < self.demand_share)
                return
            n = pool.begin_step()
            pool.touch(hits)
            new = pool.allocate(need)
            full = need if rng.random() < 0.5 else need - 1
            if full:
                pool.cache(new[:full], keys[len(hits):len(hits) + full])
            self.live.append(Request(prompt, hits + new, len(hits) + full))
            writes = [(blk, keys[len(hits) + i] if i < full else None) for i, blk in enumerate(new)]
        self.step = Step(n, writes)
        if self.needs_seal():
            self.seal()
        else:
            self.run_step()

    def needs_seal(self) -> bool:
        """``EngineClient.seal_step``'s rule: the daemon keeps departed engines'
        cache and a dropped key is not acknowledged yet (not while there is no
        daemon, nor for a while after a sync failed)."""
        return bool(self.orphan_ttl) and (self.removal_unacked or self.pool.journal.removed) \
            and self.registered and self.world.now - self.sync_failed_at >= SYNC_BACKOFF

    def seal(self) -> None:
        """Ship the journal with ``sync``: the step runs once the daemon's Ok is back."""
        step = self.step
        if step is None:
            return
        batch = self.pool.take_journal()
        self.removal_unacked |= batch.removed
        step.sync_req = self.send(p.Journal(engine_id=self.name, ops=p.journal_ops(batch.ops),
                                            occupancy=batch.occupancy,
                                            stats={"block_ops": self.pool.stats.block_ops}, sync=True))
        step.sync_sent = self.world.now

    def sync_answered(self, ok: bool) -> None:
        """The seal's answer: Ok (every journal before it applied), or a failure
        (an error, no answer in time, the connection lost): the step runs anyway."""
        if ok:
            self.removal_unacked = False
        else:
            self.sync_failed_at = self.world.now
        if self.step is not None:
            self.step.sync_req = 0
            self.run_step()

    def run_step(self) -> None:
        """The model writes the step's blocks into every worker's pages: torn
        until the step ends."""
        step = self.step
        if step is None:
            return
        step.running = True
        world = self.world
        world.check_rewrite(self, step)
        kv, content = world.device.kv, world.device.content
        for blk, key in step.writes:
            slab_id, offset = divmod(blk.block_id, BLOCKS_PER_SLAB)
            for w in self.workers:
                pages = w.mapped.get(slab_id)
                if pages is None:             # a dead worker's (its engine is dying) writes nothing
                    if not self.dying:
                        world.violation(f"engine {self.name}: block {blk.block_id} live on an unmapped slab")
                    continue
                for page in pages:
                    written = KV(self.namespace, self.name, key, step.n)
                    kv[(page, offset)] = written
                    content[page] = (self.name, self.namespace)
                    step.torn.append(((page, offset), written))

    def advance_step(self, rng: random.Random) -> None:
        """The step in flight: a seal that waited too long gives up; a running
        step ends (not on a dying engine: it waits on its dead worker)."""
        step = self.step
        if step is None:
            return
        if step.sync_req:
            if self.world.now - step.sync_sent > SYNC_TIMEOUT:
                self.sync_answered(ok=False)
        elif not self.dying and rng.random() < 0.5:
            self.finish_step()

    def finish_step(self) -> None:
        """The running step ends: its KV is whole, the pool hears it, and the
        unmaps deferred during it run (a safe point)."""
        step = self.step
        if step is None or not step.running:
            return
        kv = self.world.device.kv
        for where, written in step.torn:
            if kv.get(where) is written:
                written.complete = True
        self.step = None
        self.pool.end_step(step.n)
        for w in self.workers:
            deferred, w.deferred = w.deferred, []
            for msg in deferred:
                self.unmap(w, msg)

    def expire_leave(self, now: float) -> None:
        if self.leaving and now - self.leave_sent > UNREGISTER_TIMEOUT:
            self.gone()

    def grow(self, slabs: int, demand: bool) -> None:
        if len(self.pending) < 3 and self.pool.num_slabs + slabs <= max(self.max_slabs, 1):
            req = self.send(p.Grow(engine_id=self.name, slabs=min(slabs, 4), demand=demand))
            self.pending[req] = (self.world.now, demand)

    def expire_grows(self, now: float) -> None:
        """The client gives up waiting (a late answer is then applied as it comes)."""
        for req, (sent, _demand) in list(self.pending.items()):
            if now - sent > CLIENT_GROW_TIMEOUT:
                del self.pending[req]


class WatchedOrphans(OrphanCache):
    """The allocator's orphaned cache, watched by the world: every slab kept
    is checked against the device at once, and the pages of slabs taken are
    remembered so that their adoption counts as a warm start."""

    def __init__(self, world: World) -> None:
        super().__init__()
        self.world = world

    def keep(self, slab: OrphanSlab) -> None:
        self.world.check_kept(slab)
        super().keep(slab)

    def take(self, namespace: str, shape: SlabShape, n: int) -> list[OrphanSlab]:
        taken = super().take(namespace, shape, n)
        for slab in taken:
            self.world.from_orphans.update(slab.pages)
        return taken


class World:
    def __init__(self, seed: int, engines: int = 3, budget_pages: int = 24, timing: Timing = Timing()) -> None:
        self.rng = random.Random(seed)
        self.seed = seed
        self.now = 0.0
        self.timing = timing
        self.budget_pages = budget_pages
        self.device = Device()
        self.handed_blocks = 0     # cached blocks adopted with slabs handed on by a live replica
        self.orphan_blocks = 0     # cached blocks adopted from the orphaned cache (a warm start)
        self.kept_blocks = 0       # cached blocks of departed engines kept for their namespace
        self.from_orphans: set[int] = set()      # pages of orphaned slabs taken, not granted yet
        self.restart_at: dict[str, float] = {}   # engines that left -> when they come back
        self.wires: dict[bytes, Wire] = {}
        self.violations: list[str] = []
        self.allocator = self._new_allocator()
        # Namespaces alternate (an engine may come back in the other one): e0 and
        # e1 have one slab shape in two namespaces, so what either leaves is in
        # reach of the other's grows; e2 has two workers.
        self.engines = [SimEngine(self, f"e{i}", workers=WORKERS[i % len(WORKERS)], demand_share=0.5)
                        for i in range(engines)]
        self.peer_count: dict[tuple[str, int], int] = {}
        self.grow_sent: dict[tuple[bytes, int], float] = {}
        self.daemon_epoch = 0
        self.stopped = False       # the daemon exited: its successor is not up yet

    def _new_allocator(self) -> Allocator:
        allocator = Allocator({"0": self.budget_pages}, PAGE, timing=self.timing, events=False,
                              token_source=lambda: self.rng.randbytes(16))
        # Page ids of a restarted daemon must not collide with pages still mapped.
        allocator._next_page = 1_000_000 * getattr(self, "daemon_epoch", 0)
        allocator.orphans = WatchedOrphans(self)
        return allocator

    # ------------------------------------------------------------ transport
    def connect(self, identity: bytes) -> None:
        self.wires[identity] = Wire()

    def close(self, identity: bytes) -> None:
        self.wires.pop(identity, None)

    def delay(self) -> float:
        r = self.rng.random()
        return 0.0005 if r < 0.8 else self.rng.uniform(0.001, 0.3)   # mostly fast, sometimes slow

    def client_send(self, identity: bytes, msg: p.Msg) -> None:
        wire = self.wires.get(identity)
        if wire is not None:
            wire.to_daemon.append(Envelope(self.now + self.delay(), msg))
            if isinstance(msg, p.Grow):
                self.grow_sent[(identity, msg.req_id)] = self.now

    def open_peer(self, engine: SimEngine, rank: int, token: bytes = b"") -> None:
        if not self.stopped:
            self.perform(self.allocator.peer_opened(engine.name, rank, self.now, token))

    def close_peer(self, engine: SimEngine, rank: int, token: bytes = b"") -> None:
        if not self.stopped:               # a daemon that exited hears nothing more
            self.perform(self.allocator.peer_closed(engine.name, rank, self.now, token))

    # -------------------------------------------------------------- effects
    def perform(self, effects: list[fx.Effect]) -> None:
        queue = deque(effects)
        while queue:
            e = queue.popleft()
            if isinstance(e, fx.Send):
                wire = self.wires.get(e.to)
                if wire is not None:
                    wire.to_client.append(Envelope(self.now + self.delay(), e.msg))
                if isinstance(e.msg, (p.Granted, p.Error)):
                    self.grow_sent.pop((e.to, e.msg.req_id), None)
            elif isinstance(e, fx.SendPages):
                worker = self.find_worker(e.engine_id, e.rank)
                if worker is not None and worker.token != e.token:
                    worker = None
                if worker is None:
                    queue.extend(self.allocator.channel_failed(e.engine_id, e.rank, "gone", self.now))
                else:
                    worker.channel.extend(e.pages)
            elif isinstance(e, fx.CreatePages):
                ids = self.allocator.new_page_ids(e.count)
                made = [] if self.device.fail_creation else ids
                self.device.pages.update(made)
                queue.extend(self.allocator.pages_created(e.device, e.count, made, self.now))
            elif isinstance(e, fx.ReleasePages):
                for page in e.pages:
                    self.device.pages.discard(page)
                    if not any(page in pages for eng in self.engines for w in eng.workers
                               for pages in w.mapped.values()):
                        self.device.forget(page)

    def find_worker(self, engine_id: str, rank: int) -> SimWorker | None:
        for engine in self.engines:
            if engine.name == engine_id and engine.alive:
                return engine.workers[rank]
        return None

    # ---------------------------------------------------------------- steps
    def deliver(self) -> bool:
        """Deliver every message that is due, in order per connection."""
        moved = False
        for identity, wire in list(self.wires.items()):
            while wire.to_daemon and wire.to_daemon[0].due <= self.now:
                self.perform(self.allocator.handle(identity, wire.to_daemon.popleft().msg, self.now))
                moved = True
            engine, worker = self.owner_of(identity)
            while identity in self.wires and wire.to_client and wire.to_client[0].due <= self.now:
                if worker is not None and worker.stuck_until > self.now:
                    break
                msg = wire.to_client.popleft().msg
                moved = True
                if engine is not None and worker is not None:     # a worker's engine is found with it
                    engine.on_worker_message(worker, msg)
                elif engine is not None:
                    engine.on_message(msg)
        return moved

    def owner_of(self, identity: bytes) -> tuple[SimEngine | None, SimWorker | None]:
        for engine in self.engines:
            if identity == engine.identity:
                return engine, None
            for w in engine.workers:
                if identity == w.identity:
                    return engine, w
        return None, None

    def restart_daemon(self, corrupt: SimEngine | None = None) -> None:
        """SIGTERM and a new daemon: nothing is unmapped; engines reconnect and adopt.
        What the old daemon sent before it exited still reaches the clients."""
        self.perform(self.allocator.shutdown())
        self.stopped = True
        for identity, wire in list(self.wires.items()):
            engine, worker = self.owner_of(identity)
            while wire.to_client and identity in self.wires:
                msg = wire.to_client.popleft().msg
                if engine is not None and worker is not None:     # a worker's engine is found with it
                    engine.on_worker_message(worker, msg)
                elif engine is not None:
                    engine.on_message(msg)
        self.stopped = False
        self.daemon_epoch += 1
        self.allocator = self._new_allocator()
        self.grow_sent.clear()
        for engine in self.engines:
            if engine.alive:
                for w in engine.workers:
                    self.close(w.identity)
                self.close(engine.identity)
                if engine.leaving:            # its Unregister went with the daemon: it just exits
                    engine.gone()
                    continue
                held = engine.pool.slab_ids()
                engine.reconnect(held + held[:1] if engine is corrupt and held else None)

    def violation(self, what: str) -> None:
        self.violations.append(f"t={self.now:.3f} {what}")

    def check_adoption(self, engine: SimEngine, slab_id: int, cached: list[p.CachedBlock]) -> None:
        """Blocks adopted with a granted slab (handed on by a live replica, or
        kept from a departed engine): each one's place in every page holds KV
        of exactly that key, of the taker's namespace, written whole by a step
        that finished and not rewritten since; and no other engine maps those
        pages (an adopted block is never live elsewhere)."""
        pages = [page for w in engine.workers for page in w.mapped.get(slab_id, [])]
        if any(page in self.from_orphans for page in pages):
            self.orphan_blocks += len(cached)
            self.from_orphans.difference_update(pages)
        else:
            self.handed_blocks += len(cached)
        for c in cached:
            if c.key.split(b":", 1)[0] != engine.namespace.encode():
                self.violation(f"engine {engine.name} ({engine.namespace}) adopted block {c.key!r} of another "
                               "namespace")
            for page in pages:
                self.check_block(f"engine {engine.name} ({engine.namespace}) adopted slab {slab_id}:",
                                 engine.namespace, page, c)
        for page in pages:
            for other in self.engines:
                if other is not engine and any(page in mapped for ow in other.workers
                                               for mapped in ow.mapped.values()):
                    self.violation(f"engine {engine.name}: adopted page {page} still mapped by {other.name}")

    def check_kept(self, slab: OrphanSlab) -> None:
        """A departed engine's slab kept as cache of its namespace: unmapped
        everywhere, and every block it keeps valid (as an adoption needs it)."""
        self.kept_blocks += len(slab.cached)
        for page in slab.pages:
            for other in self.engines:
                if any(page in mapped for w in other.workers for mapped in w.mapped.values()):
                    self.violation(f"orphaned page {page} of {slab.engine_id} still mapped by {other.name}")
            for c in slab.cached:
                self.check_block(f"slab of {slab.engine_id} kept for {slab.namespace}:", slab.namespace, page, c)

    def check_block(self, what: str, namespace: str, page: int, c: p.CachedBlock) -> None:
        kv = self.device.kv.get((page, c.offset))
        if kv is None:
            self.violation(f"{what} block {c.offset} ({c.key!r}) of page {page} holds no KV")
        elif kv.namespace != namespace:
            self.violation(f"{what} block {c.offset} ({c.key!r}) of page {page} holds KV of namespace "
                           f"{kv.namespace} (by {kv.writer})")
        elif kv.key != c.key:
            self.violation(f"{what} block {c.offset} of page {page} holds KV of {kv.key!r}, not {c.key!r} "
                           f"(rewritten by {kv.writer} in its step {kv.step})")
        elif not kv.complete:
            self.violation(f"{what} block {c.offset} ({c.key!r}) of page {page} is torn: {kv.writer}'s step "
                           f"{kv.step} writing it never finished")

    def check_rewrite(self, engine: SimEngine, step: Step) -> None:
        """A step starts writing its blocks: the daemon must hold none of them
        as valid cache of this engine (the seal made it hear every key dropped
        before the step runs; a key stored for this step is valid only once it
        ended), or a kill -9 now would leave it a torn block to keep."""
        alloc = self.allocator
        record = alloc.engines.get(engine.name) or alloc.departing.get(engine.name)   # dropped, still stepping
        if record is None or record.identity != engine.identity or record.failed:
            return
        for blk, _key in step.writes:
            slab_id, offset = divmod(blk.block_id, BLOCKS_PER_SLAB)
            for at, key in record.mirror.valid_in(slab_id, record.blocks_per_slab):
                if at == offset:
                    self.violation(f"engine {engine.name}: step {step.n} writes block {blk.block_id}, which "
                                   f"the daemon holds as valid cache of {key!r}")

    def check_slab_mapped(self, engine: SimEngine, slab_id: int) -> None:
        for w in engine.workers:
            if slab_id not in w.mapped:
                self.violation(f"engine {engine.name}: slab {slab_id} granted before worker {w.rank} mapped it")
