"""Grows: the allocator's part that answers a request for memory. Pages come
from the engine's own free pages or clean ones, from kept cache of its
namespace (a warm start, ``handoff.py``), from a slab a replica handed on,
or are created; a demand may reclaim from other engines (``reclaims.py``).
A slab is granted once every worker mapped it; a grow is answered by its
deadline with what it got, the slabs mapped later granted on their own.

It owns the pending grows; nothing here does I/O.
"""

from __future__ import annotations

import logging

from kvelastic import protocol as p
from kvelastic.daemon import effects as fx
from kvelastic.daemon.arbiter import is_hard, is_idle
from kvelastic.daemon.books import Books
from kvelastic.daemon.handoff import CacheHandoff
from kvelastic.daemon.parts import Reclaimer, Unmapper
from kvelastic.daemon.rejected import Rejected
from kvelastic.daemon.requests import GrowRequest
from kvelastic.daemon.state import EngineRecord, Phase, SlabRecord, owner_tag

log = logging.getLogger("kvelastic.daemon")

MAX_GROW = 4096              # slabs in one grow request
MAX_PENDING_GROWS = 8        # grow requests one engine may have waiting
# Work per pass, so that a large grow never holds the loop: slabs whose
# mapping starts in one pass (the rest go on in the next, ``Growth.resume``),
# and pages asked of the loop at once (it creates one batch per pass).
SLABS_PER_PASS = 64
CREATE_BATCH = 256
EXPORT_BACKOFF = 1.0         # after a page export failed (out of descriptors), no new mapping for this long


