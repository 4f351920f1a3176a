"""Cache that changes hands with its pages, within a namespace: the
allocator's part that decides when a reclaimed slab goes on to a replica
with its KV, keeps a departed engine's valid cache (``orphans.py``) for the
next engine of its namespace (warm start), and lets kept cache go.

The rule it keeps (invariant 6's one exception): pages go with their KV
only to an engine of the same namespace (model, weights, tenant salt) and
slab shape; anyone else gets fresh pages. A private engine (its weights may
have changed in memory: ``Diverge``) is alone in its namespace: it neither
gives nor takes cache, and leaves none. It decides what is handed on or
kept; ``growth.py`` maps it. Nothing here does I/O.
"""

from __future__ import annotations

import logging
from typing import cast

from kvelastic import protocol as p
from kvelastic.daemon import effects as fx
from kvelastic.daemon.books import Books
from kvelastic.daemon.orphans import OrphanSlab
from kvelastic.daemon.requests import GrowRequest, Handoff
from kvelastic.daemon.state import EngineRecord, Phase, SlabRecord, owner_tag, shape_of
from kvelastic.daemon.tiering import Tiering

log = logging.getLogger("kvelastic.daemon")


class CacheHandoff:
    def __init__(self, books: Books, tiering: Tiering | None = None) -> None:
        self.books = books
        self.tiering = tiering       # kept cache released is demoted into the node's tier first

    # ------------------------------------------------- between live replicas
    @staticmethod
    def may_hand_on(giver: EngineRecord, taker: EngineRecord, cached: list[p.CachedBlock]) -> bool:
        """A slab's KV may go to ``taker`` as it is only within a namespace (the
        tenant salt is part of it: never across tenants) and between the same
        slab shape, so each block lands where its bytes are."""
        return (giver.namespace == taker.namespace and not giver.private and not taker.private
                and shape_of(giver) == shape_of(taker) and all(c.offset < giver.blocks_per_slab for c in cached))

    def take_handoff(self, engine: EngineRecord, req: GrowRequest) -> Handoff | None:
        """A slab handed on to ``req`` by an engine of its namespace, its pages
        taken from the pool for ``engine`` to map as they are (not zeroed).
        None when there is none (one whose pages went meanwhile is dropped)."""
        owner = owner_tag(engine)
        pools = self.books.pools
        while req.handoffs:
            handoff = req.handoffs.pop(0)
            if not all(pools[d].free.get(pg) == owner for pg, d in zip(handoff.pages, handoff.page_devices)):
                continue
            for page, device in zip(handoff.pages, handoff.page_devices):
                pools[device].take_exact([page], owner)
            return handoff
        return None

    @staticmethod
    def handed(engine: EngineRecord, slab_ids: list[int]) -> dict[int, list[p.CachedBlock]]:
        """The cached blocks that came with these slabs, for the grant."""
        out: dict[int, list[p.CachedBlock]] = {}
        for slab_id in slab_ids:
            slab = engine.slabs.get(slab_id)
            blocks = slab.take_adopted() if slab is not None else ()
            if blocks:
                out[slab_id] = list(blocks)
        return out

    # ------------------------------------------------------ orphaned cache
    def mark_orphans(self, engine: EngineRecord) -> int:
        """The engine is leaving (not failed): each held slab is to be kept
        as cache of its namespace once no process maps it, with the blocks
        then valid. Until then the departing engine's journals still reach
        its mirror (``journal_intake.accept_departed``): a worker dies first and the
        engine may run steps before it follows, whose dropped keys must
        count. Returns the slabs marked."""
        if self.books.timing.orphan_ttl <= 0 or engine.failed or engine.private:
            return 0
        marked = 0
        for slab in engine.slabs.values():
            if slab.phase is Phase.HELD and slab.pages:   # adopted after a daemon restart: no handle here
                slab.orphan = True
                marked += 1
        return marked

    def keep_orphan(self, engine: EngineRecord, slab: SlabRecord) -> bool:
        """``slab`` of a departed engine is unmapped everywhere: keep it as
        cache of the namespace if it was marked and holds valid blocks (keys
        stored in a step that finished, as the mirror has them now; a key two
        blocks hold is kept once). True when kept."""
        if not slab.orphan or engine.failed or engine.private or not slab.pages \
                or self.books.timing.orphan_ttl <= 0 or not engine.keys_current:
            return False        # (not current: it left before it cleared keys an invalidation dropped)
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
        self.books.orphans.keep(OrphanSlab(engine.namespace, shape_of(engine), list(slab.pages),
                                           list(slab.page_devices), tuple(kept), self.books.now, engine.engine_id))
        return True

    def take_kept(self, engine: EngineRecord, room: int) -> list[OrphanSlab]:
        """Warm start: the kept slabs of ``engine``'s namespace and shape it has
        room for (``room`` slabs, and no more than its slab ids free), taken
        out of the cache for it to map."""
        orphans = self.books.orphans
        if not orphans or room <= 0 or engine.private:
            return []
        shape = shape_of(engine)
        # Slab ids still unmapping are taken too: never more than the ids free.
        wanted = min(room, orphans.count(engine.namespace, shape), engine.max_slabs - len(engine.slabs))
        if not wanted:
            return []
        taken = orphans.take(engine.namespace, shape, wanted)
        if taken:
            log.info("engine %s: warm start: %d kept slab(s) of namespace %s with %d cached block(s), "
                     "left by %s", engine.engine_id, len(taken), engine.namespace,
                     sum(len(o.cached) for o in taken), ", ".join(sorted({o.engine_id for o in taken})))
            if self.tiering is not None:
                # Written through to the tier first, while the daemon holds the
                # pages alone: the engine keeps only what its requests use, and
                # evicts the rest where nothing demotes it (``bench tier``: a
                # running engine took departed engines' kept cache within
                # milliseconds, and most of it never reached the tier).
                self.tiering.demote(taken)
        return taken

    def expire(self) -> None:
        ttl = self.books.timing.orphan_ttl
        if self.books.orphans:
            self.release(self.books.orphans.expired(self.books.now, ttl), f"older than {ttl:g} s", "ttl")

    def yield_pages(self, device: str, pages: int, for_engine: str) -> None:
        """A demand found the budget full: kept cache goes first (oldest first)."""
        if self.books.orphans:
            self.release(self.books.orphans.yield_pages(device, pages), f"memory for engine {for_engine}", "reclaim")

    def release(self, slabs: list[OrphanSlab], why: str, reason: str) -> None:
        """Give kept slabs' pages back; their blocks count as evicted for
        ``reason`` (``kvelastic_prefix_cache_evictions_total``, engine "")."""
        books = self.books
        books.orphans.count_evicted(slabs, reason)
        if self.tiering is not None and reason != "invalidate":   # invalidated KV goes nowhere
            self.tiering.demote(slabs)    # written before the pages go (``fx.DemoteBlocks``)
        by_device: dict[str, list[int]] = {}
        for o in slabs:
            for page, device in zip(o.pages, o.page_devices):
                by_device.setdefault(device, []).append(page)
        for device, pages in by_device.items():
            books.pools[device].released(len(pages))
            books.emit(fx.ReleasePages(device, tuple(pages)))
        by_ns: dict[str, int] = {}
        for o in slabs:
            by_ns[o.namespace] = by_ns.get(o.namespace, 0) + 1
        for namespace, n in sorted(by_ns.items()):
            log.info("namespace %s: %d kept cache slab(s) released (%s)", namespace, n, why)
