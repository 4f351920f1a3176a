"""Which cache an engine may still meet: invalidation (``kvelastic
invalidate``) and divergence (an engine whose weights may have changed in
memory takes a namespace of its own). Both cut cache off where it lives:
running engines' indexes, the kept cache of departed ones, and slabs in
transit between replicas, whose keys are dropped.

A mixin of ``Allocator`` (``allocator.py``), like ``handoff.py``: it reads
and writes the same books and does no I/O.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvelastic import protocol as p
from kvelastic.daemon.orphans import OrphanCache, OrphanSlab
from kvelastic.daemon.rejected import Rejected
from kvelastic.daemon.requests import GrowRequest, Handoff
from kvelastic.daemon.state import EngineRecord
from kvelastic.daemon.tenancy import Credential

log = logging.getLogger("kvelastic.daemon")


class CacheScope:
    # The allocator's books this part reads and writes (``Allocator.__init__`` sets them).
    engines: dict[str, EngineRecord]
    departing: dict[int, EngineRecord]
    grows: dict[int, GrowRequest]
    orphans: OrphanCache
    _cred: Credential | None

    if TYPE_CHECKING:  # the allocator's methods it calls
        def _command(self, identity: bytes, msg: p.Msg) -> int: ...
        def _own_engine(self, identity: bytes, engine_id: str) -> EngineRecord: ...
        def _release_orphans(self, slabs: list[OrphanSlab], why: str, reason: str) -> None: ...

    def _on_invalidate(self, identity: bytes, m: p.Invalidate) -> p.Msg:
        """Drop the prefix cache of a namespace or an engine: running engines
        clear their index, kept cache is released, cache in transit loses its
        keys. The operator may name anything; a tenant its own names only."""
        target = self._invalidation_target(m.target)
        targets = [e for e in self.engines.values() if target in (e.engine_id, e.namespace)]
        kept = sum(len(o.cached) for o in self.orphans if target in (o.namespace, o.engine_id))
        departing = any(target in (e.engine_id, e.namespace) for e in self.departing.values())
        if not targets and not kept and not departing:
            raise Rejected(p.Reason.UNKNOWN_TARGET, f"no engine, namespace or kept cache called {target!r}")
        for engine in targets:
            self._command(engine.identity, p.ClearIndex())
            self._forget_handoffs(engine)
            log.info("engine %s: prefix cache invalidated (%s)", engine.engine_id, target)
        dropped = self._invalidate_kept(target)
        if dropped:
            log.info("%s: %d kept cached block(s) invalidated", target, dropped)
        return p.Invalidated(engines=len(targets), kept_blocks=dropped)

    def _invalidation_target(self, target: str) -> str:
        """``target`` as the daemon knows it. A tenant names its own engines
        and namespaces, with or without its ``@uid<N>``; naming another's is
        refused (the operator's credential may name anything)."""
        cred = self._cred
        if cred is None or not cred.tenant or cred.operator:
            return target
        own = cred.scope("")
        if target.endswith(own):
            return target
        names = {n for e in (*self.engines.values(), *self.departing.values()) for n in (e.engine_id, e.namespace)}
        names |= {n for o in self.orphans for n in (o.namespace, o.engine_id)}
        if target in names:
            raise Rejected(p.Reason.NOT_OPERATOR, f"{target!r} is not uid {cred.uid}'s: only the operator or its "
                                                  "owner may invalidate it")
        return cred.scope(target)

    def _on_diverge(self, identity: bytes, m: p.Diverge) -> p.Msg:
        """The engine's weights may have changed in memory: it moves to a
        namespace of its own (the one it chose) and turns private, so that
        nothing it caches from now on reaches an engine of the checkpoint, as
        a hand-on or as kept cache, and nothing of theirs reaches it."""
        engine = self._own_engine(identity, m.engine_id)
        if m.namespace != engine.namespace:
            taken = any(e.namespace == m.namespace for e in (*self.engines.values(), *self.departing.values()))
            if taken or any(o.namespace == m.namespace for o in self.orphans):
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
        seqs = {seq for seq, req in self.grows.items() if req.engine_id == engine.engine_id}
        for seq in seqs:
            req = self.grows[seq]
            req.handoffs = [Handoff(h.pages, h.page_devices, ()) for h in req.handoffs]
        for other in (*self.engines.values(), *self.departing.values()):
            for slab in other.slabs.values():
                if other is engine or slab.handoff_to in seqs:
                    slab.handoff = ()

    def _invalidate_kept(self, target: str) -> int:
        """Drop the kept cache of namespace ``target``, or left by engine
        ``target``, and what departing engines of it would have kept.
        Returns the blocks dropped."""
        gone = self.orphans.take_matching(target)
        self._release_orphans(gone, "invalidated", "invalidate")
        for engine in self.departing.values():
            if target in (engine.engine_id, engine.namespace):
                for slab in engine.slabs.values():
                    slab.orphan = False
                self._forget_handoffs(engine)
        return sum(len(o.cached) for o in gone)
