"""Cache that changes hands with its pages, within a namespace: the
allocator's part that hands a reclaimed slab on to a replica, keeps a
departed engine's valid cache (``orphans.py``) and maps it into the next
engine of its namespace (warm start).

A mixin of ``Allocator`` (``allocator.py``): it reads and writes the same
books; nothing here does I/O. The rule it keeps (invariant 6's one
exception): pages go with their KV only to an engine of the same namespace
(model, weights, tenant salt) and slab shape; anyone else gets fresh pages.
A private engine (its weights may have changed in memory: ``Diverge``) is
alone in its namespace: it neither gives nor takes cache, and leaves none.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, cast

from kvelastic import protocol as p
from kvelastic.daemon import effects as fx
from kvelastic.daemon.orphans import OrphanCache, OrphanSlab
from kvelastic.daemon.requests import GrowRequest, Timing
from kvelastic.daemon.state import EngineRecord, PagePool, Phase, SlabRecord, owner_tag, shape_of

log = logging.getLogger("kvelastic.daemon")


class CacheHandoff:
    # The allocator's books this part reads and writes (``Allocator.__init__`` sets them).
    pools: dict[str, PagePool]
    orphans: OrphanCache
    timing: Timing
    _now: float
    _out: list[fx.Effect]

    if TYPE_CHECKING:  # the allocator's methods it calls
        def _start_map(self, engine: EngineRecord, slab_id: int, pages: list[int], page_devices: list[str],
                       req: GrowRequest | None) -> None: ...

    # ------------------------------------------------- between live replicas
    @staticmethod
    def _may_hand_on(giver: EngineRecord, taker: EngineRecord, cached: list[p.CachedBlock]) -> bool:
        """A slab's KV may go to ``taker`` as it is only within a namespace (the
        tenant salt is part of it: never across tenants) and between the same
        slab shape, so each block lands where its bytes are."""
        return (giver.namespace == taker.namespace and not giver.private and not taker.private
                and shape_of(giver) == shape_of(taker) and all(c.offset < giver.blocks_per_slab for c in cached))

    def _map_handoff(self, engine: EngineRecord, slab_id: int, req: GrowRequest) -> bool:
        """Map a slab handed on to ``req`` by an engine of its namespace: the
        same pages, not zeroed, with their cached blocks. False when there is
        none (or its pages went meanwhile: then it is dropped)."""
        owner = owner_tag(engine)
        while req.handoffs:
            handoff = req.handoffs.pop(0)
            if not all(self.pools[d].free.get(pg) == owner for pg, d in zip(handoff.pages, handoff.page_devices)):
                continue
            for page, device in zip(handoff.pages, handoff.page_devices):
                self.pools[device].take_exact([page], owner)
            self._map_kept(engine, slab_id, handoff.pages, handoff.page_devices, handoff.cached, req)
            return True
        return False

    def _map_kept(self, engine: EngineRecord, slab_id: int, pages: list[int], page_devices: list[str],
                  cached: tuple[p.CachedBlock, ...], req: GrowRequest) -> None:
        self._start_map(engine, slab_id, pages, page_devices, req)
        slab = engine.slabs.get(slab_id)
        if slab is not None:
            slab.handoff = cached

    @staticmethod
    def _handed(engine: EngineRecord, slab_ids: list[int]) -> dict[int, list[p.CachedBlock]]:
        """The cached blocks that came with these slabs, for the grant."""
        out: dict[int, list[p.CachedBlock]] = {}
        for slab_id in slab_ids:
            slab = engine.slabs.get(slab_id)
            if slab is not None and slab.handoff:
                out[slab_id] = list(slab.handoff)
                slab.handoff = ()
        return out

    # ------------------------------------------------------ orphaned cache
    def _mark_orphans(self, engine: EngineRecord) -> int:
        """The engine is leaving (not failed): each held slab is to be kept
        as cache of its namespace once no process maps it, with the blocks
        then valid. Until then the departing engine's journals still reach
        its mirror (``journal_intake.accept_departed``): a worker dies first and the
        engine may run steps before it follows, whose dropped keys must
        count. Returns the slabs marked."""
        if self.timing.orphan_ttl <= 0 or engine.failed or engine.private:
            return 0
        marked = 0
        for slab in engine.slabs.values():
            if slab.phase is Phase.HELD and slab.pages:   # adopted after a daemon restart: no handle here
                slab.orphan = True
                marked += 1
        return marked

    def _keep_orphan(self, engine: EngineRecord, slab: SlabRecord) -> bool:
        """``slab`` of a departed engine is unmapped everywhere: keep it as
        cache of the namespace if it was marked and holds valid blocks (keys
        stored in a step that finished, as the mirror has them now; a key two
        blocks hold is kept once). True when kept."""
        if not slab.orphan or engine.failed or engine.private or not slab.pages or self.timing.orphan_ttl <= 0:
            return False
        kept = []
        first = slab.slab_id * engine.blocks_per_slab
        labels = engine.mirror.label_of
        for offset, key in engine.mirror.valid_in(slab.slab_id, engine.blocks_per_slab):
            wire = cast(bytes, key)
            if wire not in engine.kept_keys:
                engine.kept_keys.add(wire)
                kept.append(p.CachedBlock(offset, wire, labels.get(first + offset, b"")))
        if not kept:
            return False
        self.orphans.keep(OrphanSlab(engine.namespace, shape_of(engine), list(slab.pages), list(slab.page_devices),
                                     tuple(kept), self._now, engine.engine_id))
        return True

    def _adopt_orphans(self, engine: EngineRecord, req: GrowRequest, room: int) -> int:
        """Warm start: a grow of ``engine`` maps every kept slab of its
        namespace and shape it has room for, on top of what it asked for.
        Returns the slabs mapped."""
        if not self.orphans or room <= 0 or engine.private:
            return 0
        shape = shape_of(engine)
        # Slab ids still unmapping are taken too: never more than the ids free.
        wanted = min(room, self.orphans.count(engine.namespace, shape), engine.max_slabs - len(engine.slabs))
        if not wanted:
            return 0
        taken = self.orphans.take(engine.namespace, shape, wanted)
        for orphan in taken:
            slab_id = engine.free_slab_id()
            assert slab_id is not None     # wanted <= the ids free
            self._map_kept(engine, slab_id, orphan.pages, orphan.page_devices, orphan.cached, req)
            req.wanted += 1
        if taken:
            log.info("engine %s: warm start: %d kept slab(s) of namespace %s with %d cached block(s), "
                     "left by %s", engine.engine_id, len(taken), engine.namespace,
                     sum(len(o.cached) for o in taken), ", ".join(sorted({o.engine_id for o in taken})))
        return len(taken)

    def _expire_orphans(self) -> None:
        ttl = self.timing.orphan_ttl
        if self.orphans:
            self._release_orphans(self.orphans.expired(self._now, ttl), f"older than {ttl:g} s", "ttl")

    def _yield_orphans(self, device: str, pages: int, for_engine: str) -> None:
        """A demand found the budget full: kept cache goes first (oldest first)."""
        if self.orphans:
            self._release_orphans(self.orphans.yield_pages(device, pages), f"memory for engine {for_engine}",
                                  "reclaim")

    def _release_orphans(self, slabs: list[OrphanSlab], why: str, reason: str) -> None:
        """Give kept slabs' pages back; their blocks count as evicted for
        ``reason`` (``kvelastic_prefix_cache_evictions_total``, engine "")."""
        self.orphans.count_evicted(slabs, reason)
        by_device: dict[str, list[int]] = {}
        for o in slabs:
            for page, device in zip(o.pages, o.page_devices):
                by_device.setdefault(device, []).append(page)
        for device, pages in by_device.items():
            self.pools[device].created -= len(pages)
            self._out.append(fx.ReleasePages(device, tuple(pages)))
        by_ns: dict[str, int] = {}
        for o in slabs:
            by_ns[o.namespace] = by_ns.get(o.namespace, 0) + 1
        for namespace, n in sorted(by_ns.items()):
            log.info("namespace %s: %d kept cache slab(s) released (%s)", namespace, n, why)
