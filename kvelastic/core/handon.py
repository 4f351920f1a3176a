"""The pool's rare paths, where its cache meets others': blocks handed on
with a slab from another engine of the namespace (``cached_entries`` gives
them, ``adopt`` takes them), demotion, slabs promised to another engine
(``drain``), and invalidation (``clear_index``).

Draining: a slab promised back takes no new block and keeps none cached;
its free blocks are withheld (``num_withheld``: counted neither free nor
available, so vLLM admits only what the rest holds), and once its last
live block is freed it is given back (``drained_slabs``). It is how an
engine over its fair share yields memory that running requests hold: they
finish, their blocks go with the slab, none is taken from under them.

Demotion (``demote``): the daemon mirrors this pool's keys through the
journal and keeps a departed engine's valid blocks, so a block whose KV it
may keep must not be rewritten before it heard of the drop (``journal.py``:
the seal). Told ahead of time that the least recently used cached blocks,
the next to be evicted, will not be kept (``DEMOTE``), the daemon keeps
their keys but not their KV: they stay cached and hit here, and an eviction
that reuses one journals its ``REMOVE`` with nothing to seal. Invariant:
``demoted`` holds cached blocks only, never one in the open batch's
``stored``; once the journal is shipped the daemon's demoted blocks are
these. A demoted block that is hit is promoted (``PROMOTE``).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

from kvelastic.core.block import BlockRecord
from kvelastic.core.books import PoolBooks
from kvelastic.core.journal import LABEL
from kvelastic.core.stats import PoolStats
from kvelastic.errors import PoolBusy, PoolError, SlabBusy, UnknownSlab


class HandOnPool(PoolBooks):
    """``PoolBooks`` with the rare paths; ``SlabPool`` adds the hot ones."""

    # ---------------------------------------------------------- hand-on
    def cached_entries(self, slab_ids: Iterable[int]) -> dict[int, list[tuple[int, Hashable, bytes]]]:
        """Each slab's cached blocks as ``(offset in the slab, key, label)``
        (label ``b""`` if none), oldest first: what another engine of the
        namespace can adopt with the slab."""
        wanted = {sid: self._slabs[sid] for sid in slab_ids if sid in self._slabs}
        out: dict[int, list[tuple[int, Hashable, bytes]]] = {sid: [] for sid in wanted}
        labels = self._labels
        for blk in self._lru_blocks():
            slab = blk.slab
            if slab.slab_id in wanted:
                out[slab.slab_id].append((blk.block_id - slab.slab_id * self.blocks_per_slab, blk._block_hash,
                                          labels.get(blk.block_id, b"")))
        return out

    def labelled_keys(self) -> list[tuple[int, bytes]]:
        """(block_id, label) of every labelled keyed block: with ``cached_keys``, a resync."""
        return list(self._labels.items())

    def adopt(self, slab_id: int, entries: Sequence[tuple[int, Hashable] | tuple[int, Hashable, bytes]]) -> int:
        """A slab just granted arrived with its blocks' KV (handed on by an
        engine of the same namespace): the blocks at ``entries``' offsets
        become cached under their keys, older than every block cached here
        (oldest first in ``entries``), with their labels if the entries have
        them (``on_adopted`` hears of the labelled ones). A key this pool already caches is
        skipped (one block per key keeps eviction simple). All checked before
        anything changes. Returns the number of blocks adopted."""
        slab = self._slabs.get(slab_id)
        if slab is None:
            raise UnknownSlab(f"slab {slab_id} is not held")
        if slab.live or slab.cached:
            raise SlabBusy(f"slab {slab_id} is in use: only a slab just granted adopts blocks")
        offsets = [entry[0] for entry in entries]
        if len(set(offsets)) != len(offsets) or any(not 0 <= off < self.blocks_per_slab for off in offsets):
            raise PoolError(f"adopt: offsets {offsets} are not distinct places in a slab of "
                            f"{self.blocks_per_slab} blocks")
        seen: set[Hashable] = set()
        take = []
        for entry in entries:
            off, key = entry[0], entry[1]
            if key not in seen and self._index.get_one(key) is None:
                seen.add(key)
                take.append((slab.blocks[off], key, entry[2] if len(entry) > 2 else b""))
        if not take:
            return 0
        old_free = len(slab.free)
        taken = {blk.block_id for blk, _, _ in take}
        slab.free = [blk for blk in slab.free if blk.block_id not in taken]
        now = self._clock()
        self.journal.mark_store()
        for blk, key, label in reversed(take):      # the oldest ends up first in the LRU
            blk._block_hash = key
            self._index.insert(key, blk)
            self.journal.store(key, blk.block_id)
            if label:
                self._labels[blk.block_id] = label
                self.journal.ops.append((LABEL, blk.block_id, label))
            head = self._head       # first in the LRU: the oldest
            first = head.next_free_block
            blk.prev_free_block, blk.next_free_block = head, first
            head.next_free_block = first.prev_free_block = blk
            if self.ttl:
                self._cached_at[blk.block_id] = now
            self._adopted.add(blk.block_id)
        slab.cached += len(take)
        self.num_free -= len(take)
        self._rebucket(slab, old_free)
        self.journal.dirty.add(slab_id)
        self.stats.adopted_blocks += len(take)
        if self.on_adopted is not None and any(label for _, _, label in take):
            self.on_adopted([(key, label) for _, key, label in take if label])
        self._enforce_limits(now)
        return len(take)

    # --------------------------------------------------------- demotion
    def demote(self, lead: int) -> int:
        """Demote (module docstring) the least recently used cached blocks
        until free and demoted blocks together make ``lead``: what evictions
        may then reuse with nothing to seal. The caller writes the journal at
        once, and calls ``forget_demotions`` if it could not. Returns how
        many were demoted."""
        want = lead - self.num_free - len(self.demoted)
        if want <= 0:
            return 0
        added = 0
        for blk in self._lru_blocks():
            if self.journal.demote(blk.block_id):
                added += 1
                if added == want:
                    break
        return added

    def restore_demoted(self) -> int:
        """Promote every demoted block (the engine leaves cleanly: all it
        caches may be kept for the next). Returns how many."""
        demoted = list(self.demoted)
        for block_id in demoted:
            self._promote(self.block(block_id))
        return len(demoted)

    def forget_demotions(self) -> None:
        """The daemon heard every key again (a resync), or a journal with
        demotions in it may not have reached it: no block counts as demoted
        here (the daemon keeps no more than it did: safe)."""
        self.demoted.clear()

    def _promote(self, blk: BlockRecord) -> None:
        self.journal.promote(blk.block_id)

    # ---------------------------------------------------------- yielding
    def drain(self, slab_ids: Iterable[int]) -> list[int]:
        """Promise slabs back (another engine's demand goes unmet while this
        one holds more than its fair share): their cached blocks are evicted
        now, no block is placed in them from now on, and each is given back
        once its last live block is freed (``drained_slabs``). Slabs not
        held, or draining already, are skipped. Returns those now draining."""
        out = []
        for slab_id in dict.fromkeys(slab_ids):
            slab = self._slabs.get(slab_id)
            if slab is None or slab.draining:
                continue
            if slab.cached:
                for blk in slab.blocks:
                    if blk.ref_cnt == 0 and blk._block_hash is not None:
                        self._evict_cached(blk, slab)
                        self.stats.evictions["drain"] += 1
            free = len(slab.free)
            if free:
                del self._by_free[free][slab_id]
            self.num_free -= free
            self.num_available -= free
            self.num_withheld += free
            slab.draining = True
            self._draining[slab_id] = slab
            self.journal.dirty.add(slab_id)
            out.append(slab_id)
        return out

    def undrain(self, slab_ids: Iterable[int] | None = None) -> list[int]:
        """The promise lapsed (``None``: every draining slab): the slabs are
        this pool's to use again. Returns those given back to use."""
        out = []
        for slab_id in list(self._draining) if slab_ids is None else dict.fromkeys(slab_ids):
            slab = self._draining.pop(slab_id, None)
            if slab is None:
                continue
            slab.draining = False
            free = len(slab.free)
            self.num_withheld -= free
            self.num_free += free
            self.num_available += free
            if free:
                self._by_free[free][slab_id] = slab
                if free < self._min_hint:
                    self._min_hint = free
            out.append(slab_id)
        return out

    # ----------------------------------------------------- invalidation
    def clear_index(self) -> int:
        """Weights changed: drop every key. Live blocks stay live (running
        requests finish), cached blocks become free, new lookups miss.
        Returns the number of cached blocks dropped."""
        dropped = self.num_cached
        for slab in self._slabs.values():
            if not (slab.cached or slab.live):
                continue
            old = len(slab.free)
            for blk in slab.blocks:
                if blk._block_hash is None:
                    continue
                blk._block_hash = blk._block_hash_num_tokens = None
                if blk.ref_cnt == 0:
                    slab.free.append(blk)
            self.num_free += slab.cached
            slab.cached = 0
            self._rebucket(slab, old)
            self.journal.dirty.add(slab.slab_id)
        self._index.clear()
        self._aliases.clear()
        self._head.next_free_block, self._tail.prev_free_block = self._tail, self._head
        self._cached_at.clear()
        self._adopted.clear()
        self._labels.clear()
        self.journal.clear()
        self.stats.evictions["invalidate"] += dropped
        if self.on_cleared is not None:
            self.on_cleared()
        return dropped

    def reset(self) -> None:
        """Back to a clean cache: only when no block is live; stats restart."""
        if self.num_live:
            raise PoolBusy(f"{self.num_live} block(s) still live: cannot reset the pool")
        self.clear_index()
        self.stats = PoolStats()
