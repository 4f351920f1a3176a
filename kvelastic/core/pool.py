"""SlabPool: an engine's blocks over the slabs it holds, with a prefix cache.

Engine-agnostic and free of I/O: the vLLM adapter and the benchmarks drive it,
the client ships its journal to the daemon. Every public operation validates
its whole input before it changes anything, so a failure raises a typed
``PoolError`` and leaves every structure as it was (an OOM rollback).

Block states (see ``Block``): live (ref_cnt > 0), cached (ref_cnt == 0 with a
key: evictable, kept in an LRU), free (ref_cnt == 0, no key: on its slab's
free stack). For every held slab ``live + cached + free == blocks_per_slab``.

Placement: ``allocate`` takes free blocks from the fullest slab first (best
fit), so lightly used slabs drain and can be given back; only when no free
block is left does it evict cached blocks, least recently used first.
Eviction order for blocks freed together follows the order ``free`` got them
(vLLM passes a request's blocks tail first, so the tail of a chain goes
first). Proactive eviction (size limit, explicit) works in the unit memory is
returned in: with the oldest cached block goes the rest of its slab's cache
when that slab holds no live block, so the slab empties instead of leaving a
few cached blocks pinning a page.

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

Cost: every operation is O(1) or O(blocks touched); ``clear_index`` and
``reset`` (rare, operator-driven) walk the held blocks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from typing import NoReturn

from kvelastic.core.block import Block, BlockRecord, Slab
from kvelastic.core.index import HashIndex
from kvelastic.core.journal import (
    ADD_SLAB,
    CLEAR,
    DEMOTE,
    LABEL,
    PROMOTE,
    REMOVE,
    REMOVE_SLAB,
    STORE,
    Journal,
    JournalBatch,
)
from kvelastic.core.stats import PoolStats
from kvelastic.errors import (
    BlockNotCached,
    BlockNotLive,
    OutOfBlocks,
    PoolBusy,
    PoolError,
    SlabAlreadyHeld,
    SlabBusy,
    UnknownBlock,
    UnknownSlab,
)


class SlabPool:
    def __init__(
        self,
        blocks_per_slab: int,
        *,
        block_size: int = 16,
        block_bytes: int = 0,
        max_cached_bytes: int | None = None,
        ttl: float = 0.0,
        block_factory: Callable[[int], BlockRecord] = Block,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if blocks_per_slab < 1:
            raise ValueError(f"blocks_per_slab must be >= 1, got {blocks_per_slab}")
        if max_cached_bytes is not None and block_bytes <= 0:
            raise ValueError("max_cached_bytes needs block_bytes (the size of one block)")
        self.blocks_per_slab = blocks_per_slab
        self.block_size = block_size
        self.max_cached_blocks = None if max_cached_bytes is None else max_cached_bytes // block_bytes
        self.ttl = ttl
        # Settable until the first slab arrives (the vLLM adapter binds its blocks to itself).
        self.block_factory = block_factory
        self._clock = clock
        # Called with every key that leaves the index (vLLM's BlockRemoved events).
        self.on_key_removed: Callable[[Hashable], None] | None = None
        # Called when clear_index drops the whole index (vLLM's AllBlocksCleared).
        self.on_cleared: Callable[[], None] | None = None
        # Called with the (key, label) of labelled blocks an ``adopt`` cached:
        # KV this engine did not compute, which no router has heard of from it.
        self.on_adopted: Callable[[list[tuple[Hashable, bytes]]], None] | None = None

        self._slabs: dict[int, Slab] = {}
        # _by_free[k]: held slabs with exactly k free blocks. Invariant: no
        # bucket in [1, _min_hint) is non-empty, so best fit scans from there.
        self._by_free: list[dict[int, Slab]] = [{} for _ in range(blocks_per_slab + 1)]
        self._min_hint = 1
        # Cached blocks in eviction order, least recently used first: a
        # doubly linked list through the blocks' own ``prev_free_block`` and
        # ``next_free_block`` between two sentinels (vLLM's free queue does
        # the same): putting a block in or taking it out touches it and its
        # two neighbours and allocates nothing. With a TTL, the time each
        # block became cached.
        self._head: BlockRecord = Block(-1)
        self._tail: BlockRecord = Block(-1)
        self._head.next_free_block, self._tail.prev_free_block = self._tail, self._head
        self._cached_at: dict[int, float] = {}
        self._index = HashIndex()
        # get_cached_block(key): any block holding ``key`` (not touched), or
        # None. The index's own lookup, bound here instead of wrapped in a
        # method: this is the scheduler's most frequent call.
        self.get_cached_block: Callable[[Hashable], BlockRecord | None] = self._index.get_one
        self.num_free = 0
        # Free plus cached blocks: what ``allocate`` can hand out now. Kept,
        # not derived: vLLM asks it once per request per step, and a sum
        # would allocate an int each time (``num_live`` is the derived one).
        self.num_available = 0
        self.journal = Journal()
        self.stats = PoolStats()
        # Adopted blocks not hit yet (their first hit counts in stats.adopted_hits).
        self._adopted: set[int] = set()
        # Labels of keyed blocks (block_id -> label; see journal.py): only blocks cached with one.
        self._labels: dict[int, bytes] = {}
        # Other keys of keyed blocks (block_id -> keys), for lookups only:
        # vLLM's partial-block entries (a state block also reachable from a
        # boundary inside it). Never journalled: the daemon mirrors a block's
        # one key, under which its KV is kept and handed on; an alias leaves
        # the index with its block's key. Invariant: only keyed blocks here.
        self._aliases: dict[int, list[Hashable]] = {}
        # Cached blocks whose keys the daemon was told to forget (``demote``).
        # Read-only outside the pool; never rebound.
        self.demoted: set[int] = set()

    # ------------------------------------------------------------ capacity
    @property
    def num_cached(self) -> int:
        return self.num_available - self.num_free

    def lru_ids(self) -> list[int]:
        """Cached block ids, least recently used first (for checks and snapshots)."""
        return [blk.block_id for blk in self._lru_blocks()]

    def _lru_blocks(self) -> Iterator[BlockRecord]:
        """Cached blocks, least recently used first; the one just yielded may be unlinked."""
        blk, tail = self._head.next_free_block, self._tail
        while blk is not tail:
            nxt = blk.next_free_block
            yield blk
            blk = nxt

    @property
    def num_slabs(self) -> int:
        return len(self._slabs)

    @property
    def num_blocks(self) -> int:
        return len(self._slabs) * self.blocks_per_slab

    @property
    def num_live(self) -> int:
        """Blocks with a reference (``ref_cnt > 0``)."""
        return len(self._slabs) * self.blocks_per_slab - self.num_available

    def slab_ids(self) -> list[int]:
        return list(self._slabs)

    def occupancy(self, slab_id: int) -> tuple[int, int, int] | None:
        slab = self._slabs.get(slab_id)
        return None if slab is None else slab.occupancy()

    def occupancies(self) -> dict[int, tuple[int, int, int]]:
        return {sid: slab.occupancy() for sid, slab in self._slabs.items()}

    def idle_slabs(self) -> list[int]:
        """Slabs with no live and no cached block: returnable without loss."""
        return list(self._by_free[self.blocks_per_slab])

    def reclaimable_slabs(self) -> list[int]:
        """Slabs with no live block (returnable after evicting their cache)."""
        return [sid for sid, slab in self._slabs.items() if slab.live == 0]

    def block(self, block_id: int) -> BlockRecord:
        slab = self._slabs.get(block_id // self.blocks_per_slab) if block_id >= 0 else None
        if slab is None:
            raise UnknownBlock(f"block {block_id} is not in a held slab")
        return slab.blocks[block_id % self.blocks_per_slab]

    def cached_keys(self) -> list[tuple[Hashable, int]]:
        """(key, block_id) for every keyed block's key, aliases aside (what the
        daemon mirrors); for checks, snapshots and a resync."""
        if not self._aliases:
            return list(self._index.items())
        return [(key, block_id) for key, block_id in self._index.items() if self.block(block_id)._block_hash == key]

    def keys_of(self, blk: BlockRecord) -> list[Hashable]:
        """Every key that reaches ``blk``: its key, then its aliases."""
        if blk._block_hash is None:
            return []
        return [blk._block_hash, *self._aliases.get(blk.block_id, ())]

    def alias(self, blk: BlockRecord, key: Hashable) -> bool:
        """Make a keyed block reachable under ``key`` too (lookups only, never
        journalled). False if ``key`` already reaches it."""
        self._check_held([blk])
        if blk._block_hash is None:
            raise BlockNotCached(f"block {blk.block_id} has no key: an alias needs one")
        if key == blk._block_hash or key in self._aliases.get(blk.block_id, ()):
            return False
        self._index.insert(key, blk)
        self._aliases.setdefault(blk.block_id, []).append(key)
        return True

    def take_journal(self, occupancy: bool = True) -> JournalBatch:
        """The journal so far; ``occupancy=False``: its ops alone (``Journal.take``)."""
        return self.journal.take(self.occupancy if occupancy else None)

    # --------------------------------------------------------------- slabs
    def add_slab(self, slab_id: int) -> None:
        """A slab was granted: its blocks join the pool, all free."""
        if slab_id < 0:
            raise UnknownSlab(f"slab id must be >= 0, got {slab_id}")
        if slab_id in self._slabs:
            raise SlabAlreadyHeld(f"slab {slab_id} is already held")
        first = slab_id * self.blocks_per_slab
        slab = Slab(slab_id, [self.block_factory(first + i) for i in range(self.blocks_per_slab)], self)
        self._slabs[slab_id] = slab
        self._by_free[self.blocks_per_slab][slab_id] = slab
        self.num_free += self.blocks_per_slab
        self.num_available += self.blocks_per_slab
        self.journal.ops.append((ADD_SLAB, slab_id))
        self.journal.dirty.add(slab_id)

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
            self.journal.stored[blk.block_id] = len(self.journal.ops)
            self.journal.ops.append((STORE, key, blk.block_id))
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

    def take_slab_back(self, slab_id: int, reason: str = "reclaim") -> int:
        """Remove a slab with no live block; its cached blocks are evicted
        first, so their keys leave the index before the pages leave.
        Returns the number of cached blocks evicted."""
        slab = self._slabs.get(slab_id)
        if slab is None:
            raise UnknownSlab(f"slab {slab_id} is not held")
        if slab.live:
            raise SlabBusy(f"slab {slab_id} has {slab.live} live block(s)")
        del self._by_free[len(slab.free)][slab_id]
        evicted = 0
        removed = self.journal.removed   # the slab leaves whole: none of its blocks is rewritten here
        for blk in slab.blocks:
            if blk._block_hash is not None:
                self._unlink(blk)
                self._cached_at.pop(blk.block_id, None)
                self._drop_key(blk)
                evicted += 1
        if evicted:
            self.stats.evictions[reason] += evicted
        self.journal.removed = removed
        self.num_free -= len(slab.free)
        self.num_available -= self.blocks_per_slab    # no live block: every one was free or cached
        slab.owner = None
        del self._slabs[slab_id]
        self.journal.ops.append((REMOVE_SLAB, slab_id))
        return evicted

    # -------------------------------------------------------------- blocks
    def allocate(self, n: int) -> list[BlockRecord]:
        """``n`` blocks with ref_cnt 1: free blocks by best fit, then LRU
        evictions. Raises ``OutOfBlocks`` (nothing taken) if fewer exist."""
        num_free = self.num_free
        if n < 0:
            raise PoolError(f"cannot allocate a negative number of blocks ({n})")
        if n > self.num_available:
            raise OutOfBlocks(f"asked for {n} blocks, {num_free} free + {self.num_cached} evictable held")
        dirty = self.journal.dirty
        self.stats.block_ops += 1
        if n == 1 and num_free:         # a decode step, the common case: one block from the fullest slab
            buckets, i = self._by_free, self._min_hint
            while not buckets[i]:
                i += 1
            slab = next(iter(buckets[i].values()))
            blk = slab.free.pop()
            blk.ref_cnt = 1
            self.num_free = num_free - 1
            self.num_available -= 1
            # _rebucket, inline: from bucket i to i - 1, which becomes the lowest non-empty one.
            del buckets[i][slab.slab_id]
            buckets[i - 1][slab.slab_id] = slab
            self._min_hint = i - 1 if i > 1 else i
            dirty.add(slab.slab_id)
            return [blk]
        out: list[BlockRecord] = []
        want, num_free = n, self.num_free
        if want and num_free:
            # Best fit: slab after slab from the lowest non-empty bucket i
            # (none below _min_hint), each taken slab moving to bucket
            # i - take (_rebucket, inline; 0 when emptied: the scan goes on from i).
            buckets, i = self._by_free, self._min_hint
            while want and num_free:
                while not buckets[i]:
                    i += 1
                bucket = buckets[i]
                slab = next(iter(bucket.values()))
                free = slab.free                # len(free) == i
                take = want if want < i else i
                chunk = free[i - take:]
                del free[i - take:]
                for blk in chunk:
                    blk.ref_cnt = 1
                out += chunk
                want -= take
                num_free -= take
                del bucket[slab.slab_id]
                buckets[i - take][slab.slab_id] = slab
                dirty.add(slab.slab_id)
            self._min_hint = i - take if take < i else i
            self.num_available -= n - want
            self.num_free = num_free
        if want:
            self._reuse_cached(want, out)
        return out

    def _reuse_cached(self, reused: int, out: list[BlockRecord]) -> None:
        """``allocate``'s second half: the ``reused`` least recently used
        cached blocks lose their keys and join ``out``, live (``_drop_key``
        inline: one call less per evicted block)."""
        head, cached_at, dirty = self._head, self._cached_at, self.journal.dirty
        adopted, labels, index_remove = self._adopted, self._labels, self._index.remove
        # HashIndex's own map: a key held by one block is a bare entry there
        # (index.py), removed here without a call; a shared key goes through it.
        entries = self._index._map
        journal = self.journal
        ops, stored, on_removed, demoted = journal.ops, journal.stored, self.on_key_removed, self.demoted
        aliases = self._aliases
        for _ in range(reused):
            blk = head.next_free_block      # the least recently used, unlinked
            nxt = blk.next_free_block
            head.next_free_block = nxt
            nxt.prev_free_block = head
            block_id = blk.block_id
            if cached_at:
                del cached_at[block_id]
            slab = blk.slab
            key = blk._block_hash
            if adopted:
                adopted.discard(block_id)
            if labels:
                labels.pop(block_id, None)
            if entries[key] is blk:
                del entries[key]
            else:
                index_remove(key, blk)
            if block_id in demoted:     # the daemon keeps none of its KV already: nothing to seal
                demoted.remove(block_id)
                ops.append((REMOVE, key, block_id))
            else:
                at = stored.pop(block_id, None)
                if at is None:
                    ops.append((REMOVE, key, block_id))
                    journal.removed = True
                else:       # stored in this batch: cancelled instead (Journal.stored), no news to seal
                    ops[at] = None
            blk._block_hash = blk._block_hash_num_tokens = None
            if on_removed is not None:
                on_removed(key)
            if aliases and block_id in aliases:
                self._drop_aliases(blk)
            blk.ref_cnt = 1
            slab.cached -= 1
            dirty.add(slab.slab_id)
            out.append(blk)
        self.num_available -= reused
        self.stats.evictions["lru"] += reused

    def touch(self, blocks: Sequence[BlockRecord]) -> None:
        """A cache hit: each block gains a reference; a cached block turns live.
        One pass takes the references (a bad block gives them back: nothing
        else changed yet), a second moves the revived cached blocks out of the LRU."""
        revived: list[BlockRecord] = []
        done = 0
        try:
            for blk in blocks:
                if blk.slab.owner is not self:
                    raise AttributeError
                ref = blk.ref_cnt
                if not ref:
                    if blk._block_hash is None:
                        self._untouch(blocks, done)
                        raise BlockNotCached(f"block {blk.block_id} is free, not cached: it cannot be touched")
                    revived.append(blk)
                blk.ref_cnt = ref + 1
                done += 1
        except AttributeError:   # no slab (None, or not a record of this pool), or a slab not held
            self._untouch(blocks, done)
            raise UnknownBlock(f"block {blk.block_id} does not belong to a slab this pool holds") from None
        self.stats.block_ops += 1
        if not revived:
            return
        dirty, cached_at, adopted = self.journal.dirty, self._cached_at, self._adopted
        demoted = self.demoted
        for blk in revived:
            prev, nxt = blk.prev_free_block, blk.next_free_block   # out of the LRU
            prev.next_free_block = nxt
            nxt.prev_free_block = prev
            if cached_at:
                del cached_at[blk.block_id]
            if adopted and blk.block_id in adopted:   # a hit on KV another engine computed
                adopted.discard(blk.block_id)
                self.stats.adopted_hits += 1
            if demoted and blk.block_id in demoted:
                self._promote(blk)
            slab = blk.slab
            slab.cached -= 1
            dirty.add(slab.slab_id)
        self.num_available -= len(revived)

    @staticmethod
    def _untouch(blocks: Sequence[BlockRecord], done: int) -> None:
        for i in range(done):
            blocks[i].ref_cnt -= 1

    def free(self, blocks: Iterable[BlockRecord]) -> None:
        """Drop one reference per block, in eviction order (first evicted
        first). A block reaching 0 becomes cached if it has a key, else free."""
        if type(blocks) is not list:
            blocks = list(blocks)       # vLLM passes an iterator; a bad block's undo walks back
        dirty, tail = self.journal.dirty, self._tail
        cached_at = self._cached_at if self.ttl else None
        now = self._clock() if cached_at is not None else 0.0
        done = released = 0
        last = None
        grown: dict[Slab, int] = {}     # slab -> its free count before: rebucketed once at the end if it grew
        try:
            for blk in blocks:
                slab = blk.slab
                ref = blk.ref_cnt
                if ref <= 0 or slab.owner is not self:
                    raise AttributeError
                blk.ref_cnt = ref = ref - 1
                done += 1
                if ref:
                    continue
                released += 1
                if slab is not last:  # a request's blocks mostly share slabs (best fit)
                    last = slab
                    dirty.add(slab.slab_id)
                    if slab not in grown:
                        grown[slab] = len(slab.free)
                if blk._block_hash is None:
                    slab.free.append(blk)
                else:
                    slab.cached += 1
                    prev = tail.prev_free_block     # last in the LRU: the most recently used
                    prev.next_free_block = tail.prev_free_block = blk
                    blk.prev_free_block, blk.next_free_block = prev, tail
                    if cached_at is not None:
                        cached_at[blk.block_id] = now
        except AttributeError:   # a bad block: no slab, a slab not held, or not live
            self._undo_free(blocks[:done], blocks[done])
        self.stats.block_ops += 1
        if grown:   # _rebucket, inline: each slab that gained free blocks, once
            by_free, hint = self._by_free, self._min_hint
            for slab, old in grown.items():
                new = len(slab.free)
                if new == old:
                    continue
                self.num_free += new - old
                del by_free[old][slab.slab_id]
                by_free[new][slab.slab_id] = slab
                if new < hint:
                    hint = new
            self._min_hint = hint
        self.num_available += released
        if self.ttl or self.max_cached_blocks is not None:
            self._enforce_limits(now)

    def _undo_free(self, done: list[BlockRecord], bad: BlockRecord) -> NoReturn:
        """A bad block: undo, newest first, what ``free`` did before it, then raise."""
        for blk in reversed(done):
            if not blk.ref_cnt:
                slab = blk.slab
                if blk._block_hash is None:
                    slab.free.pop()          # stack order: it is on top again
                else:
                    slab.cached -= 1
                    self._unlink(blk)
                    self._cached_at.pop(blk.block_id, None)
            blk.ref_cnt += 1
        slab = getattr(bad, "slab", None)
        if slab is None or slab.owner is not self:
            raise UnknownBlock(f"block {bad.block_id} does not belong to a slab this pool holds")
        raise BlockNotLive(f"block {bad.block_id} is not allocated (double free?)")

    def cache(self, blocks: Sequence[BlockRecord], keys: Sequence[Hashable],
              num_tokens: Sequence[int] | None = None, labels: Sequence[bytes] | None = None) -> None:
        """Give live blocks their prefix-cache keys (re-keying replaces).
        ``num_tokens[i]``, when given, is the length of the prefix that
        ``keys[i]`` covers (vLLM's ``block_hash_num_tokens``); ``labels[i]``
        the key's label (journal.py), carried wherever the key goes."""
        if len(blocks) != len(keys) or (num_tokens is not None and len(num_tokens) != len(keys)) \
                or (labels is not None and len(labels) != len(keys)):
            raise PoolError(f"cache: {len(blocks)} blocks, {len(keys)} keys"
                            + ("" if num_tokens is None else f", {len(num_tokens)} prefix lengths")
                            + ("" if labels is None else f", {len(labels)} labels"))
        try:
            for blk in blocks:
                if blk.slab.owner is not self:
                    raise AttributeError
                if blk.ref_cnt <= 0:
                    raise BlockNotLive(f"block {blk.block_id} is not allocated: only live blocks are cached")
        except AttributeError:   # no slab (None, or not a record of this pool), or a slab not held
            raise UnknownBlock(f"block {blk.block_id} does not belong to a slab this pool holds") from None
        self.journal.mark_store()
        ops, stored = self.journal.ops, self.journal.stored
        for i, blk in enumerate(blocks):
            key = keys[i]
            if blk._block_hash == key:
                continue
            if blk._block_hash is not None:
                self._drop_key(blk)
            blk._block_hash = key
            if num_tokens is not None:
                blk._block_hash_num_tokens = num_tokens[i]
            self._index.insert(key, blk)
            stored[blk.block_id] = len(ops)
            ops.append((STORE, key, blk.block_id))
            if labels is not None and labels[i]:
                self._labels[blk.block_id] = labels[i]
                ops.append((LABEL, blk.block_id, labels[i]))

    def uncache(self, blocks: Sequence[BlockRecord], reason: str = "explicit") -> int:
        """Drop the keys of these blocks (live ones stay live; cached ones turn
        free). Blocks without a key are skipped. Returns the keys dropped."""
        self._check_held(blocks)
        dropped = 0
        for blk in blocks:
            if blk._block_hash is None:
                continue
            slab = blk.slab
            if blk.ref_cnt == 0:
                self._evict_cached(blk, slab)
            else:
                self._drop_key(blk)
            dropped += 1
        self.stats.evictions[reason] += dropped
        return dropped

    def lookup(self, keys: Sequence[Hashable]) -> list[BlockRecord]:
        """Blocks of the longest cached prefix of ``keys`` (not touched), for
        engines that look up through the pool (the simulators); counted in
        the stats in whole blocks."""
        hits: list[BlockRecord] = []
        get = self._index.get_one
        for key in keys:
            blk = get(key)
            if blk is None:
                break
            hits.append(blk)
        stats = self.stats
        stats.lookup_blocks += len(keys)
        stats.hit_blocks += len(hits)
        self.record_query(len(keys) * self.block_size, len(hits) * self.block_size)
        return hits

    def record_query(self, query_tokens: int, hit_tokens: int) -> None:
        """One request looked up in the prefix cache, in tokens: the figures
        operators compare with vLLM's ``prefix_cache_queries``/``_hits``
        (the vLLM plugin reports vLLM's own counts through here)."""
        stats = self.stats
        stats.lookups += 1
        stats.query_tokens += query_tokens
        stats.hit_tokens += hit_tokens

    # --------------------------------------------------------------- steps
    def begin_step(self) -> int:
        """A model step that may write blocks is scheduled; returns its number.
        Keys stored until it ends count as written only once it ended (the
        journal's validity rule, ``journal.py``)."""
        return self.journal.begin_step()

    def end_step(self, step: int) -> None:
        """Step ``step`` and every one before it finished: their KV is written."""
        self.journal.end_step(step)

    # ------------------------------------------------------------ demotion
    def demote(self, lead: int) -> int:
        """Demote (module docstring) the least recently used cached blocks
        until free and demoted blocks together make ``lead``: what evictions
        may then reuse with nothing to seal. The caller writes the journal at
        once, and calls ``forget_demotions`` if it could not. Returns how
        many were demoted."""
        want = lead - self.num_free - len(self.demoted)
        if want <= 0:
            return 0
        demoted, ops = self.demoted, self.journal.ops
        added = 0
        for blk in self._lru_blocks():
            block_id = blk.block_id
            if block_id in demoted:
                continue
            ops.append((DEMOTE, block_id))
            demoted.add(block_id)
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
        self.demoted.discard(blk.block_id)
        self.journal.ops.append((PROMOTE, blk.block_id))

    # ------------------------------------------------------------ eviction
    def evict(self, n: int, reason: str = "explicit") -> int:
        """Evict at least ``n`` cached blocks (fewer if fewer exist), whole
        slabs' caches at a time where no live block pins the slab."""
        if n <= 0:
            return 0
        return self._evict_oldest(n, reason, whole_slabs=True)

    def expire(self) -> int:
        """Apply the TTL and the size limit now (the client calls this when idle)."""
        before = sum(self.stats.evictions.values())
        self._enforce_limits(self._clock())
        return sum(self.stats.evictions.values()) - before

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
        self.demoted.clear()
        self.journal.ops.append((CLEAR,))
        self.journal.stored.clear()     # a REMOVE from now on follows a STORE after the CLEAR
        self.journal.removed = True
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

    # ------------------------------------------------------------ internals
    def _check_held(self, blocks: Sequence[BlockRecord]) -> None:
        for blk in blocks:
            slab = getattr(blk, "slab", None)
            if slab is None or slab.owner is not self:
                raise UnknownBlock(f"block {blk.block_id} does not belong to a slab this pool holds")

    def _rebucket(self, slab: Slab, old_free: int) -> None:
        new_free = len(slab.free)
        if new_free != old_free:
            del self._by_free[old_free][slab.slab_id]
            self._by_free[new_free][slab.slab_id] = slab
            if 0 < new_free < self._min_hint:
                self._min_hint = new_free

    def _drop_key(self, blk: BlockRecord) -> None:
        key = blk._block_hash
        self._adopted.discard(blk.block_id)
        if self._labels:
            self._labels.pop(blk.block_id, None)
        self._index.remove(key, blk)
        journal = self.journal
        at = journal.stored.pop(blk.block_id, None)
        if at is not None:      # stored in this batch: cancelled instead (Journal.stored), no news to seal
            journal.ops[at] = None
        elif self.demoted and blk.block_id in self.demoted:   # the daemon keeps none of its KV already
            self.demoted.discard(blk.block_id)
            journal.ops.append((REMOVE, key, blk.block_id))
        else:
            journal.ops.append((REMOVE, key, blk.block_id))
            journal.removed = True
        blk._block_hash = blk._block_hash_num_tokens = None
        if self.on_key_removed is not None:
            self.on_key_removed(key)
        if self._aliases and blk.block_id in self._aliases:
            self._drop_aliases(blk)

    def _drop_aliases(self, blk: BlockRecord) -> None:
        for key in self._aliases.pop(blk.block_id):
            self._index.remove(key, blk)
            if self.on_key_removed is not None:
                self.on_key_removed(key)

    @staticmethod
    def _unlink(blk: BlockRecord) -> None:
        """Take a cached block out of the LRU."""
        prev, nxt = blk.prev_free_block, blk.next_free_block
        prev.next_free_block = nxt
        nxt.prev_free_block = prev

    def _evict_cached(self, blk: BlockRecord, slab: Slab) -> None:
        self._unlink(blk)
        self._cached_at.pop(blk.block_id, None)
        self._drop_key(blk)
        old = len(slab.free)
        slab.cached -= 1
        slab.free.append(blk)
        self.num_free += 1
        self._rebucket(slab, old)
        self.journal.dirty.add(slab.slab_id)

    def _evict_oldest(self, n: int, reason: str, whole_slabs: bool,
                      older_than: float | None = None) -> int:
        evicted = 0
        while evicted < n and self.num_cached:
            blk = self._head.next_free_block
            block_id = blk.block_id
            if older_than is not None and self._cached_at.get(block_id, 0.0) > older_than:
                break
            slab = blk.slab
            self._evict_cached(blk, slab)
            evicted += 1
            if whole_slabs and slab.live == 0 and slab.cached:
                for blk in slab.blocks:
                    if blk._block_hash is not None:
                        self._evict_cached(blk, slab)
                        evicted += 1
        self.stats.evictions[reason] += evicted
        return evicted

    def _enforce_limits(self, now: float) -> None:
        cached = self.num_cached
        if self.ttl and cached:
            self._evict_oldest(cached, "ttl", whole_slabs=False, older_than=now - self.ttl)
        limit = self.max_cached_blocks
        if limit is not None and self.num_cached > limit:
            self._evict_oldest(self.num_cached - limit, "size_limit", whole_slabs=True)
