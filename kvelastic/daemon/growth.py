"""Grows: the allocator's part that answers a request for memory. Pages come
from the engine's own free pages or clean ones, from kept cache of its
namespace (a warm start, ``handoff.py``), from a slab a replica handed on,
or are created; a demand may reclaim from other engines (``arbiter.py``). A
slab is granted once every worker mapped it; a grow is answered by its
deadline with what it got, the slabs mapped later granted on their own.

A mixin of ``Allocator`` (``allocator.py``): it reads and writes the same
books; nothing here does I/O.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvelastic import protocol as p
from kvelastic.daemon import effects as fx
from kvelastic.daemon.arbiter import Rules, is_hard, is_idle
from kvelastic.daemon.rejected import Rejected
from kvelastic.daemon.requests import GrowRequest, ReclaimRequest, Timing
from kvelastic.daemon.state import EngineRecord, PagePool, Phase, SlabRecord, owner_tag

log = logging.getLogger("kvelastic.daemon")

MAX_GROW = 4096              # slabs in one grow request
MAX_PENDING_GROWS = 8        # grow requests one engine may have waiting
# Work per pass, so that a large grow never holds the loop: slabs whose
# mapping starts in one pass (the rest go on in the next, ``Allocator.resume``),
# and pages asked of the loop at once (it creates one batch per pass).
SLABS_PER_PASS = 64
CREATE_BATCH = 256
EXPORT_BACKOFF = 1.0         # after a page export failed (out of descriptors), no new mapping for this long


class Growth:
    # The allocator's books this part reads and writes (``Allocator.__init__`` sets them).
    pools: dict[str, PagePool]
    engines: dict[str, EngineRecord]
    departing: dict[int, EngineRecord]
    grows: dict[int, GrowRequest]
    reclaims: dict[int, ReclaimRequest]
    timing: Timing
    rules: Rules
    _grow_seq: int
    _progressing: bool
    _again: bool
    _started: int               # slabs whose mapping started in this pass
    more_work: bool             # a grow was paced: the loop comes back at once
    export_failed_at: float     # the loop could not export pages (``Allocator.pages_unsent``)
    _now: float
    _out: list[fx.Effect]

    if TYPE_CHECKING:  # the allocator's (and its other parts') methods it calls
        def _own_engine(self, identity: bytes, engine_id: str) -> EngineRecord: ...
        def _engine(self, engine_id: str) -> EngineRecord: ...
        def _command(self, identity: bytes, msg: p.Msg) -> int: ...
        def _new_req_id(self) -> int: ...
        def departed(self, engine_id: str) -> list[EngineRecord]: ...
        def _reclaim_for(self, req: GrowRequest, requester: EngineRecord, short: int) -> None: ...
        def _start_unmap(self, engine: EngineRecord, slab: SlabRecord) -> None: ...
        def _map_handoff(self, engine: EngineRecord, slab_id: int, req: GrowRequest) -> bool: ...
        def _adopt_orphans(self, engine: EngineRecord, req: GrowRequest, room: int) -> int: ...
        def _yield_orphans(self, device: str, pages: int, for_engine: str) -> None: ...
        @staticmethod
        def _handed(engine: EngineRecord, slab_ids: list[int]) -> dict[int, list[p.CachedBlock]]: ...

    def _on_grow(self, identity: bytes, m: p.Grow) -> p.Msg | None:
        engine = self._own_engine(identity, m.engine_id)
        if not 1 <= m.slabs <= MAX_GROW:
            raise Rejected(p.Reason.BAD_REQUEST, f"grow by {m.slabs} slabs (1..{MAX_GROW})")
        if engine.pending_grows >= MAX_PENDING_GROWS:
            raise Rejected(p.Reason.BUSY, f"engine {engine.engine_id} has {MAX_PENDING_GROWS} grows pending")
        if m.demand:
            engine.active_at = self._now
        elif is_idle(engine, self._now, self.rules):
            # An idle engine keeps no reserve: a late refill is answered with nothing.
            log.info("engine %s: reserve grow refused: idle for %.1f s", engine.engine_id,
                     self._now - engine.active_at)
            return p.Granted(slabs=[])
        self._grow_seq += 1
        engine.pending_grows += 1
        self.grows[self._grow_seq] = GrowRequest(self._grow_seq, engine.engine_id, identity, m.req_id, m.slabs,
                                                 self._now, self._now + self.timing.grow_timeout, m.demand)
        self._progress_grows()
        return None

    def _progress_grows(self) -> None:
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
        engine = self.engines.get(req.engine_id)
        if engine is not None:
            engine.pending_grows -= 1

    def _advance(self, req: GrowRequest) -> bool:
        """True when ``req`` is answered."""
        engine = self.engines.get(req.engine_id)
        if engine is None:
            return True
        expired = self._now >= req.deadline
        if len(engine.workers) < engine.num_workers and not expired:
            return False  # every worker must be there to map the pages
        cap = engine.max_slabs if not engine.max_bytes else min(engine.max_slabs,
                                                                engine.max_bytes // engine.slab_bytes)
        owned = engine.owned_slabs()
        if not expired:
            adopted = self._adopt_orphans(engine, req, min(cap - owned, SLABS_PER_PASS - self._started))
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
            if self._now - self.export_failed_at < EXPORT_BACKOFF:
                break            # the slab would fail again at once: answer with what it got
            slab_id = engine.free_slab_id()
            if slab_id is None:
                break
            if self._map_handoff(engine, slab_id, req):
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
                self._reclaim_for(req, engine, short)
        waiting = paced or req.mapping or req.reclaims or (short > 0 and req.incoming) or \
            (self._creating(engine) if creating is None else creating)
        if waiting and not expired:
            return False
        latency = self._now - req.started
        self._out.append(fx.GrantLatency(engine.device, latency, req.demand))
        if req.demand:
            self._starvation(engine, req, short)
        self._out.append(fx.Send(req.identity, p.Granted(req_id=req.req_id, slabs=req.slabs,
                                                         cached=self._handed(engine, req.slabs))))
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

    def _starvation(self, engine: EngineRecord, req: GrowRequest, short: int) -> None:
        """A demand grow was answered: the engine is starved while its hard demand goes unmet."""
        if short <= 0 or req.slabs:
            if engine.starved_since is not None:
                log.info("engine %s: demand met again after %.1f s", engine.engine_id,
                         self._now - engine.starved_since)
            engine.starved_since = None
        elif is_hard(engine, short):
            if engine.starved_since is None:
                engine.starved_since = req.started
                log.warning("engine %s: starved: demand for %d slab(s) unmet", engine.engine_id, short)
            engine.last_unmet = self._now

    def _demand_pending(self, engine: EngineRecord) -> bool:
        """Another engine's demand grow on one of ``engine``'s devices is unanswered."""
        mine: set[str] | None = None       # its devices, once another demand is pending
        for other in self.grows.values():
            if not other.demand or other.engine_id == engine.engine_id:
                continue
            requester = self.engines.get(other.engine_id)
            if requester is None:
                continue
            if mine is None:
                mine = self._devices_of(engine)
            if mine & self._devices_of(requester):
                return True
        return False

    def _creating(self, engine: EngineRecord) -> bool:
        return any(self.pools[d].creating for d in self._devices_of(engine))

    def _on_its_way(self, engine_id: str, slab_id: int) -> bool:
        """A reclaimed slab still unmapping by an engine that is not failed."""
        for owner in (self.engines.get(engine_id), *self.departed(engine_id)):
            slab = owner.slabs.get(slab_id) if owner is not None and not owner.failed else None
            if slab is not None and slab.phase is Phase.UNMAPPING:
                return True
        return False

    def _devices_of(self, engine: EngineRecord) -> set[str]:
        return {engine.worker_devices.get(r, engine.device) for r in range(engine.num_workers)} or {engine.device}

    def _take_pages(self, engine: EngineRecord, demand: bool) -> tuple[list[int], list[str]] | None:
        """Pages for one slab, rank by rank from each worker's device, all or
        none: the engine's own free pages or clean ones. Missing pages are
        asked of the loop (fresh ones, after releasing others' stale pages,
        and for a demand kept cache, if the budget needs the room); the grow
        waits for them."""
        owner = owner_tag(engine)
        ranks = [(engine.worker_devices.get(r, engine.device), engine.pages_per_worker)
                 for r in range(engine.num_workers)] or [(engine.device, engine.pages_per_worker)]
        need: dict[str, int] = {}
        for device, n in ranks:
            need[device] = need.get(device, 0) + n
        short = {d: n - self.pools[d].usable(owner, n) for d, n in need.items()}
        if any(short.values()):
            for device, n in short.items():
                if n > 0:
                    self._create(device, n, engine.engine_id if demand else "")
            return None
        pages: list[int] = []
        devices: list[str] = []
        for device, n in ranks:
            got = self.pools[device].take(n, owner)
            pages += got
            devices += [device] * n
        return pages, devices

    def _create(self, device: str, n: int, demand_of: str = "") -> None:
        """Ask the loop for ``n`` fresh pages on ``device`` (unless already asked),
        releasing free pages of other owners when the budget needs the room,
        then for a demand (``demand_of``: the engine) kept orphaned cache."""
        pool = self.pools[device]
        if pool.creating or self._now - pool.creation_failed_at < 1.0:
            return
        if pool.creatable() < n:
            stale = pool.take_stale(n - pool.creatable())
            if stale:
                self._out.append(fx.ReleasePages(device, tuple(stale)))
        if pool.creatable() < n and demand_of:
            self._yield_orphans(device, n - pool.creatable(), demand_of)
        n = min(n, pool.creatable(), CREATE_BATCH)
        if n > 0:
            pool.creating += n
            self._out.append(fx.CreatePages(device, n))

    def _start_map(self, engine: EngineRecord, slab_id: int, pages: list[int], page_devices: list[str],
                   req: GrowRequest | None) -> None:
        slab = SlabRecord(slab_id, pages, page_devices, Phase.MAPPING, set(range(engine.num_workers)),
                          deadline=self._now + self.timing.ack_timeout)
        engine.start_mapping(slab)
        if req is not None:
            req.mapping.add(slab_id)
        for rank in range(engine.num_workers):
            mine = pages[rank * engine.pages_per_worker:(rank + 1) * engine.pages_per_worker]
            offsets = engine.worker_offsets(slab_id, rank)
            command = fx.Send(engine.workers[rank], p.MapSlab(req_id=self._new_req_id(), slab=slab_id,
                                                             pages=list(zip(mine, offsets))))
            self._out.append(fx.SendPages(engine.engine_id, rank, engine.worker_devices[rank], tuple(mine),
                                          engine.token, command, slab_id))
        if not slab.waiting:
            self._mapped(engine, slab)

    def _on_mapped(self, identity: bytes, m: p.Mapped) -> None:
        engine = self._engine(m.engine_id)
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
            self._start_unmap(engine, slab)
        else:
            engine.mark_held(slab)
            engine.mirror.hold(slab.slab_id, (0, 0, engine.blocks_per_slab))
            engine.active[slab.slab_id] = self._now
            engine.grants += 1
            if req is not None:
                req.slabs.append(slab.slab_id)
            elif slab.late_grant:      # its grow was answered at the deadline: grant it now
                self._command(engine.identity, p.Granted(slabs=[slab.slab_id],
                                                         cached=self._handed(engine, [slab.slab_id])))
        self._progress_grows()
