"""Which cache an engine may still meet: invalidation (``kvelastic
invalidate``) and divergence (an engine whose weights may have changed in
memory takes a namespace of its own). Both cut cache off where it lives:
running engines' indexes, the kept cache of departed ones, and slabs in
transit between replicas, whose keys are dropped.

The allocator's part for both; it keeps no state of its own and does no I/O.
"""

from __future__ import annotations

import logging

from kvelastic import protocol as p
from kvelastic.daemon import effects as fx
from kvelastic.daemon.books import Books
from kvelastic.daemon.handoff import CacheHandoff
from kvelastic.daemon.parts import GrowPass
from kvelastic.daemon.rejected import Rejected
from kvelastic.daemon.requests import Handoff
from kvelastic.daemon.state import EngineRecord, Way

log = logging.getLogger("kvelastic.daemon")


class CacheScope:
    def __init__(self, books: Books, cache: CacheHandoff, grows: GrowPass) -> None:
        self.books = books
        self.cache = cache
        self.grows = grows

    def on_invalidate(self, identity: bytes, m: p.Invalidate) -> p.Msg:
        """Drop the prefix cache of a namespace or an engine: running engines
        clear their index, kept cache is released, cache in transit loses its
        keys, and a namespace's blocks leave the node's tier (whose files the
        loop deletes). The operator may name anything; a tenant its own names only."""
        target = self._target(m.target)
        targets = [e for e in self.books.engines.values() if target in (e.engine_id, e.namespace)]
        kept = sum(len(o.cached) for o in self.books.orphans if target in (o.namespace, o.engine_id))
        departing = any(target in (e.engine_id, e.namespace) for e in self.books.departing.values())
        tier = self.books.tier
        in_tier = tier is not None and target in tier.namespaces()
        if not targets and not kept and not departing and not in_tier:
            raise Rejected(p.Reason.UNKNOWN_TARGET, f"no engine, namespace or kept cache called {target!r}")
        for engine in targets:
            engine.clears_sent += 1
            self.books.command(engine.identity, p.ClearIndex(scope=engine.clears_sent))
            self._forget_handoffs(engine)
            log.info("engine %s: prefix cache invalidated (%s)", engine.engine_id, target)
        dropped = self._invalidate_kept(target)
        if dropped:
            log.info("%s: %d kept cached block(s) invalidated", target, dropped)
        tier_blocks = 0
        if tier is not None and in_tier:
            # Their files go before the reply (the loop performs effects in
            # order), writes still queued or running included: a restart
            # right after it, graceful or not, finds nothing of them.
            writing = tier.writing(target)
            tier_blocks = tier.invalidate(target)
            self.books.emit(fx.DeleteTierBlocks(tuple(tier.take_released())))
            log.info("%s: %d block(s) of the tier invalidated (%d being written: cancelled)", target, tier_blocks,
                     writing)
        return p.Invalidated(engines=len(targets), kept_blocks=dropped, tier_blocks=tier_blocks)

    def _target(self, target: str) -> str:
        """``target`` as the daemon knows it. A tenant names its own engines
        and namespaces, with or without its ``@uid<N>``; naming another's is
        refused (the operator's credential may name anything)."""
        cred = self.books.cred
        if cred is None or not cred.tenant or cred.operator:
            return target
        own = cred.scope("")
        if target.endswith(own):
            return target
        books = self.books
        names = {n for e in (*books.engines.values(), *books.departing.values()) for n in (e.engine_id, e.namespace)}
        names |= {n for o in books.orphans for n in (o.namespace, o.engine_id)}
        names |= set(books.tier.namespaces()) if books.tier is not None else set()
        if target in names:
            raise Rejected(p.Reason.NOT_OPERATOR, f"{target!r} is not uid {cred.uid}'s: only the operator or its "
                                                  "owner may invalidate it")
        return cred.scope(target)

    def on_diverge(self, identity: bytes, m: p.Diverge) -> p.Msg:
        """The engine's weights may have changed in memory: it moves to a
        namespace of its own (the one it chose) and turns private, so that
        nothing it caches from now on reaches an engine of the checkpoint, as
        a hand-on or as kept cache, and nothing of theirs reaches it."""
        books = self.books
        engine = books.own_engine(identity, m.engine_id)
        if m.namespace != engine.namespace:
            taken = any(e.namespace == m.namespace for e in (*books.engines.values(), *books.departing.values()))
            if taken or any(o.namespace == m.namespace for o in books.orphans):
                raise Rejected(p.Reason.BAD_REQUEST, f"namespace {m.namespace!r} is in use: a diverged engine's "
                                                     "namespace must be new")
            log.info("engine %s: weights may have changed (%s): its cache is its own from now on "
                     "(namespace %s, was %s)", engine.engine_id, m.reason or "-", m.namespace, engine.namespace)
        engine.namespace, engine.private = m.namespace, True
        self._forget_handoffs(engine)
        return p.Ok()

    def _forget_handoffs(self, engine: EngineRecord) -> None:
        """Cache on its way to or from ``engine`` travels without its keys
        from now on (its pages still go where they were going): its namespace
        changed under it, or was invalidated. Slabs it maps now, slabs it
        gives up for a replica, and slabs replicas give up for its grows."""
        engine.scope_changes += 1
        mine = self.grows.of_engine(engine.engine_id)
        seqs = {req.seq for req in mine}
        for req in mine:
            req.handoffs = [Handoff(h.pages, h.page_devices, ()) for h in req.handoffs]
        for other in (*self.books.engines.values(), *self.books.departing.values()):
            for slab in other.slabs.values():
                if other is engine or (slab.route.way is Way.REPLICA and slab.route.grow in seqs):
                    slab.forget_blocks()

    def _invalidate_kept(self, target: str) -> int:
        """Drop the kept cache of namespace ``target``, or left by engine
        ``target``, and what departing engines of it would have kept.
        Returns the blocks dropped."""
        gone = self.books.orphans.take_matching(target)
        self.cache.release(gone, "invalidated", "invalidate")
        for engine in self.books.departing.values():
            if target in (engine.engine_id, engine.namespace):
                for slab in engine.slabs.values():
                    slab.orphan = False
                self._forget_handoffs(engine)
        return sum(len(o.cached) for o in gone)
