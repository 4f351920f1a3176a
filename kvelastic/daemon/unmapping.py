"""Unmapping: the allocator's part that takes slabs back. A slab returned,
reclaimed, or left by an engine that departed is unmapped by every worker
still there; a failed engine's slabs are quarantined until none of its
processes is left to map them. Once every worker let go, the pages are free
in the daemon (under their owner's tag), handed on to a replica's grow, or
kept as cache of the namespace (``handoff.py`` decides); a slab reclaimed
from a running engine for another namespace has its cached blocks demoted
into the node's tier first (``tiering.py``).

It owns the returns pending (a ``Return`` is answered once every slab in it
is unmapped); nothing here does I/O.
"""

from __future__ import annotations

import logging

from kvelastic import protocol as p
from kvelastic.daemon import effects as fx
from kvelastic.daemon.books import Books
from kvelastic.daemon.handoff import CacheHandoff
from kvelastic.daemon.parts import GrowPass
from kvelastic.daemon.rejected import Rejected
from kvelastic.daemon.requests import Handoff, ReturnRequest
from kvelastic.daemon.state import EngineRecord, Phase, SlabRecord, Way, owner_tag

log = logging.getLogger("kvelastic.daemon")


class Unmapping:
    def __init__(self, books: Books, cache: CacheHandoff, grows: GrowPass) -> None:
        self.books = books
        self.cache = cache
        self.grows = grows
        self.returns: dict[tuple[bytes, int], ReturnRequest] = {}   # by (client, Return req_id)

    def on_return(self, identity: bytes, m: p.Return) -> p.Msg | None:
        engine = self.books.own_engine(identity, m.engine_id)
        for slab_id in m.slabs:
            slab = engine.slabs.get(slab_id)
            if slab is None or slab.phase is not Phase.HELD:
                raise Rejected(p.Reason.NOT_HELD, f"engine {m.engine_id} does not hold slab {slab_id}")
        if len(set(m.slabs)) != len(m.slabs):
            raise Rejected(p.Reason.NOT_HELD, f"engine {m.engine_id} returned a slab twice in one message")
        if not set(m.settled) <= set(m.slabs):
            raise Rejected(p.Reason.BAD_REQUEST, f"engine {m.engine_id} called settled a slab it did not return")
        # The reply waits until every worker unmapped: then the memory is really back.
        if not m.slabs:
            return p.Ok()
        self.returns[(identity, m.req_id)] = ReturnRequest(identity, m.req_id, set(m.slabs))
        log.info("engine %s: returned %d slab(s)", engine.engine_id, len(m.slabs))
        for slab_id in m.slabs:
            engine.returns += 1
            engine.slabs[slab_id].return_req = (identity, m.req_id)
            self.start_unmap(engine, engine.slabs[slab_id], at_once=slab_id in m.settled)
        return None

    def start_unmap(self, engine: EngineRecord, slab: SlabRecord, at_once: bool = False) -> None:
        books = self.books
        engine.begin_unmap(slab, {rank for rank in range(engine.num_workers)
                          if rank in engine.workers and books.channels.alive(engine, rank)},
                         books.now + books.timing.ack_timeout)
        engine.mirror.release(slab.slab_id)
        slab.asked = set(slab.waiting)
        for rank in sorted(slab.waiting):
            books.command(engine.workers[rank],
                          p.UnmapSlab(slab=slab.slab_id, offsets=engine.worker_offsets(slab.slab_id, rank),
                                      at_once=at_once),
                          channel=(engine.engine_id, rank, engine.token))
        if not slab.waiting:
            self._unmapped(engine, slab)

    def on_unmapped(self, identity: bytes, m: p.Unmapped) -> None:
        """A worker let go of a slab. For a failed engine too, if the worker was
        asked to unmap it: a late ack releases that rank's hold on the
        quarantined pages (they come back once no rank holds them)."""
        books = self.books
        engine = books.record_of_worker(identity, m.engine_id, m.rank)
        if engine is None and (m.engine_id in books.engines or books.departed(m.engine_id)):
            raise Rejected(p.Reason.NOT_OWNER, f"worker {m.rank} of {m.engine_id} registered on another connection")
        slab = engine.slabs.get(m.slab) if engine else None
        if engine is None or slab is None or slab.phase is not Phase.UNMAPPING or m.rank not in slab.waiting \
                or (engine.failed and m.rank not in slab.asked):
            raise Rejected(p.Reason.UNEXPECTED_ACK,
                           f"engine {m.engine_id} worker {m.rank}: no unmap of slab {m.slab} pending")
        if engine.failed:
            log.info("engine %s: worker %d unmapped quarantined slab %d late", m.engine_id, m.rank, m.slab)
        slab.waiting.discard(m.rank)
        if not slab.waiting:
            self._unmapped(engine, slab)

    def on_busy(self, identity: bytes, m: p.Busy) -> None:
        """A worker in a long model step holds these unmaps until it ends: their
        deadline moves on (a frozen worker sends nothing and still misses it)."""
        books = self.books
        engine = books.record_of_worker(identity, m.engine_id, m.rank)
        if engine is None or engine.failed:
            raise Rejected(p.Reason.UNEXPECTED_ACK, f"engine {m.engine_id} worker {m.rank}: no unmap pending")
        deadline = books.now + books.timing.ack_timeout
        for slab_id in m.slabs:
            slab = engine.slabs.get(slab_id)
            if slab is not None and slab.phase is Phase.UNMAPPING and m.rank in slab.waiting:
                slab.busy_until[m.rank] = max(slab.busy_until.get(m.rank, 0.0), deadline)

    def _unmapped(self, engine: EngineRecord, slab: SlabRecord) -> None:
        """Every worker let go of the slab: its pages are free in the daemon."""
        books = self.books
        engine.remove_slab(slab)
        engine.active.pop(slab.slab_id, None)
        ret = None if slab.return_req is None else self.returns.get(slab.return_req)
        if ret is not None:
            ret.unmapping.discard(slab.slab_id)
            if not ret.unmapping:
                del self.returns[(ret.identity, ret.req_id)]
                books.emit(fx.Send(ret.identity, p.Ok(req_id=ret.req_id)))
        owner = owner_tag(engine)
        route = slab.route
        req = self.grows.request(route.grow) if route.way is Way.REPLICA else None
        taker = books.engines.get(req.engine_id) if req is not None else None
        # Checked again: either side may have left the namespace meanwhile
        # (``invalidation.py``); then the pages are not handed on at all.
        if req is not None and taker is not None and slab.pages and not engine.failed \
                and self.cache.may_hand_on(engine, taker, list(route.blocks)):
            owner = owner_tag(taker)   # handed on: free under the taker's tag until its grow maps them
            req.handoffs.append(Handoff(list(slab.pages), list(slab.page_devices), route.blocks))
        elif route.way is Way.TIER and self.cache.tiering is not None and not engine.failed \
                and books.engines.get(engine.engine_id) is engine and len(slab.asked) == engine.num_workers:
            # Reclaimed from a running engine, every worker asked and none
            # left (a running engine's unmap ends only with each one's ack):
            # the daemon alone holds the pages now. Written before anything
            # below can re-grant or release them (effects run in order).
            self.cache.tiering.demote_reclaimed(engine, slab)
        if not self.cache.keep_orphan(engine, slab):
            for page_id, device in zip(slab.pages, slab.page_devices):
                books.pools[device].put_back([page_id], owner)
        books.pools[engine.device].engine_let_go(slab.adopted_pages)
        if books.departing.get(engine.serial) is engine and not engine.slabs:
            del books.departing[engine.serial]
            log.info("engine %s: all memory back in the pool", engine.engine_id)
        self.grows.progress()

    # ---------------------------------------------- departed and failed engines
    def unmap_all(self, engine: EngineRecord) -> None:
        """A departing engine's slabs are unmapped by the workers still there."""
        for slab in list(engine.slabs.values()):
            if slab.phase is not Phase.UNMAPPING:
                self.start_unmap(engine, slab)
        self.settle_departed(engine)

    def quarantine(self, engine: EngineRecord, why: str) -> None:
        """Its pages leave circulation until none of its processes is left to map them."""
        engine.failed = True
        log.error("engine %s failed (%s): %d slab(s) quarantined until its processes are gone",
                  engine.engine_id, why, len(engine.slabs))
        alive = self.books.channels.alive_ranks(engine)
        for slab in engine.slabs.values():
            # Waits for its processes to go (or a late ack of an unmap it was
            # asked for), never for a deadline; ranks that acked are done.
            waiting = slab.waiting & alive if slab.phase is Phase.UNMAPPING else set(alive)
            engine.begin_unmap(slab, waiting, float("inf"))
        self.settle_departed(engine)

    def settle_departed(self, engine: EngineRecord) -> None:
        """Slabs of a departed engine wait only for workers that still exist
        (a failed engine's: every worker alive when it failed, until it is
        gone or acknowledged an unmap it was asked for)."""
        books = self.books
        alive = books.channels.alive_ranks(engine)
        for slab in list(engine.slabs.values()):
            slab.waiting &= alive
            if not slab.waiting:
                self._unmapped(engine, slab)
        if not engine.slabs and books.departing.get(engine.serial) is engine:
            del books.departing[engine.serial]
