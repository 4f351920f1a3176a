"""A simulated node: the real ``Allocator`` and real engine-side ``SlabPool``s,
with simulated engines, workers, pages and transports on a fake clock.

The loop's part is played here: effects are performed on a fake device whose
pages remember who last wrote them, messages travel with random delays but in
order per connection (what ZMQ and AF_UNIX guarantee), and faults are
injected at any step. Everything is driven by one ``random.Random(seed)``, so a
seed replays exactly.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections import deque

from kvelastic import protocol as p
from kvelastic.client.engine import give_up, wire_key
from kvelastic.core.pool import SlabPool
from kvelastic.daemon import effects as fx
from kvelastic.daemon.allocator import Allocator, Timing
from kvelastic.vmm.base import DEFAULT_PAGE_SIZE as PAGE

BLOCKS_PER_SLAB = 4
CLIENT_GROW_TIMEOUT = 2.0          # an engine gives up waiting for a grow after this


@dataclasses.dataclass
class Envelope:
    due: float
    msg: p.Msg


class Wire:
    """Messages between the daemon and one client identity: FIFO each way."""

    def __init__(self) -> None:
        self.to_daemon: deque[Envelope] = deque()
        self.to_client: deque[Envelope] = deque()


class Device:
    """Fake physical pages: ``content[page]`` is the engine that last wrote it."""

    def __init__(self) -> None:
        self.pages: set[int] = set()
        self.content: dict[int, str] = {}
        self.fail_creation = False


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


class SimEngine:
    def __init__(self, world: World, name: str, workers: int, demand_share: float) -> None:
        self.world = world
        self.name = name
        # Two namespaces (engines alternate): cached slabs are handed on within one only.
        self.namespace = f"ns{int(name.lstrip('e') or 0) % 2}"
        self.incarnation = 0
        self.pool = SlabPool(BLOCKS_PER_SLAB, block_size=16)
        self.workers = [SimWorker(r, b"") for r in range(workers)]
        self.live: list = []                   # allocated blocks (lists) of running "requests"
        self.pending: dict[int, tuple[float, bool]] = {}   # Grow req_id -> (sent at, demand)
        self.alive = False
        self.dying = False                     # a worker died: the engine follows it shortly (as vLLM does)
        self.registered = False
        self.stepping = False                  # a model step in flight: unmaps wait for its end
        self.demand_share = demand_share
        self.next_req = 0
        self.token = b""                       # its secret, from its first registration
        self.identity = b""
        self.max_slabs = 0

    # ------------------------------------------------------------- lifecycle
    def start(self, held: list[int] | None = None) -> None:
        self.incarnation += 1
        self.alive = True
        self.identity = f"E:{self.name}:{self.incarnation}".encode()
        self.world.connect(self.identity)
        self.world.open_peer(self, -1)
        self.send(p.RegisterEngine(version=p.PROTOCOL_VERSION, engine_id=self.name, pid=1000 + self.incarnation,
                                   namespace=self.namespace, page_size=PAGE, pages_per_worker=1,
                                   num_workers=len(self.workers),
                                   blocks_per_slab=BLOCKS_PER_SLAB, block_bytes=PAGE // BLOCKS_PER_SLAB,
                                   held=self.pool.slab_ids() if held is None else held,
                                   occupancy=self.pool.occupancies(), token=self.token))
        if self.pool.slab_ids():     # as the real client: a new daemon gets the whole index
            self.pool.take_journal()
            self.world.client_send(self.identity, p.Journal(
                engine_id=self.name,
                ops=[p.StoreKey(key=wire_key(key), block=block) for key, block in self.pool.cached_keys()],
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
        """One worker dies (kill -9, OOM): its mappings vanish; the engine is doomed."""
        self.dying = True
        if w.identity in self.world.wires:
            self.world.close(w.identity)
            self.world.close_peer(self, w.rank, w.token)
        w.mapped.clear()
        w.channel.clear()

    def disconnect(self) -> None:
        """Close every connection still open (a dead worker's already is)."""
        for identity, rank, token in [(self.identity, -1, b"")] + [(w.identity, w.rank, w.token)
                                                                   for w in self.workers]:
            if identity in self.world.wires:
                self.world.close(identity)
                self.world.close_peer(self, rank, token)

    def crash(self) -> None:
        """kill -9 of the engine and its workers: every connection closes, mappings vanish."""
        self.alive = self.registered = self.dying = False
        self.disconnect()
        self.token = b""                       # a new process registers afresh
        for w in self.workers:
            w.mapped.clear()
            w.channel.clear()
        self.pool = SlabPool(BLOCKS_PER_SLAB, block_size=16)
        self.live.clear()
        self.pending.clear()

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
        if batch:
            self.world.client_send(self.identity, p.Journal(engine_id=self.name, ops=p.journal_ops(batch.ops),
                                                            occupancy=batch.occupancy,
                                                            stats={"block_ops": self.pool.stats.block_ops}))

    def on_message(self, msg: p.Msg) -> None:
        if isinstance(msg, p.Registered):
            first = not self.token
            self.registered, self.max_slabs, self.token = True, msg.max_slabs, msg.token
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
                    if not self.dying:
                        self.world.check_slab_mapped(self, slab_id)
                        if msg.cached.get(slab_id):
                            self.world.check_handoff(self, slab_id, msg.cached[slab_id])
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
                owner = self.world.device.content.get(page)
                if owner not in (None, self.name) and self.world.namespace_of(owner) != self.namespace:
                    self.world.violation(f"engine {self.name} mapped page {page} holding {owner}'s data "
                                         "(another namespace)")
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
        """One random pool operation, as a scheduler step would do it."""
        if not self.registered or self.dying:
            return
        pool = self.pool
        op = rng.random()
        if op < 0.45:
            n = rng.randint(1, 6)
            if pool.num_available < n:
                self.grow(math.ceil((n - pool.num_available) / BLOCKS_PER_SLAB),
                          demand=rng.random() < self.demand_share)
                return
            blocks = pool.allocate(n)
            self.live.append(blocks)
            for blk in blocks:                 # the model writes KV into the pages of those blocks
                for w in self.workers:
                    pages = w.mapped.get(blk.block_id // BLOCKS_PER_SLAB)
                    if pages is None:
                        self.world.violation(f"engine {self.name}: block {blk.block_id} live on an unmapped slab")
                        continue
                    for page in pages:
                        self.world.device.content[page] = self.name
        elif op < 0.75 and self.live:
            blocks = self.live.pop(rng.randrange(len(self.live)))
            keys = [f"{self.name}:{rng.randrange(40)}".encode() for _ in blocks]
            if rng.random() < 0.7:
                pool.cache(blocks, keys)
            pool.free(blocks)
        elif op < 0.85:
            hits = pool.lookup([f"{self.name}:{rng.randrange(40)}".encode()])
            if hits:
                pool.touch(hits)
                self.live.append(hits)
        elif op < 0.93:
            idle = pool.idle_slabs()
            if idle:
                slab_id = rng.choice(idle)
                pool.take_slab_back(slab_id, reason="return")
                self.flush_journal()
                self.send(p.Return(engine_id=self.name, slabs=[slab_id]))
        else:
            self.flush_journal()
        self.expire_grows(now)

    def grow(self, slabs: int, demand: bool) -> None:
        if len(self.pending) < 3 and self.pool.num_slabs + slabs <= max(self.max_slabs, 1):
            req = self.send(p.Grow(engine_id=self.name, slabs=min(slabs, 4), demand=demand))
            self.pending[req] = (self.world.now, demand)

    def expire_grows(self, now: float) -> None:
        """The client gives up waiting (a late answer is then applied as it comes)."""
        for req, (sent, _demand) in list(self.pending.items()):
            if now - sent > CLIENT_GROW_TIMEOUT:
                del self.pending[req]


class World:
    def __init__(self, seed: int, engines: int = 3, budget_pages: int = 24, timing: Timing = Timing()) -> None:
        self.rng = random.Random(seed)
        self.seed = seed
        self.now = 0.0
        self.timing = timing
        self.budget_pages = budget_pages
        self.device = Device()
        self.handed_blocks = 0     # cached blocks adopted with slabs handed on (check_handoff)
        self.wires: dict[bytes, Wire] = {}
        self.violations: list[str] = []
        self.allocator = self._new_allocator()
        self.engines = [SimEngine(self, f"e{i}", workers=1 + (i % 2), demand_share=0.5) for i in range(engines)]
        self.peer_count: dict[tuple[str, int], int] = {}
        self.grow_sent: dict[tuple[bytes, int], float] = {}
        self.daemon_epoch = 0

    def _new_allocator(self) -> Allocator:
        allocator = Allocator({"0": self.budget_pages}, PAGE, timing=self.timing, events=False,
                              token_source=lambda: self.rng.randbytes(16))
        # Page ids of a restarted daemon must not collide with pages still mapped.
        allocator._next_page = 1_000_000 * getattr(self, "daemon_epoch", 0)
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
        self.perform(self.allocator.peer_opened(engine.name, rank, self.now, token))

    def close_peer(self, engine: SimEngine, rank: int, token: bytes = b"") -> None:
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
                        self.device.content.pop(page, None)

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
        for identity, wire in list(self.wires.items()):
            engine, worker = self.owner_of(identity)
            while wire.to_client and identity in self.wires:
                msg = wire.to_client.popleft().msg
                if engine is not None and worker is not None:     # a worker's engine is found with it
                    engine.on_worker_message(worker, msg)
                elif engine is not None:
                    engine.on_message(msg)
        self.daemon_epoch += 1
        self.allocator = self._new_allocator()
        self.grow_sent.clear()
        for engine in self.engines:
            if engine.alive:
                for w in engine.workers:
                    self.close(w.identity)
                self.close(engine.identity)
                held = engine.pool.slab_ids()
                engine.reconnect(held + held[:1] if engine is corrupt and held else None)

    def violation(self, what: str) -> None:
        self.violations.append(f"t={self.now:.3f} {what}")

    def namespace_of(self, engine_name: str) -> str:
        return next(e.namespace for e in self.engines if e.name == engine_name)

    def check_handoff(self, engine: SimEngine, slab_id: int, cached: list[p.CachedBlock]) -> None:
        """Blocks handed on with a slab: computed by an engine of the taker's
        namespace, over pages that hold that namespace's KV and that no other
        engine maps any more (an adopted block is never live elsewhere)."""
        self.handed_blocks += len(cached)
        for c in cached:
            origin = c.key.decode().split(":", 1)[0]
            if self.namespace_of(origin) != engine.namespace:
                self.violation(f"engine {engine.name} adopted {origin}'s block across namespaces")
        for w in engine.workers:
            for page in w.mapped.get(slab_id, []):
                writer = self.device.content.get(page)
                if writer is not None and self.namespace_of(writer) != engine.namespace:
                    self.violation(f"engine {engine.name}: adopted slab {slab_id} holds {writer}'s KV")
                for other in self.engines:
                    if other is not engine and any(page in pages for ow in other.workers
                                                   for pages in ow.mapped.values()):
                        self.violation(f"engine {engine.name}: adopted page {page} still mapped by {other.name}")

    def check_slab_mapped(self, engine: SimEngine, slab_id: int) -> None:
        for w in engine.workers:
            if slab_id not in w.mapped:
                self.violation(f"engine {engine.name}: slab {slab_id} granted before worker {w.rank} mapped it")
