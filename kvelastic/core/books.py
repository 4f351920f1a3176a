"""The pool's books: the state ``SlabPool`` keeps, what it answers about
it, and the moves every path shares (a key dropped, a cached block evicted,
a slab moved between free-count buckets, the cache's limits applied).

Invariants (``pool.py`` says why): for every held slab ``live + cached +
free == blocks_per_slab``; ``_by_free[k]`` holds exactly the held slabs
not draining with ``k >= 1`` free blocks (``_by_free[0]`` stays empty) and
no bucket in ``[1, _min_hint)`` is non-empty; a draining slab holds no
cached block, and its free blocks are ``num_withheld``, not ``num_free``; the
LRU links exactly the cached blocks, least recently used first; the index
maps exactly the keyed blocks' keys and aliases.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterator, Sequence

from kvelastic.core.block import Block, BlockRecord, Slab
from kvelastic.core.index import HashIndex
from kvelastic.core.journal import Journal, JournalBatch
from kvelastic.core.stats import PoolStats
from kvelastic.errors import UnknownBlock


class PoolBooks:
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
        # _by_free[k]: held slabs with exactly k free blocks, k >= 1. Invariant:
        # no bucket in [1, _min_hint) is non-empty, so best fit scans from there.
        # A full slab is in no bucket (``_by_free[0]`` stays empty): nothing
        # looks for one, and a bucket's order is its slabs' arrival there, so
        # leaving it out skips a dict operation on most moves (a busy pool's
        # slabs are mostly full) and changes no choice.
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
        # The index's map itself (never rebound), for a lookup loop that
        # inlines ``get_cached_block`` (the vLLM adapter's, once per group
        # per block of every request looked up: a call each was most of it).
        self.index_entries: dict[Hashable, BlockRecord] = self._index.entries
        self.num_free = 0
        # Free blocks of draining slabs (``HandOnPool.drain``): held, but not
        # the pool's to hand out; ``_draining`` holds those slabs by id.
        self.num_withheld = 0
        self._draining: dict[int, Slab] = {}
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
        # Cached blocks whose KV the daemon was told not to keep (``demote``):
        # the journal's set, read-only here.
        self.demoted: set[int] = self.journal.demoted

    # --------------------------------------------------------- capacity
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
        return len(self._slabs) * self.blocks_per_slab - self.num_available - self.num_withheld

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

    def drained_slabs(self) -> list[int]:
        """Draining slabs with no live block left: to give back now."""
        return [sid for sid, slab in self._draining.items() if len(slab.free) == self.blocks_per_slab]

    def draining_slabs(self) -> list[int]:
        return list(self._draining)

    def reclaimable_slabs(self) -> list[int]:
        """Slabs with no live block (returnable after evicting their cache)."""
        return [sid for sid, slab in self._slabs.items() if slab.live == 0]

    def settled(self, slab_ids: Sequence[int]) -> list[int]:
        """Of ``slab_ids``, the held slabs no step can still write: no block
        live, and the step open when the last one stopped being live has
        finished (vLLM may free a request's blocks while a step scheduled
        before it knew the request was done still runs over them). Their
        pages may be unmapped while another step runs. None while steps are
        not numbered (``begin_step``): nothing says which step ran when."""
        journal = self.journal
        if not journal.begun:
            return []
        return [sid for sid in slab_ids if (slab := self._slabs.get(sid)) is not None
                and slab.live == 0 and slab.last_step <= journal.done]

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

    def take_journal(self, occupancy: bool = True) -> JournalBatch:
        """The journal so far; ``occupancy=False``: its ops alone (``Journal.take``)."""
        return self.journal.take(self.occupancy if occupancy else None)

    # -------------------------------------------------------- internals
    def _check_held(self, blocks: Sequence[BlockRecord]) -> None:
        for blk in blocks:
            slab = getattr(blk, "slab", None)
            if slab is None or slab.owner is not self:
                raise UnknownBlock(f"block {blk.block_id} does not belong to a slab this pool holds")

    def _rebucket(self, slab: Slab, old_free: int) -> None:
        new_free = len(slab.free)
        if new_free != old_free:
            if old_free:
                del self._by_free[old_free][slab.slab_id]
            if new_free:
                self._by_free[new_free][slab.slab_id] = slab
            if 0 < new_free < self._min_hint:
                self._min_hint = new_free

    def _drop_key(self, blk: BlockRecord) -> None:
        key = blk._block_hash
        self._adopted.discard(blk.block_id)
        if self._labels:
            self._labels.pop(blk.block_id, None)
        self._index.remove(key, blk)
        self.journal.drop(key, blk.block_id)
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

    def _withhold(self, slab: Slab, old_free: int) -> int:
        """A draining slab released blocks (``free`` had ``old_free``
        before): those that became cached lose their keys, and every block
        it freed is withheld. Returns the cached blocks so evicted."""
        evicted = 0
        if slab.cached:
            for blk in slab.blocks:
                if blk.ref_cnt == 0 and blk._block_hash is not None:
                    self._unlink(blk)
                    self._cached_at.pop(blk.block_id, None)
                    self._drop_key(blk)
                    slab.free.append(blk)
                    evicted += 1
            slab.cached = 0
            self.stats.evictions["drain"] += evicted
        self.num_withheld += len(slab.free) - old_free
        return evicted

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