class Growth:
    def __init__(self, books: Books, cache: CacheHandoff) -> None:
        self.books = books
        self.cache = cache
        self.grows: dict[int, GrowRequest] = {}     # by arrival: answered in order
        self._grow_seq = 0
        self._progressing = self._again = False
        self._started = 0                 # slabs whose mapping started in this pass
        self.more_work = False            # a grow was paced: the loop comes back at once (``resume``)
        self.export_failed_at = -1e9      # the loop could not export pages (``pages_unsent``)

    def wire(self, unmapper: Unmapper, reclaimer: Reclaimer) -> None:
        """The parts a grow calls that call it back (``parts.py``): set once, by the allocator."""
        self.unmapper = unmapper
        self.reclaimer = reclaimer

    # ------------------------------------------------------------ GrowPass
    def request(self, seq: int) -> GrowRequest | None:
        return self.grows.get(seq)

    def of_engine(self, engine_id: str) -> list[GrowRequest]:
        return [r for r in self.grows.values() if r.engine_id == engine_id]

    def slabs_in_flight(self) -> set[tuple[str, int]]:
        return {(r.engine_id, s) for r in self.grows.values() for s in r.slabs}

    def answer_gone(self, engine: EngineRecord, why: str) -> None:
        """``engine`` left the books: its grows are answered now, with why."""
        for req in self.of_engine(engine.engine_id):
            del self.grows[req.seq]
            self.books.emit(fx.Send(req.identity, p.Error(req_id=req.req_id, reason=p.Reason.ENGINE_GONE.value,
                                                          message=f"engine {engine.engine_id}: {why}")))

    # ------------------------------------------------------------- inputs
    def on_grow(self, identity: bytes, m: p.Grow) -> p.Msg | None:
        books = self.books
        engine = books.own_engine(identity, m.engine_id)
        if not 1 <= m.slabs <= MAX_GROW:
            raise Rejected(p.Reason.BAD_REQUEST, f"grow by {m.slabs} slabs (1..{MAX_GROW})")
        if engine.pending_grows >= MAX_PENDING_GROWS:
            raise Rejected(p.Reason.BUSY, f"engine {engine.engine_id} has {MAX_PENDING_GROWS} grows pending")
        if m.demand:
            engine.touched(books.now)
        elif is_idle(engine, books.now, books.rules):
            # An idle engine keeps no reserve: a late refill is answered with nothing.
            log.info("engine %s: reserve grow refused: idle for %.1f s", engine.engine_id,
                     books.now - engine.active_at)
            return p.Granted(slabs=[])
        self._grow_seq += 1
        engine.pending_grows += 1
        self.grows[self._grow_seq] = GrowRequest(self._grow_seq, engine.engine_id, identity, m.req_id, m.slabs,
                                                 books.now, books.now + books.timing.grow_timeout, m.demand)
        self.progress()
        return None

    def pages_created(self, device: str, asked: int, page_ids: list[int]) -> None:
        """The loop created ``page_ids`` (``asked`` were asked for; fewer: creation failed)."""
        if not self.books.pools[device].created_pages(asked, page_ids, self.books.now):
            log.error("device %s: created %d of %d page(s)", device, len(page_ids), asked)
        self.progress()

    def pages_unsent(self, engine_id: str, rank: int, slab_id: int, why: str) -> None:
        """The loop could not export a slab's pages for a worker (the daemon is
        out of descriptors): nothing was sent to it, and the slab fails to map
        as if that worker had said so. The engine is not at fault."""
        engine = self.books.engines.get(engine_id)
        slab = engine.slabs.get(slab_id) if engine is not None else None
        self.export_failed_at = self.books.now
        if engine is not None and slab is not None and slab.phase is Phase.MAPPING and rank in slab.waiting:
            log.error("engine %s: pages of slab %d not sent to worker %d: %s", engine_id, slab_id, rank, why)
            slab.waiting.discard(rank)
            slab.failed = True
            if not slab.waiting:
                self._mapped(engine, slab)

    def resume(self) -> None:
        """Go on with grows paced in an earlier pass (``more_work``)."""
        self.more_work = False
        self.progress()

    # ------------------------------------------------------------ the pass
    def progress(self) -> None:
        """Advance every pending grow, in arrival order. A call from inside a
        pass (a slab mapped at once) only asks the running pass to go round
        once more; each round is linear in the pending grows."""
        if self._progressing:
            self._again = True
            return
        self._progressing = True
        self._started = 0
        try:
            self._again = True
            while self._again:
                self._again = False
                for seq, req in list(self.grows.items()):
                    if seq in self.grows and self._advance(req):
                        self._end_grow(req)
        finally:
            self._progressing = False

    def _end_grow(self, req: GrowRequest) -> None:
        del self.grows[req.seq]
        engine = self.books.engines.get(req.engine_id)
        if engine is not None:
            engine.pending_grows -= 1

    def _advance(self, req: GrowRequest) -> bool:
        """True when ``req`` is answered."""
        books = self.books
        engine = books.engines.get(req.engine_id)
        if engine is None:
            return True
        now = books.now
        expired = now >= req.deadline
        if len(engine.workers) < engine.num_workers and not expired:
            return False  # every worker must be there to map the pages
        cap = engine.max_slabs if not engine.max_bytes else min(engine.max_slabs,
                                                                engine.max_bytes // engine.slab_bytes)
        if now < engine.drain_until and self._others_starved(engine):
            # Draining for another's demand: no further than its fair share
            # while that demand is unmet, so it does not take back what it gives.
            cap = min(cap, max(engine.min_bytes, self.reclaimer.fair_share(engine)) // engine.slab_bytes)
        owned = engine.owned_slabs()
        if not expired:
            adopted = self._adopt_kept(engine, req, min(cap - owned, SLABS_PER_PASS - self._started))
            owned += adopted
            self._started += adopted
        paced = False
        # A reserve refill waits while another engine's demand on its devices
        # is pending: that demand may be waiting for the very pages a reclaim
        # is freeing, and the victim's refill would take them back first (its
        # own stale pages are usable to it at once, the demand's need fresh ones).
        yields = not req.demand and self._demand_pending(engine)
        while not expired and not yields and len(req.slabs) + len(req.mapping) < req.wanted and owned < cap:
            if self._started >= SLABS_PER_PASS:
                paced = self.more_work = True
                break
            if now - self.export_failed_at < EXPORT_BACKOFF:
                break            # the slab would fail again at once: answer with what it got
            slab_id = engine.free_slab_id()
            if slab_id is None:
                break
            handoff = self.cache.take_handoff(engine, req)
            if handoff is not None:
                self._map_kept(engine, slab_id, handoff.pages, handoff.page_devices, handoff.cached, req)
                owned += 1
                self._started += 1
                continue
            pages = self._take_pages(engine, req.demand)
            if pages is None:
                break
            self._start_map(engine, slab_id, *pages, req)
            owned += 1
            self._started += 1
        short = req.wanted - len(req.slabs) - len(req.mapping)
        if req.incoming:
            req.incoming = {(eid, s) for eid, s in req.incoming if self._on_its_way(eid, s)}
        # Pages being created for its devices: looked up only where it decides
        # (every pending grow is advanced on every event: this is the loop's hot path).
        creating: bool | None = None
        # A reserve refill never takes memory from another engine (no ping-pong).
        if not expired and short > 0 and req.demand and owned < cap and not req.reclaims \
                and not req.incoming and req.reclaim_rounds < 3 and not paced:
            creating = self._creating(engine)
            if not creating:
                req.reclaim_rounds += 1
                self.reclaimer.reclaim_for(req, engine, short)
        waiting = paced or req.mapping or req.reclaims or (short > 0 and req.incoming) or \
            (self._creating(engine) if creating is None else creating)
        if waiting and not expired:
            return False
        latency = now - req.started
        books.emit(fx.GrantLatency(engine.device, latency, req.demand))
        if req.demand:
            self._starvation(engine, req, short)
        books.emit(fx.Send(req.identity, p.Granted(req_id=req.req_id, slabs=req.slabs,
                                                   cached=self.cache.handed(engine, req.slabs))))
        for slab_id in req.mapping:     # answered at its deadline: the late ones are granted on their own
            engine.slabs[slab_id].late_grant = True
        if req.slabs:
            log.info("engine %s: granted %d slab(s) in %.1f ms (asked %d)", engine.engine_id,
                     len(req.slabs), latency * 1e3, req.wanted)
        else:   # a refused reserve refill is routine when the budget is full: not an operator's event
            log.log(logging.INFO if req.demand else logging.DEBUG, "engine %s: %s grow of %d slab(s) refused: %s",
                    engine.engine_id, "demand" if req.demand else "reserve", req.wanted,
                    "deadline passed" if expired else "device budget exhausted")
        return True

    def _adopt_kept(self, engine: EngineRecord, req: GrowRequest, room: int) -> int:
        """Warm start: a grow maps every kept slab of its engine's namespace and
        shape it has room for, on top of what it asked for. Returns the slabs mapped."""
        taken = self.cache.take_kept(engine, room)
        for orphan in taken:
            slab_id = engine.free_slab_id()
            assert slab_id is not None     # take_kept takes no more than the ids free
            self._map_kept(engine, slab_id, orphan.pages, orphan.page_devices, orphan.cached, req)
            req.wanted += 1
        return len(taken)

    def _starvation(self, engine: EngineRecord, req: GrowRequest, short: int) -> None:
        """A demand grow was answered: the engine is starved while its hard demand goes unmet."""
        now = self.books.now
        if short <= 0 or req.slabs:
            since = engine.demand_met()
            if since is not None:
                log.info("engine %s: demand met again after %.1f s", engine.engine_id, now - since)
        elif is_hard(engine, short):
            if engine.demand_unmet(req.started, now):
                log.warning("engine %s: starved: demand for %d slab(s) unmet", engine.engine_id, short)
            if engine.starved_since is not None and now - engine.starved_since >= self.books.rules.hold_down:
                self.reclaimer.drain_for(engine, short)   # starved for a while: the others yield to their shares

    def _others_starved(self, engine: EngineRecord) -> bool:
        """Another engine on ``engine``'s device is starved (its hard demand unmet)."""
        return any(e.starved_since is not None and e is not engine and e.device == engine.device
                   for e in self.books.engines.values())

    def _demand_pending(self, engine: EngineRecord) -> bool:
        """Another engine's demand grow on one of ``engine``'s devices is unanswered."""
        books = self.books
        mine: set[str] | None = None       # its devices, once another demand is pending
        for other in self.grows.values():
            if not other.demand or other.engine_id == engine.engine_id:
                continue
            requester = books.engines.get(other.engine_id)
            if requester is None:
                continue
            if mine is None:
                mine = books.devices_of(engine)
            if mine & books.devices_of(requester):
                return True
        return False

    def _creating(self, engine: EngineRecord) -> bool:
        pools = self.books.pools
        return any(pools[d].creating for d in self.books.devices_of(engine))

    def _on_its_way(self, engine_id: str, slab_id: int) -> bool:
        """A reclaimed slab still unmapping by an engine that is not failed."""
        books = self.books
        for owner in (books.engines.get(engine_id), *books.departed(engine_id)):
            slab = owner.slabs.get(slab_id) if owner is not None and not owner.failed else None
            if slab is not None and slab.phase is Phase.UNMAPPING:
                return True
        return False

    # ------------------------------------------------------------- pages
    def _take_pages(self, engine: EngineRecord, demand: bool) -> tuple[list[int], list[str]] | None:
        """Pages for one slab, rank by rank from each worker's device, all or
        none: the engine's own free pages or clean ones. Missing pages are
        asked of the loop (fresh ones, after releasing others' stale pages,
        and for a demand kept cache, if the budget needs the room); the grow
        waits for them."""
        pools = self.books.pools
        owner = owner_tag(engine)
        ranks = [(engine.worker_devices.get(r, engine.device), engine.pages_per_worker)
                 for r in range(engine.num_workers)] or [(engine.device, engine.pages_per_worker)]
        need: dict[str, int] = {}
        for device, n in ranks:
            need[device] = need.get(device, 0) + n
        short = {d: n - pools[d].usable(owner, n) for d, n in need.items()}
        if any(short.values()):
            for device, n in short.items():
                if n > 0:
                    self._create(device, n, engine.engine_id if demand else "")
            return None
        pages: list[int] = []
        devices: list[str] = []
        for device, n in ranks:
            got = pools[device].take(n, owner)
            pages += got
            devices += [device] * n
        return pages, devices

    def _create(self, device: str, n: int, demand_of: str = "") -> None:
        """Ask the loop for ``n`` fresh pages on ``device`` (unless already asked),
        releasing free pages of other owners when the budget needs the room,
        then for a demand (``demand_of``: the engine) kept orphaned cache."""
        books = self.books
        pool = books.pools[device]
        if pool.creating or books.now - pool.creation_failed_at < 1.0:
            return
        if pool.creatable() < n:
            stale = pool.take_stale(n - pool.creatable())
            if stale:
                books.emit(fx.ReleasePages(device, tuple(stale)))
        if pool.creatable() < n and demand_of:
            self.cache.yield_pages(device, n - pool.creatable(), demand_of)
        n = min(n, pool.creatable(), CREATE_BATCH)
        if n > 0:
            pool.asked_to_create(n)
            books.emit(fx.CreatePages(device, n))

    # ------------------------------------------------------------ mapping
    def _map_kept(self, engine: EngineRecord, slab_id: int, pages: list[int], page_devices: list[str],
                  cached: tuple[p.CachedBlock, ...], req: GrowRequest) -> None:
        """Map pages that come with their KV (handed on, or kept cache)."""
        self._start_map(engine, slab_id, pages, page_devices, req)
        slab = engine.slabs.get(slab_id)
        if slab is not None:
            slab.adopting(tuple(cached))

    def _start_map(self, engine: EngineRecord, slab_id: int, pages: list[int], page_devices: list[str],
                   req: GrowRequest | None) -> None:
        books = self.books
        slab = SlabRecord(slab_id, pages, page_devices, Phase.MAPPING, set(range(engine.num_workers)),
                          deadline=books.now + books.timing.ack_timeout)
        engine.start_mapping(slab)
        if req is not None:
            req.mapping.add(slab_id)
        for rank in range(engine.num_workers):
            mine = pages[rank * engine.pages_per_worker:(rank + 1) * engine.pages_per_worker]
            offsets = engine.worker_offsets(slab_id, rank)
            command = fx.Send(engine.workers[rank], p.MapSlab(req_id=books.new_req_id(), slab=slab_id,
                                                             pages=list(zip(mine, offsets))))
            books.emit(fx.SendPages(engine.engine_id, rank, engine.worker_devices[rank], tuple(mine),
                                    engine.token, command, slab_id))
        if not slab.waiting:
            self._mapped(engine, slab)

    def on_mapped(self, identity: bytes, m: p.Mapped) -> None:
        engine = self.books.engine(m.engine_id)
        if engine.workers.get(m.rank) != identity:
            raise Rejected(p.Reason.NOT_OWNER, f"worker {m.rank} of {m.engine_id} registered on another connection")
        slab = engine.slabs.get(m.slab)
        if slab is None or slab.phase is not Phase.MAPPING or m.rank not in slab.waiting:
            raise Rejected(p.Reason.UNEXPECTED_ACK,
                           f"engine {m.engine_id} worker {m.rank}: no map of slab {m.slab} pending")
        slab.waiting.discard(m.rank)
        if m.error:
            log.error("engine %s: worker %d could not map slab %d: %s", m.engine_id, m.rank, m.slab, m.error)
            slab.failed = True
        if not slab.waiting:
            self._mapped(engine, slab)
        return None

    def _mapped(self, engine: EngineRecord, slab: SlabRecord) -> None:
        req = next((r for r in self.grows.values() if slab.slab_id in r.mapping and r.engine_id == engine.engine_id),
                   None)
        if req is not None:
            req.mapping.discard(slab.slab_id)
        if slab.failed:
            self.unmapper.start_unmap(engine, slab)
        else:
            engine.mark_held(slab)
            engine.mirror.hold(slab.slab_id, (0, 0, engine.blocks_per_slab))
            engine.active[slab.slab_id] = self.books.now
            engine.grants += 1
            if req is not None:
                req.slabs.append(slab.slab_id)
            elif slab.late_grant:      # its grow was answered at the deadline: grant it now
                self.books.command(engine.identity, p.Granted(slabs=[slab.slab_id],
                                                              cached=self.cache.handed(engine, [slab.slab_id])))
        self.progress()
