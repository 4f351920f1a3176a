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

The daemon restarts (``restart_daemon``): stopped gracefully, killed
between inputs, or killed part-way through an input's effects (``crash``).
A keeper holds the pages it creates and its state file names its kept cache
(``keeper.py``, written where the real loop writes it); its successor takes
back what the file names and the keeper holds, through the real
``saved.adopt`` and ``Allocator.adopt_kept``, and what it adopted is checked
as every kept slab is.

Hostile scenarios: an engine id registered again while workers of
its last registration still run (``ghosts.py``), model steps that outlive the
ack deadline (their workers say ``Busy``; the world tracks every ack a
worker owes, from the command or the last Busy the daemon heard), and
hostile clients (``hostile.py``). Every allocator call is timed
(``guard.py``).

This is the top of the simulator's parts: the engines, ghosts and hostile
clients are handed the world and see it through ``Protocol``s that ``World``
fits (``engine.EngineWorld``, ``ports.WorkerWorld``, ``hostile.HostileWorld``),
and the records they all share are in ``records.py``; none of them imports
this module.
"""

from __future__ import annotations

import collections
import dataclasses
import random
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

from kvelastic import protocol as p
from kvelastic.daemon import effects as fx
from kvelastic.daemon.allocator import Allocator
from kvelastic.daemon.orphans import OrphanCache, OrphanSlab
from kvelastic.daemon.requests import Timing
from kvelastic.daemon.state import EngineRecord, SlabShape
from kvelastic.daemon.tenancy import Credential
from kvelastic.vmm.base import DEFAULT_PAGE_SIZE as PAGE
from kvelastic_tools.sim import ghosts
from kvelastic_tools.sim.engine import SimEngine
from kvelastic_tools.sim.guard import CALL_LIMIT, CallGuard
from kvelastic_tools.sim.hostile import Hostile
from kvelastic_tools.sim.keeper import Keeper, take_back
from kvelastic_tools.sim.records import BLOCKS_PER_SLAB, BUSY, Device, Ghost, SimWorker, Step
from kvelastic_tools.sim.tier import TIER_ORPHAN_TTL, SimTier, with_tier

WORKERS = (1, 1, 2)                # engine i's workers (its slab shape)
TENANT_UIDS = (1001, 1002)         # engine i's tenant (``World.cred_of``)


@dataclasses.dataclass
class Envelope:
    due: float
    msg: p.Msg


class Wire:
    """Messages between the daemon and one client identity: FIFO each way."""

    def __init__(self) -> None:
        self.to_daemon: deque[Envelope] = deque()
        self.to_client: deque[Envelope] = deque()


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
    def __init__(self, seed: int, engines: int = 3, budget_pages: int = 24, timing: Timing = Timing(),
                 tier: bool | None = None, evictions: bool = True) -> None:
        self.rng = random.Random(seed)
        self.seed = seed
        self.now = 0.0
        # The node's tier below device memory (``tier.py``), in some seeds: kept
        # cache expires sooner there, so that it is demoted (and promoted) within a run.
        self.tier = SimTier(self, seed) if (with_tier(seed) if tier is None else tier) else None
        if self.tier is not None and timing.orphan_ttl > TIER_ORPHAN_TTL:
            timing = dataclasses.replace(timing, orphan_ttl=TIER_ORPHAN_TTL)
        self.timing = timing
        # Engines honour ``Registered.tier`` (demotion source B: ``engine.py``,
        # ``tier.py``) and ``ClearIndex``; False: they ignore both, as before it.
        self.evictions = evictions
        self.budget_pages = budget_pages
        self.device = Device()
        self.handed_blocks = 0     # cached blocks adopted with slabs handed on by a live replica
        self.orphan_blocks = 0     # cached blocks adopted from the orphaned cache (a warm start)
        self.kept_blocks = 0       # cached blocks of departed engines kept for their namespace
        self.from_orphans: set[int] = set()      # pages of orphaned slabs taken, not granted yet
        self.restart_at: dict[str, float] = {}   # engines that left -> when they come back
        self.wires: dict[bytes, Wire] = {}
        self.violations: list[str] = []
        self.counts: collections.Counter = collections.Counter()   # scenarios that happened (SimResult.faults)
        self.guard = CallGuard(self.violation)   # every allocator call timed (guard.py)
        self.ghosts: dict[bytes, Ghost] = {}   # workers of earlier registrations, still running
        # Acks a worker owes: (its identity, the command's req_id) -> (since, slab, an unmap);
        # since: when the daemon sent it, or the worker last said Busy about it.
        self.owed: dict[tuple[bytes, int], tuple[float, int, bool]] = {}
        self.failed_seen: dict[int, EngineRecord] = {}   # records seen failed (by id; kept alive)
        self.busy_heard: dict[bytes, float] = {}  # worker -> when the daemon last heard it say Busy
        self.excused: set[str] = set()           # engines whose page channel failed: their failure is due
        self.hostiles: list[Hostile] = []        # hostile engines on the books (hostile.py)
        self.hostile_req = 0
        # An allocator input or a new mapping since the books were last checked
        # (unchanged books need no second look).
        self.dirty = True
        self.pages_due = True
        self.checked = 0
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
        # Its keeper and state file (keeper.py); a daemon killed part-way
        # through an input's effects (``crash_armed``: the next effects may be
        # its last) is replaced at the end of the step (``crashed``).
        self.keeper = Keeper()
        self.crash_armed = self.crashed = False
        self.restored_pages: set[int] = set()   # pages of kept slabs adopted from the last daemon
        self.restored_blocks = 0    # cached blocks adopted by engines from kept slabs a new daemon took back
        take_back(self, self.allocator, faults=False)

    def _new_allocator(self) -> Allocator:
        allocator = Allocator({"0": self.budget_pages}, PAGE, timing=self.timing, events=False,
                              token_source=lambda: self.rng.randbytes(16),
                              tier=self.tier.new_index() if self.tier is not None else None)
        allocator.books.orphans = WatchedOrphans(self)     # (its page ids: keeper.take_back)
        return allocator

    # ------------------------------------------------------------ transport
    def connect(self, identity: bytes) -> None:
        self.wires[identity] = Wire()

    def close(self, identity: bytes) -> None:
        self.wires.pop(identity, None)
        if self.owed:
            for key in [k for k in self.owed if k[0] == identity]:
                del self.owed[key]

    def call(self, fn: Any, *args: Any) -> list[fx.Effect]:
        """One allocator input, timed (``guard.py``); the books may have changed.
        A daemon killed (``crash``) hears nothing more."""
        if self.stopped:
            return []
        self.dirty = True
        guard = self.guard
        if guard.watch:
            watched: list[fx.Effect] = guard.watched(fn, args)
            return watched
        start = time.perf_counter()
        out: list[fx.Effect] = fn(*args)
        if time.perf_counter() - start > CALL_LIMIT:
            guard.slow(fn, args, time.perf_counter() - start)
        return out

    def delay(self) -> float:
        r = self.rng.random()
        return 0.0005 if r < 0.8 else self.rng.uniform(0.001, 0.3)   # mostly fast, sometimes slow

    def client_send(self, identity: bytes, msg: p.Msg) -> None:
        wire = self.wires.get(identity)
        if wire is not None:
            wire.to_daemon.append(Envelope(self.now + self.delay(), msg))
            if isinstance(msg, p.Grow):
                self.grow_sent[(identity, msg.req_id)] = self.now

    def send_busy(self, engine_id: str, w: SimWorker) -> None:
        """A worker in a step that holds unmaps says so: their acks are owed afresh from now."""
        slabs = [m.slab for m in w.deferred]
        self.client_send(w.identity, BUSY(engine_id=engine_id, rank=w.rank, slabs=slabs))

    def heard(self, identity: bytes, msg: p.Msg) -> None:
        """The daemon hears a worker: an ack settles what it owed; a Busy
        makes the unmaps it names owed afresh from now (as the daemon's
        deadline moves)."""
        if isinstance(msg, (p.Mapped, p.Unmapped)):
            self.owed.pop((identity, msg.req_id), None)
        elif BUSY is not None and isinstance(msg, BUSY):
            self.busy_heard[identity] = self.now
            slabs = set(msg.slabs)
            for key, (_since, slab, unmap) in list(self.owed.items()):
                if key[0] == identity and unmap and slab in slabs:
                    self.owed[key] = (self.now, slab, unmap)

    def haunt(self, engine_id: str, w: SimWorker, frozen: bool, step_until: float, exit_at: float) -> None:
        """``w`` outlives its engine's process (``ghosts.py``)."""
        w.stuck_until = exit_at if frozen else 0.0
        self.ghosts[w.identity] = Ghost(engine_id, w, frozen, step_until, exit_at)
        self.counts["ghost_frozen" if frozen else "ghost_stepping"] += 1

    def mappers(self) -> Iterator[SimWorker]:
        """Every worker process that may map pages: engines' and ghosts'."""
        for engine in self.engines:
            yield from engine.workers
        for ghost in self.ghosts.values():
            yield ghost.worker

    def mapped_pages(self) -> set[int]:
        return {page for w in self.mappers() for pages in w.mapped.values() for page in pages}

    def open_peer(self, engine: SimEngine, rank: int, token: bytes = b"") -> None:
        if not self.stopped:
            self.perform(self.call(self.allocator.peer_opened, engine.name, rank, self.now, token))

    def close_peer(self, engine: SimEngine, rank: int, token: bytes = b"") -> None:
        self.close_peer_of(engine.name, rank, token)

    def close_peer_of(self, engine_id: str, rank: int, token: bytes = b"") -> None:
        if not self.stopped:               # a daemon that exited hears nothing more
            self.perform(self.call(self.allocator.peer_closed, engine_id, rank, self.now, token))

    # -------------------------------------------------------------- effects
    def perform(self, effects: list[fx.Effect]) -> None:
        """Carry out one input's effects, as the loop does; then its state
        file is written if the kept cache moved (``keeper.py``). A daemon
        killed meanwhile (``crash_armed``) performs nothing more."""
        if self.stopped:
            return
        queue = deque(effects)
        while queue:
            e = queue.popleft()
            if isinstance(e, fx.Send):
                self.send(e)
            elif isinstance(e, fx.SendPages):
                worker = self.find_worker(e.engine_id, e.rank)
                if worker is not None and worker.token != e.token:
                    worker = None
                if worker is None:
                    self.excused.add(e.engine_id)
                    queue.extend(self.call(self.allocator.channel_failed, e.engine_id, e.rank, "gone", self.now))
                else:
                    self.keeper.save_ahead(self)          # written ahead: the file never names a slab lent since
                    self.check_lent(worker, e.pages)
                    worker.channel.extend(e.pages)
                    then = getattr(e, "then", None)     # the MapSlab that names them, where the loop sends it
                    # Killed once they left (with their MapSlab: one batch), most
                    # often when they are a kept slab's: the write-ahead's moment.
                    kept = not self.from_orphans.isdisjoint(e.pages)
                    if self.crash_armed and self.rng.random() < (0.9 if kept else 0.3):
                        if then is not None:
                            self.send(then)
                        self.crash()
                        return
                    if then is not None:
                        queue.append(then)
            elif isinstance(e, fx.CreatePages):
                ids = self.allocator.new_page_ids(e.count)
                reused = set(ids) & (self.device.pages | self.keeper.held)
                if reused:
                    self.violation(f"new page ids {sorted(reused)[:5]} are pages the daemon or its keeper holds")
                made = [] if self.device.fail_creation else ids
                self.device.pages.update(made)
                self.keeper.deposit(made)
                queue.extend(self.call(self.allocator.pages_created, e.device, e.count, made, self.now))
            elif isinstance(e, fx.ReleasePages):
                self.keeper.forget(e.pages)
                mapped = self.mapped_pages()
                for page in e.pages:
                    self.device.pages.discard(page)
                    if page not in mapped and page not in self.keeper.held:
                        self.device.forget(page)
            elif isinstance(e, (fx.DemoteBlocks, fx.WriteStaged, fx.ReadTierBlock, fx.DeleteTierBlocks)) \
                    and self.tier is not None:
                queue.extend(self.tier.perform(e))      # the tier's I/O, as the loop's ``tier_io`` does it
            if self.crash_armed and self.rng.random() < 0.01:  # kill -9 at any point of the effects
                self.crash()
                return
        self.keeper.save_after(self)

    def send(self, e: fx.Send) -> None:
        wire = self.wires.get(e.to)
        if wire is not None:
            wire.to_client.append(Envelope(self.now + self.delay(), e.msg))
            if isinstance(e.msg, (p.MapSlab, p.UnmapSlab)):
                self.owed[(e.to, e.msg.req_id)] = (self.now, e.msg.slab, isinstance(e.msg, p.UnmapSlab))
        if isinstance(e.msg, (p.Granted, p.Error)):
            self.grow_sent.pop((e.to, e.msg.req_id), None)
        if self.tier is not None and self.tier.answering:   # an invalidation's ClearIndex, or its answer
            self.tier.sent(e.to, e.msg)

    def crash(self) -> None:
        """kill -9 of the daemon part-way through an input: what it did so far
        stands, nothing more is done or written; its successor starts at the
        end of the step (``run.check``)."""
        self.counts["daemon_crash_mid_input"] += 1
        self.crash_armed = False
        self.crashed = self.stopped = True

    def check_lent(self, worker: SimWorker, pages: tuple[int, ...]) -> None:
        """A page is never sent to a worker while a worker of another registration maps it (lent twice)."""
        for other in self.mappers():
            if other.token != worker.token:
                for slab_id, mapped in other.mapped.items():
                    twice = set(pages).intersection(mapped)
                    if twice:
                        self.violation(f"pages {sorted(twice)} sent to worker {worker.identity!r} while "
                                       f"{other.identity!r} maps them (slab {slab_id}): lent twice")

    def find_worker(self, engine_id: str, rank: int) -> SimWorker | None:
        for engine in self.engines:
            if engine.name == engine_id and engine.alive:
                return engine.workers[rank]
        return None

    def cred_of(self, identity: bytes) -> Credential | None:
        """Who an engine's or worker's connection is, as the kernel would say:
        tenants by engine, e0 and e2 one uid, e1 another (``TENANT_UIDS``), so
        that the tier's shares (pins, leases, staging, per uid) are contended
        between tenants. Trusted as an operator's processes are (its names are
        not qualified: the checks name engines as they registered). Anything
        else (the CLI, hostile peers): in-process, as before."""
        kind, _, rest = identity.partition(b":")
        if kind not in (b"E", b"W"):
            return None
        name = rest.split(b":", 1)[0].decode()
        uid = TENANT_UIDS[int(name[1:]) % len(TENANT_UIDS)] if name[1:].isdigit() else -1
        return Credential(uid, uid, 0, operator=True, tenant=False)

    # ---------------------------------------------------------------- steps
    def deliver(self) -> bool:
        """Deliver every message that is due, in order per connection."""
        moved = False
        for identity, wire in list(self.wires.items()):
            while wire.to_daemon and wire.to_daemon[0].due <= self.now and not self.stopped:
                msg = wire.to_daemon.popleft().msg
                if self.owed:
                    self.heard(identity, msg)
                self.perform(self.call(self.allocator.handle, identity, msg, self.now, self.cred_of(identity)))
                moved = True
            ghost = self.ghosts.get(identity)
            if ghost is not None:
                while identity in self.wires and wire.to_client and wire.to_client[0].due <= self.now \
                        and ghost.worker.stuck_until <= self.now:
                    ghosts.on_message(self, ghost, wire.to_client.popleft().msg)
                    moved = True
                continue
            engine, worker = self.owner_of(identity)
            while identity in self.wires and wire.to_client and wire.to_client[0].due <= self.now:
                if worker is not None and worker.stuck_until > self.now:
                    break
                msg = wire.to_client.popleft().msg
                moved = True
                if engine is not None and worker is not None:     # a worker's engine is found with it
                    engine.on_worker_message(worker, msg)
                elif engine is not None and (self.tier is None or not self.tier.on_reply(engine, msg)):
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

    def restart_daemon(self, corrupt: SimEngine | None = None, kill: bool = False) -> None:
        """SIGTERM (or ``kill``: -9, or a ``crash`` already) and a new daemon:
        nothing is unmapped; engines reconnect and adopt; the new daemon takes
        back the kept cache its predecessor saved (``keeper.take_back``).
        What the old daemon sent before it exited still reaches the clients."""
        graceful = not kill and not self.stopped
        if graceful:                          # a graceful stop: its file last, its pages left to the keeper
            self.keeper.save_at_stop(self)
            self.keeper.attached = False
            self.perform(self.call(self.allocator.shutdown))
        if self.tier is not None:             # its tier writer: what is queued written, or (killed) lost
            self.tier.stop(graceful)
        self.stopped = True
        self.crash_armed = self.crashed = False
        for ghost in list(self.ghosts.values()):   # their connections went with the daemon; nothing more is heard
            self.close(ghost.worker.identity)
            del self.ghosts[ghost.worker.identity]
        self.owed.clear()
        self.busy_heard.clear()
        self.failed_seen.clear()
        self.excused.clear()
        self.hostiles.clear()                      # their lifelines went with it too
        self.guard.watch = False
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
        take_back(self, self.allocator)
        self.dirty = True
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
        if any(page in self.restored_pages for page in pages):
            self.restored_blocks += len(cached)      # kept through a daemon restart
            self.restored_pages.difference_update(pages)
        if any(page in self.from_orphans for page in pages):
            self.orphan_blocks += len(cached)
            self.from_orphans.difference_update(pages)
        else:
            self.handed_blocks += len(cached)
        for c in cached:
            if c.key.split(b":", 1)[0] != engine.checkpoint.encode() or engine.private:
                self.violation(f"engine {engine.name} ({engine.namespace}) adopted block {c.key!r} of another "
                               "namespace")
            for page in pages:
                self.check_block(f"engine {engine.name} ({engine.namespace}) adopted slab {slab_id}:",
                                 engine.namespace, page, c, superseded=not self.clear_coming(engine))
        mine = {id(w) for w in engine.workers}
        for page in pages:
            for w in self.mappers():
                if id(w) not in mine and any(page in mapped for mapped in w.mapped.values()):
                    self.violation(f"engine {engine.name}: adopted page {page} still mapped by {w.identity!r}")

    def check_kept(self, slab: OrphanSlab) -> None:
        """A departed engine's slab kept as cache of its namespace: unmapped
        everywhere, and every block it keeps valid (as an adoption needs it)."""
        self.kept_blocks += len(slab.cached)
        mapped = self.mapped_pages()
        for page in slab.pages:
            if page in mapped:
                self.violation(f"orphaned page {page} of {slab.engine_id} still mapped by a worker")
            for c in slab.cached:
                self.check_block(f"slab of {slab.engine_id} kept for {slab.namespace}:", slab.namespace, page, c)

    def clear_coming(self, engine: SimEngine) -> bool:
        """A ``ClearIndex`` is on its way to ``engine`` or deferred there: what
        it adopts now (granted before the invalidation) goes with it."""
        wire = self.wires.get(engine.identity)
        return bool(engine.clear_due) or (wire is not None and any(isinstance(e.msg, p.ClearIndex)
                                                                   for e in wire.to_client))

    def check_block(self, what: str, namespace: str, page: int, c: p.CachedBlock, superseded: bool = True) -> None:
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
        elif superseded and self.tier is not None and id(kv) in self.tier.superseded:
            self.violation(f"{what} block {c.offset} ({c.key!r}) of page {page} holds KV of before its namespace "
                           f"was invalidated (by {kv.writer} step {kv.step}), which its engine was told to clear")

    def drain_lifeline(self, identity: bytes) -> None:
        """The client's journals in flight on ``identity``'s lifeline reach the
        daemon before it hears the engine or a worker of it die; the rest
        (its control socket's) stays where it is."""
        wire = self.wires.get(identity)
        if wire is None:
            return
        rest: deque[Envelope] = deque()
        while wire.to_daemon and not self.stopped and identity in self.wires:
            envelope = wire.to_daemon.popleft()
            if isinstance(envelope.msg, p.Journal):
                self.perform(self.call(self.allocator.handle, identity, envelope.msg, self.now,
                                       self.cred_of(identity)))
                self.counts["lifeline_drained"] += 1
            else:
                rest.append(envelope)
        rest.extend(wire.to_daemon)
        wire.to_daemon = rest

    def in_flight_demotions(self, engine: SimEngine) -> set[int]:
        """Blocks ``engine`` demoted in journals on its lifeline, not read yet:
        the daemon reads them before it decides anything about the engine."""
        wire = self.wires.get(engine.identity)
        if wire is None or not engine.tier:
            return set()
        return {op.block for env in wire.to_daemon if isinstance(env.msg, p.Journal)
                for op in env.msg.ops if isinstance(op, p.DemoteBlock)}

    def check_rewrite(self, engine: SimEngine, step: Step) -> None:
        """A step starts writing its blocks: the daemon must hold none of them
        as valid cache of this engine (the seal made it hear every key dropped
        before the step runs; a key stored for this step is valid only once it
        ended), or a kill -9 now would leave it a torn block to keep."""
        alloc = self.allocator
        records = [alloc.engines.get(engine.name), *alloc.departing.values()]   # dropped, still stepping
        record = next((r for r in records if r is not None and r.engine_id == engine.name
                       and r.identity == engine.identity), None)
        if record is None or record.failed:
            return
        demoting = self.in_flight_demotions(engine)
        for blk, _key in step.writes:
            if blk.block_id in demoting:
                continue
            slab_id, offset = divmod(blk.block_id, BLOCKS_PER_SLAB)
            for at, key in record.mirror.valid_in(slab_id, record.blocks_per_slab):
                if at == offset:
                    self.violation(f"engine {engine.name}: step {step.n} writes block {blk.block_id}, which "
                                   f"the daemon holds as valid cache of {key!r}")

    def check_slab_mapped(self, engine: SimEngine, slab_id: int) -> None:
        for w in engine.workers:
            if slab_id not in w.mapped:
                self.violation(f"engine {engine.name}: slab {slab_id} granted before worker {w.rank} mapped it")
