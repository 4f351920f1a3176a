"""Reclaims: the allocator's part that asks engines to give memory back for
another engine's demand (the victims ``arbiter.py`` picks), hears their
answers and counts memory that moves back and forth (thrash).

It owns the reclaims pending; a slab given up is unmapped by
``unmapping.py``, and with its cached blocks it may go on to a replica of
the same namespace (``handoff.py``), or else, with a node tier, its blocks
valid when it was asked for and still cached when given up are demoted
into the tier once unmapped (``state.Way.TIER``). Nothing here
does I/O.
"""

from __future__ import annotations

import logging

from kvelastic import protocol as p
from kvelastic.daemon.arbiter import fair_share, pick_drains, pick_victims
from kvelastic.daemon.books import Books
from kvelastic.daemon.handoff import CacheHandoff
from kvelastic.daemon.parts import GrowPass, Unmapper
from kvelastic.daemon.rejected import Rejected
from kvelastic.daemon.requests import GrowRequest, ReclaimRequest
from kvelastic.daemon.state import EngineRecord, Phase, Way

log = logging.getLogger("kvelastic.daemon")


class Reclaims:
    def __init__(self, books: Books, cache: CacheHandoff, grows: GrowPass, unmapper: Unmapper) -> None:
        self.books = books
        self.cache = cache
        self.grows = grows
        self.unmapper = unmapper
        self.pending: dict[int, ReclaimRequest] = {}    # by the Reclaim's request id

    def reclaim_for(self, req: GrowRequest, requester: EngineRecord, short: int) -> None:
        books = self.books
        # Not twice, and not a slab mapped for a grow still in progress: its
        # engine does not hold it yet and would refuse.
        exclude = frozenset({(r.engine_id, s) for r in self.pending.values() for s in r.slabs}
                            | self.grows.slabs_in_flight())
        victims = pick_victims(list(books.engines.values()), requester, short, books.now, books.rules, exclude)
        by_engine: dict[str, list[int]] = {}
        for engine, slab_id in victims:
            by_engine.setdefault(engine.engine_id, []).append(slab_id)
        tiering = self.cache.tiering
        for engine_id, slabs in by_engine.items():
            engine = books.engines[engine_id]
            if tiering is not None and tiering.takes_reclaimed(engine) and engine.keys_current:
                # What the tier may take of each once given up: its valid
                # blocks now. An invalidation of the engine's namespace before
                # the answer clears it (``invalidation.py``: ``forget_blocks``).
                for slab_id, valid in tiering.valid_blocks(engine, slabs).items():
                    engine.slabs[slab_id].note(tuple(valid))
        for engine_id, slabs in by_engine.items():
            rid = books.command(books.engines[engine_id].identity, p.Reclaim(slabs=slabs))
            self.pending[rid] = ReclaimRequest(engine_id, slabs, req, books.now + books.timing.reclaim_timeout,
                                               (books.engines[engine_id].scope_changes, requester.scope_changes))
            req.reclaims.add(rid)
            log.info("engine %s: asked to give up %d slab(s) for engine %s", engine_id, len(slabs),
                     requester.engine_id)

    def fair_share(self, engine: EngineRecord) -> int:
        books = self.books
        budget = books.pools[engine.device].budget_pages * engine.page_size if engine.device in books.pools else 0
        return fair_share(list(books.engines.values()), engine, budget, books.now, books.rules)

    def drain_for(self, requester: EngineRecord, short: int) -> None:
        books, now = self.books, self.books.now
        draining: dict[str, set[int]] = {}
        for engine in books.engines.values():
            if now >= engine.drain_until:
                engine.draining.clear()      # lapsed: the engine uses them again (``Drain.seconds``)
            else:
                engine.draining = {s for s in engine.draining
                                   if (slab := engine.slabs.get(s)) is not None and slab.phase is Phase.HELD}
            draining[engine.engine_id] = engine.draining
        fair = self.fair_share(requester)
        for engine, slabs in pick_drains(list(books.engines.values()), requester, short, fair, draining):
            engine.draining.update(slabs)
            engine.drain_until = now + p.DRAIN_SECONDS
            books.command(engine.identity, p.Drain(slabs=slabs, seconds=p.DRAIN_SECONDS))
            log.info("engine %s: asked to drain %d slab(s) for engine %s (holds %d MiB, a fair share is %d MiB)",
                     engine.engine_id, len(slabs), requester.engine_id,
                     engine.owned_slabs() * engine.slab_bytes >> 20, fair >> 20)

    def on_reclaim_done(self, identity: bytes, m: p.ReclaimDone) -> None:
        books = self.books
        books.own_engine(identity, m.engine_id)
        rec = self.pending.get(m.req_id)
        if rec is None or rec.engine_id != m.engine_id:
            raise Rejected(p.Reason.UNEXPECTED_ACK, f"engine {m.engine_id}: no reclaim {m.req_id} pending")
        if not set(m.given) <= set(rec.slabs) or not set(m.refused) <= set(rec.slabs):
            raise Rejected(p.Reason.BAD_REQUEST, f"engine {m.engine_id} answered for slabs it was not asked for")
        if not set(m.settled) <= set(m.given):
            raise Rejected(p.Reason.BAD_REQUEST, f"engine {m.engine_id} called settled a slab it did not give up")
        engine = books.engine(m.engine_id)
        del self.pending[m.req_id]
        requester = books.engines.get(rec.grow.engine_id)
        # The engine answers a reclaim before it hears of an invalidation (or
        # divergence) sent after it, so the cached blocks it lists may predate
        # it: such an answer hands its pages on without their keys.
        current = rec.scopes[0] == engine.scope_changes and engine.keys_current and \
            (requester is None or rec.scopes[1] == requester.scope_changes)
        for slab_id in m.given:
            slab = engine.slabs.get(slab_id)
            if slab is not None and slab.phase is Phase.HELD:
                engine.reclaims += 1
                rec.grow.incoming.add((engine.engine_id, slab_id))
                self._moved(engine, rec.grow.engine_id)
                valid = slab.noted
                cached = m.cached.get(slab_id) if current else None
                if cached and requester is not None and self.cache.may_hand_on(engine, requester, cached):
                    slab.given_up(Way.REPLICA, tuple(cached), rec.grow.seq)
                elif cached and valid and self.cache.tiering is not None:
                    # No replica takes its KV: into the tier once unmapped.
                    slab.given_up(Way.TIER, self.cache.tiering.reclaimed(valid, cached))
                else:
                    slab.given_up(Way.NOWHERE)
                self.unmapper.start_unmap(engine, slab, at_once=slab_id in m.settled)
        self._unmark(engine, rec.slabs)        # refused (or not answered for): held on, nothing to demote
        if m.refused:
            log.info("engine %s: refused %d slab(s) (in use again)", m.engine_id, len(m.refused))
        rec.grow.reclaims.discard(m.req_id)
        self.grows.progress()

    def expire(self) -> None:
        """Reclaims not answered by their deadline count as refused."""
        now = self.books.now
        for rid, rec in list(self.pending.items()):
            if now > rec.deadline:
                del self.pending[rid]
                engine = self.books.engines.get(rec.engine_id)
                if engine is not None:
                    self._unmark(engine, rec.slabs)
                log.warning("engine %s: no answer to a reclaim of %d slab(s): treated as refused",
                            rec.engine_id, len(rec.slabs))
                rec.grow.reclaims.discard(rid)

    def end_for(self, engine_id: str) -> None:
        """``engine_id`` left: the reclaims asked of it end now (refused)."""
        for rid in [rid for rid, rec in self.pending.items() if rec.engine_id == engine_id]:
            self.pending.pop(rid).grow.reclaims.discard(rid)

    @staticmethod
    def _unmark(engine: EngineRecord, slabs: list[int]) -> None:
        """Slabs asked for and still held: what ``reclaim_for`` noted for the
        tier is forgotten (their blocks may change before any next reclaim)."""
        for slab_id in slabs:
            slab = engine.slabs.get(slab_id)
            if slab is not None:
                slab.unnote()

    def _moved(self, source: EngineRecord, to_id: str) -> None:
        """A slab of ``source`` goes to engine ``to_id``: counted, and thrash if it
        is a move back (``source`` got memory from ``to_id`` moments ago)."""
        books = self.books
        books.moves[source.device] += 1
        if books.now - source.received_from.get(to_id, -1e18) < p.THRASH_WINDOW:
            books.thrash[source.device] += 1
            log.warning("engine %s: memory moved back to engine %s within %g s (thrash)", source.engine_id,
                        to_id, p.THRASH_WINDOW)
        target = books.engines.get(to_id)
        if target is not None:
            target.received_from[source.engine_id] = books.now
