"""Rebuilding the tier's index from its disk store after a restart."""

from __future__ import annotations

from kvelastic.tier.index import TierIndex
from kvelastic.tier.store import ScanResult, TierStore


def rebuild(index: TierIndex, store: TierStore, now: float, *, verify_payloads: bool = False) -> ScanResult:
    """Restore into ``index`` (empty, as a new daemon's is) every block ``store``
    finds whole. Files that fail their check are deleted by the scan (and
    counted as failures by reason); a block whose key another file holds
    already is deleted too (``dropped["not_restored"]``). Over the budget (a
    smaller one than before the restart), every block is restored first and
    then the index evicts as it always does, leaves of least value first
    (``budget`` evictions): the order the files were written in (a prefix's
    tail is often demoted before its head) never decides what stays.
    Values start again from each block's cost: hit counts are not persisted,
    and the monotonic clock they were measured on is gone with the process.
    Files no key proves this daemon's (``unkeyed``: every file of before
    version 3 at the upgrade) and names holding no regular file
    (``not_a_file``) are deleted and in ``dropped``, but not counted as
    blocks lost: they were never this daemon's blocks, and the alerts on
    lost blocks speak of a failing disk."""
    result = store.scan(verify_payloads=verify_payloads)
    if result.entries:
        index.skip_slots(result.entries[-1].slot + 1)   # a slot names one block for life, across restarts too
    level = index.last_level                        # what outlives a daemon: its last level's medium
    budget = index.budgets[level]
    index.budgets[level] = max(budget, index.level_used[level] + sum(e.nbytes for e in result.entries))
    for e in result.entries:
        if not index.restore(e.namespace, e.key, e.nbytes, e.slot, e.cost, now, e.parent):
            store.delete(e.slot)
            result.dropped["not_restored"] = result.dropped.get("not_restored", 0) + 1
    index.set_budget(budget, level)
    for slot in index.take_released():
        store.delete(slot)
    for reason, n in result.dropped.items():      # files of ours that failed their check: blocks lost
        if reason in index.stats.failures:
            index.stats.failures[reason] += n
    return result
