"""Rebuilding the tier's index from its disk store after a restart."""

from __future__ import annotations

from kvelastic.tier.disk import DiskStore, ScanResult
from kvelastic.tier.index import TierIndex


def rebuild(index: TierIndex, store: DiskStore, now: float, *, verify_payloads: bool = False) -> ScanResult:
    """Restore into ``index`` (empty, as a new daemon's is) every block ``store``
    finds whole. Files that fail their check are deleted by the scan; a block
    whose key another file holds already, or that the budget has no room for
    (a smaller budget than before the restart: the least valuable go, counted
    as ``budget`` evictions), is deleted too (``dropped["not_restored"]``).
    Values start again from each block's cost: hit counts are not persisted,
    and the monotonic clock they were measured on is gone with the process."""
    result = store.scan(verify_payloads=verify_payloads)
    if result.entries:
        index.skip_slots(result.entries[-1].slot + 1)   # a slot names one block for life, across restarts too
    for e in result.entries:
        if not index.restore(e.namespace, e.key, e.nbytes, e.slot, e.cost, now, e.parent):
            store.delete(e.slot)
            result.dropped["not_restored"] = result.dropped.get("not_restored", 0) + 1
    for slot in index.take_released():
        store.delete(slot)
    return result
