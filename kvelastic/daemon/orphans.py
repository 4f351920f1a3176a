"""Orphaned cache: slabs of departed engines, kept for their namespace.

When an engine leaves (unregistered, killed, its lifeline gone: anything but
a failure, whose pages are quarantined), each slab holding valid cached
blocks (their key stored in a model step that finished: ``journal.py``)
stays, once no process maps it, as cache of the engine's namespace. The next
engine of that namespace and slab shape to grow maps those very pages, not
zeroed, and adopts the blocks (a warm start); nobody else ever sees them.

Kept slabs are the first memory to yield: a demand of any engine that finds
the budget full releases them (oldest first) before anything is reclaimed
from a running engine, and each expires after the orphan TTL. With a keeper
(``kvelastic keeper``) they survive the daemon: the loop saves them
(``saved.py``) whenever ``version`` moved, and a successor adopts them. No
I/O here: the allocator moves pages in and out of these books and the loop
releases what it is told.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from kvelastic import protocol as p
from kvelastic.daemon.state import SlabShape
from kvelastic.status_report import OrphanStatus


@dataclasses.dataclass(eq=False)
class OrphanSlab:
    namespace: str
    shape: SlabShape
    pages: list[int]
    page_devices: list[str]
    cached: tuple[p.CachedBlock, ...]   # valid cached blocks, in the order they were stored
    since: float                        # when it was kept (the TTL runs from here)
    engine_id: str                      # the engine that left it


class OrphanCache:
    """The kept slabs, oldest first."""

    def __init__(self) -> None:
        self.slabs: list[OrphanSlab] = []
        # Blocks dropped from the kept cache, by (device, eviction reason).
        self.evicted: dict[tuple[str, str], int] = {}
        # Moves on every change of ``slabs``: the saved books are current
        # while it has not moved since they were written.
        self.version = 0

    def __bool__(self) -> bool:
        return bool(self.slabs)

    def __iter__(self) -> Iterator[OrphanSlab]:
        return iter(self.slabs)

    def keep(self, slab: OrphanSlab) -> None:
        self.slabs.append(slab)
        self.version += 1

    def adopt(self, slabs: list[OrphanSlab]) -> None:
        """A predecessor's kept slabs (``saved.adopt``), ahead of any kept since, oldest first."""
        self.slabs[:0] = sorted(slabs, key=lambda o: o.since)
        self.version += 1

    def count(self, namespace: str, shape: SlabShape) -> int:
        return sum(1 for o in self.slabs if o.namespace == namespace and o.shape == shape)

    def take(self, namespace: str, shape: SlabShape, n: int) -> list[OrphanSlab]:
        """Up to ``n`` slabs an engine of ``namespace`` and ``shape`` can map as they are."""
        taken = [o for o in self.slabs if o.namespace == namespace and o.shape == shape][:max(0, n)]
        self._drop(taken)
        return taken

    def take_matching(self, target: str) -> list[OrphanSlab]:
        """Every slab of namespace ``target`` or left by engine ``target``."""
        taken = [o for o in self.slabs if target in (o.namespace, o.engine_id)]
        self._drop(taken)
        return taken

    def count_evicted(self, slabs: list[OrphanSlab], reason: str) -> None:
        for o in slabs:
            key = (o.shape.device, reason)
            self.evicted[key] = self.evicted.get(key, 0) + len(o.cached)

    def evictions_on(self, device: str) -> dict[str, int]:
        return {reason: n for (d, reason), n in self.evicted.items() if d == device}

    def expired(self, now: float, ttl: float) -> list[OrphanSlab]:
        gone = [o for o in self.slabs if now - o.since >= ttl]
        self._drop(gone)
        return gone

    def yield_pages(self, device: str, pages: int) -> list[OrphanSlab]:
        """Oldest slabs with pages on ``device`` until ``pages`` of them are freed."""
        taken: list[OrphanSlab] = []
        for o in self.slabs:
            if pages <= 0:
                break
            on_device = o.page_devices.count(device)
            if on_device:
                taken.append(o)
                pages -= on_device
        self._drop(taken)
        return taken

    def pages_on(self, device: str) -> list[int]:
        return [pg for o in self.slabs for pg, d in zip(o.pages, o.page_devices) if d == device]

    def status(self, now: float, page_size: int) -> list[OrphanStatus]:
        by: dict[tuple[str, str], OrphanStatus] = {}
        for o in self.slabs:
            row = by.get((o.namespace, o.shape.device))
            if row is None:
                row = by[(o.namespace, o.shape.device)] = OrphanStatus(
                    namespace=o.namespace, device=o.shape.device, slabs=0, blocks=0, bytes=0, oldest_seconds=0.0)
            row.slabs += 1
            row.blocks += len(o.cached)
            row.bytes += len(o.pages) * page_size
            row.oldest_seconds = max(row.oldest_seconds, now - o.since)
        return list(by.values())

    def _drop(self, slabs: list[OrphanSlab]) -> None:
        if slabs:
            ids = {id(o) for o in slabs}
            self.slabs = [o for o in self.slabs if id(o) not in ids]
            self.version += 1
