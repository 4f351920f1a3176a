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
import random
from collections import deque

from kvelastic import protocol as p
from kvelastic.daemon import effects as fx
from kvelastic.daemon.allocator import Allocator, Timing
from kvelastic.daemon.orphans import OrphanCache, OrphanSlab
from kvelastic.daemon.state import SlabShape
from kvelastic.sim.engine import BLOCKS_PER_SLAB, KV, SimEngine, SimWorker, Step
from kvelastic.vmm.base import DEFAULT_PAGE_SIZE as PAGE

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
