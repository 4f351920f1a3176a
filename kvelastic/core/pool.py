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

Cost: every operation is O(1) or O(blocks touched); ``clear_index`` and
``reset`` (rare, operator-driven) walk the held blocks.

Three layers, each a module: ``books.py`` (``PoolBooks``: the state, what
it answers, and the moves every path shares), ``handon.py`` (``HandOnPool``:
the rare paths where the cache meets others: blocks handed on, demotion,
slabs drained for another engine, invalidation), and here ``SlabPool``, the paths vLLM calls every step. A
layer calls only the ones below it.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from operator import length_hint
from typing import NoReturn

from kvelastic.core.block import BlockRecord, Slab
from kvelastic.core.handon import HandOnPool
from kvelastic.core.journal import ADD_SLAB, LABEL, REMOVE, REMOVE_SLAB, STORE
from kvelastic.errors import (
    BlockNotCached,
    BlockNotLive,
    OutOfBlocks,
    PoolError,
    SlabAlreadyHeld,
    SlabBusy,
    UnknownBlock,
    UnknownSlab,
)


class SlabPool(HandOnPool):
    """An engine's blocks over its slabs, with a prefix cache (module docstring)."""

    # ------------------------------------------------------------ slabs
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

    def take_slab_back(self, slab_id: int, reason: str = "reclaim") -> int:
        """Remove a slab with no live block; its cached blocks are evicted
        first, so their keys leave the index before the pages leave.
        Returns the number of cached blocks evicted."""
        slab = self._slabs.get(slab_id)
        if slab is None:
            raise UnknownSlab(f"slab {slab_id} is not held")
        if slab.live:
            raise SlabBusy(f"slab {slab_id} has {slab.live} live block(s)")
        counted = 0 if slab.draining else len(slab.free)   # a draining slab's free blocks are withheld
        if slab.draining:
            self.num_withheld -= len(slab.free)
            del self._draining[slab_id]
        elif slab.free:
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
        self.num_free -= counted
        self.num_available -= counted + evicted       # no live block: every one was free or cached
        slab.owner = None
        del self._slabs[slab_id]
        self.journal.ops.append((REMOVE_SLAB, slab_id))
        return evicted

    # ----------------------------------------------------------- blocks
    def allocate(self, n: int) -> list[BlockRecord]:
        """``n`` blocks with ref_cnt 1: free blocks by best fit, then LRU
        evictions. Raises ``OutOfBlocks`` (nothing taken) if fewer exist."""
        num_free = self.num_free
        if n < 0:
            raise PoolError(f"cannot allocate a negative number of blocks ({n})")
        if n > self.num_available:
            raise OutOfBlocks(f"asked for {n} blocks, {num_free} free + {self.num_cached} evictable held")
        self.stats.block_ops += 1
        if n == 1 and num_free:         # a decode step, the common case: one block from the fullest slab
            buckets, i = self._by_free, self._min_hint
            while not buckets[i]:
                i += 1
            bucket = buckets[i]
            for slab in bucket.values():  # noqa: B007  the first (``next(iter(...))`` without two calls)
                break
            blk = slab.free.pop()
            blk.ref_cnt = 1
            self.num_free = num_free - 1
            self.num_available -= 1
            # _rebucket, inline: from bucket i to i - 1, which becomes the lowest non-empty one.
            slab_id = slab.slab_id
            del bucket[slab_id]
            if i > 1:
                buckets[i - 1][slab_id] = slab
                self._min_hint = i - 1
            else:
                self._min_hint = i    # full now: in no bucket
            self.journal.dirty.add(slab_id)
            return [blk]
        out: list[BlockRecord] = []
        want = n
        if want and num_free:
            # Best fit: slab after slab from the lowest non-empty bucket i
            # (none below _min_hint), each taken slab moving to bucket
            # i - take (_rebucket, inline; 0 when emptied: the scan goes on from i).
            dirty = self.journal.dirty
            buckets, i = self._by_free, self._min_hint
            while want and num_free:
                while not buckets[i]:
                    i += 1
                bucket = buckets[i]
                for slab in bucket.values():  # noqa: B007
                    break
                free = slab.free                # len(free) == i
                take = want if want < i else i
                chunk = free[i - take:]
                del free[i - take:]
                for blk in chunk:
                    blk.ref_cnt = 1
                if out:
                    out += chunk
                else:
                    out = chunk                 # one slab is enough: no copy
                want -= take
                num_free -= take
                slab_id = slab.slab_id
                del bucket[slab_id]
                if take < i:
                    buckets[i - take][slab_id] = slab
                dirty.add(slab_id)
            self._min_hint = i - take if take < i else i
            self.num_available -= n - want
            self.num_free = num_free
        if want:
            self._reuse_cached(want, out)
        return out

    def _reuse_cached(self, reused: int, out: list[BlockRecord]) -> None:
        """``allocate``'s second half: the ``reused`` least recently used
        cached blocks lose their keys and join ``out``, live (``_drop_key``
        inline, with ``HashIndex.remove`` for a bare entry and ``Journal.drop``,
        over locals bound once: the LRU's head is known, no lookup)."""
        head, cached_at, dirty = self._head, self._cached_at, self.journal.dirty
        adopted, labels, index = self._adopted, self._labels, self._index.entries
        journal = self.journal
        stored, ops, demoted = journal.stored, journal.ops, journal.demoted
        on_removed, aliases = self.on_key_removed, self._aliases
        removed = False
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
            if type(index[key]) is dict:     # several blocks hold the key
                self._index.remove(key, blk)
            else:
                del index[key]
            at = stored.pop(block_id, None)  # Journal.drop: stored in this batch, cancelled
            if at is not None:
                ops[at] = None
            else:
                ops.append((REMOVE, key, block_id))
                if demoted and block_id in demoted:
                    demoted.remove(block_id)
                else:
                    removed = True
            blk._block_hash = blk._block_hash_num_tokens = None
            if on_removed is not None:
                on_removed(key)
            if aliases and block_id in aliases:
                self._drop_aliases(blk)
            blk.ref_cnt = 1
            slab.cached -= 1
            dirty.add(slab.slab_id)
            out.append(blk)
        if removed:
            journal.removed = True
        self.num_available -= reused
        self.stats.evictions["lru"] += reused

    def touch(self, blocks: Sequence[BlockRecord]) -> None:
        """A cache hit: each block gains a reference; a cached block turns live.
        One pass takes the references (a bad block gives them back: nothing
        else changed yet), a second moves the revived cached blocks out of the LRU."""
        if type(blocks) is not list:
            blocks = list(blocks)       # a bad block's undo counts the blocks before it from the iterator
        revived: list[BlockRecord] = []
        it = iter(blocks)
        try:
            for blk in it:
                if blk.slab.owner is not self:
                    raise AttributeError
                ref = blk.ref_cnt
                if not ref:
                    if blk._block_hash is None:
                        self._untouch(blocks, len(blocks) - length_hint(it) - 1)
                        raise BlockNotCached(f"block {blk.block_id} is free, not cached: it cannot be touched")
                    revived.append(blk)
                blk.ref_cnt = ref + 1
        except AttributeError:   # no slab (None, or not a record of this pool), or a slab not held
            self._untouch(blocks, len(blocks) - length_hint(it) - 1)   # the blocks before it
            raise UnknownBlock(f"block {blk.block_id} does not belong to a slab this pool holds") from None
        self.stats.block_ops += 1
        if not revived:
            return
        dirty, cached_at, adopted = self.journal.dirty, self._cached_at, self._adopted
        demoted = self.demoted
        last = None
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
            if slab is not last:    # a prefix's blocks mostly share slabs
                last = slab
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
        tail = self._tail
        cached_at = self._cached_at if self.ttl else None
        now = self._clock() if cached_at is not None else 0.0
        cached = 0
        last = None
        # slab -> its free count before: marked dirty and rebucketed once at
        # the end. A request's blocks spread over many slabs (best fit takes
        # each decode block from the fullest), so the loop does as little per
        # slab as it can, and nothing per block it can do once per call.
        grown: dict[Slab, int] = {}
        it = iter(blocks)
        try:
            for blk in it:
                slab = blk.slab
                ref = blk.ref_cnt - 1
                if ref < 0 or slab.owner is not self:
                    raise AttributeError
                blk.ref_cnt = ref
                if ref:
                    continue
                if slab is not last:  # a request's blocks mostly share slabs (best fit)
                    last = slab
                    if slab not in grown:
                        grown[slab] = len(slab.free)
                if blk._block_hash is None:
                    slab.free.append(blk)
                else:
                    slab.cached += 1
                    cached += 1
                    prev = tail.prev_free_block     # last in the LRU: the most recently used
                    prev.next_free_block = tail.prev_free_block = blk
                    blk.prev_free_block, blk.next_free_block = prev, tail
                    if cached_at is not None:
                        cached_at[blk.block_id] = now
        except AttributeError:   # a bad block: no slab, a slab not held, or not live
            done = len(blocks) - length_hint(it) - 1    # the blocks before it (no count kept per block)
            self._undo_free(blocks[:done], blocks[done])
        self.stats.block_ops += 1
        if grown:   # _rebucket, inline: each slab that released a block, once
            dirty, by_free, hint, freed, step = self.journal.dirty, self._by_free, self._min_hint, 0, self.journal.begun
            for slab, old in grown.items():
                slab_id = slab.slab_id
                dirty.add(slab_id)
                slab.last_step = step
                if slab.draining:       # promised back: what it freed is withheld, its cache dropped
                    cached -= self._withhold(slab, old)
                    continue
                new = len(slab.free)
                if new != old:
                    freed += new - old
                    if old:
                        del by_free[old][slab_id]
                    by_free[new][slab_id] = slab
                    if new < hint:
                        hint = new
            self._min_hint = hint
            self.num_free += freed
            self.num_available += freed + cached
        if cached_at is not None or self.max_cached_blocks is not None:
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
        journal = self.journal
        journal.mark_store()
        index, stored, ops = self._index.entries, journal.stored, journal.ops
        for i, blk in enumerate(blocks):
            key = keys[i]
            old = blk._block_hash
            if old is not None:
                if old == key:
                    continue
                self._drop_key(blk)
            blk._block_hash = key
            if num_tokens is not None:
                blk._block_hash_num_tokens = num_tokens[i]
            if key in index:                # HashIndex.insert; a bare entry inline
                self._index.insert(key, blk)
            else:
                index[key] = blk
            block_id = blk.block_id
            stored[block_id] = len(ops)     # Journal.store, inline
            ops.append((STORE, key, block_id))
            if labels is not None and labels[i]:
                self._labels[block_id] = labels[i]
                ops.append((LABEL, block_id, labels[i]))

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

    # ------------------------------------------------------------ steps
    def begin_step(self) -> int:
        """A model step that may write blocks is scheduled; returns its number.
        Keys stored until it ends count as written only once it ended (the
        journal's validity rule, ``journal.py``)."""
        return self.journal.begin_step()

    def end_step(self, step: int) -> None:
        """Step ``step`` and every one before it finished: their KV is written."""
        self.journal.end_step(step)

    # --------------------------------------------------------- eviction
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
