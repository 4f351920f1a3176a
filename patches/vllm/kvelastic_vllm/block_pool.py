"""ElasticBlockPool: vLLM's ``BlockPool`` interface over kvelastic's ``SlabPool``.

There is one record per block: the core pool creates vLLM's own
``KVCacheBlock`` objects (a subclass that adds the slab they live in), so
refcounts and hashes live in one place and the scheduler's block tables hold the same objects the core
pool counts. Block ids are positions in the engine's virtual KV range (slab
``s`` holds blocks ``s * blocks_per_slab`` ...), and only blocks of slabs the
daemon granted ever reach the scheduler.

Capacity: ``get_num_free_blocks`` is a promise ``get_new_blocks`` keeps at
once: free + evictable blocks of held slabs. vLLM asks it right after the
coordinator computed how many blocks a request needs (admission of a whole
prompt, or a step's growth); the plugin hands that need to ``expect`` first,
and the answer is preceded by a *demand* grow for whatever free blocks are
missing. So a request that fits the engine's capacity is admitted however
large it is, and a new block comes from a new slab before a cached block is
evicted while the daemon has memory. When the daemon cannot supply it the
answer counts cached blocks too, and vLLM evicts them or waits, as stock.

KV events (``--kv-events-config``): the events vLLM publishes, built here
as stock builds them, plus kvelastic's own moves, which ``PoolEvents``
(``pool_events.py``) queues and publishes. A block adopted from another
engine (hand-on, kept cache after a restart) is announced as
``BlockStored``: each cached key carries a *label*, its own single-block
``BlockStored`` in msgpack, which travels with the key through the daemon.

The null block is block 0 of the first slab, allocated once and never freed
(vLLM does not keep its refcount, so it is pinned far from 0).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import msgspec
from vllm.distributed.kv_events import MEDIUM_GPU, AllBlocksCleared, KVCacheEvent
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import (
    BlockHash,
    BlockHashWithGroupId,
    KVCacheBlock,
    make_block_hash_with_group_id,
    maybe_convert_block_hash,
    resolve_block_hashes,
)

from kvelastic.errors import OutOfBlocks
from kvelastic.protocol import MAX_LABEL_BYTES
from kvelastic_vllm.demand import Demand
from kvelastic_vllm.pool_events import PoolEvents
from kvelastic_vllm.state import state

log = logging.getLogger("kvelastic.vllm")
_T = TypeVar("_T")
NULL_PINNED = 1 << 40
HEARD = 1 << 62   # ``_check_below`` while a need is heard: every capacity check asks
# An admission's demand waits at most DEMAND_WAIT for the daemon's answer:
# enough for free pages (a map on each worker, about a millisecond), not for
# a reclaim, which waits for another engine's step to end. Past it the
# scheduler goes on (its running requests step, the new one waits in the
# queue) and the slabs come as a late grant (the client's ``demand.py``). A
# running request's demand waits up to DEMAND_TIMEOUT: a preemption would
# cost a recompute. After a refusal the pool does not ask again for a
# while, so a full device costs one round trip per back-off, not one per request.
DEMAND_WAIT = 0.05
DEMAND_TIMEOUT = 2.0
REFUSAL_BACKOFF = 0.2


class ElasticBlock(KVCacheBlock):
    """vLLM's block record plus the slab it lives in (the core pool's one extra field)."""

    __slots__ = ("slab",)


# vLLM 0.30+ blocks name their pool (``free_blocks`` routes a block of another
# pool back to it); vLLM 0.29's have no such field.
BLOCKS_NAME_THEIR_POOL = "pool" in getattr(KVCacheBlock, "__dataclass_fields__", {})


class ElasticBlockPool(BlockPool):
    # BlockPool.__init__ is not called: it would build num_gpu_blocks records
    # and a free queue over the whole virtual range. Records are made per slab.
    # At most 29 attributes: CPython keeps an instance's attributes inline,
    # and specializes the loads of them (here, and in vLLM's code that calls
    # the pool), only while its class has met fewer than 30 names; past that
    # every ``pool.x`` is a dict lookup, which the hot path feels
    # (docs/benchmarks.md). State that belongs together gets an object of
    # its own (``Demand``, ``PoolEvents``); ``tests/vllm/test_block_pool.py``
    # checks the loads.
    def __init__(self, num_gpu_blocks: int, enable_caching: bool, hash_block_size: int,
                 enable_kv_cache_events: bool = False, metrics_collector: Any = None,
                 medium: str = MEDIUM_GPU, num_hash_lookahead_tokens: int = 0) -> None:
        # num_hash_lookahead_tokens: vLLM 0.33 (always by keyword); 0 in 0.32.
        self.num_hash_lookahead_tokens = num_hash_lookahead_tokens
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.hash_block_size = hash_block_size
        self.enable_kv_cache_events = enable_kv_cache_events
        self.metrics_collector = metrics_collector
        self.medium = medium
        self.events = PoolEvents(medium)   # kvelastic's own moves, and vLLM's queue (``kv_event_queue``)
        self._reuse_watchers: dict = {}
        # Group id -> its key suffix, a list: vLLM's group ids are indices
        # into its cache groups (0, 1, ...), and an index is a cheaper load
        # than a dict's ``get`` in the scheduler's most frequent call.
        self._group_suffix: list[bytes] = []
        self.link = state().engine()
        self.core = self.link.pool
        self.client = self.link.client
        self.lock = self.client.lock
        # True while the scheduler thread runs a step (``schedule``,
        # ``update_from_output``: ``engine.py``) with ``lock`` held: the calls
        # it makes then skip the lock (a re-entry costs a large share of stock
        # vLLM's whole call: docs/benchmarks.md). Only that thread calls the pool (vLLM's
        # EngineCore loop); a call outside a step (an abort) takes the lock.
        self.in_step = False
        if num_gpu_blocks != self.link.num_blocks:
            raise RuntimeError(f"kvelastic: vLLM built a pool of {num_gpu_blocks} blocks, "
                               f"the engine registered {self.link.num_blocks}")
        with self.lock:
            if self.core.slab_ids():
                raise RuntimeError("kvelastic: the engine's pool already holds slabs of another block pool")
            self.core.block_factory = (lambda block_id: ElasticBlock(block_id, pool=self)) \
                if BLOCKS_NAME_THEIR_POOL else ElasticBlock
            self.client.low_watermark = self.link.low_watermark
            if enable_kv_cache_events:
                events = self.events
                self.core.on_cleared = events.cleared
                self.core.on_key_removed = events.key_removed
                self.core.on_adopted = events.adopted
                self.client.on_tick = events.publish_queued
                # A router may still hold blocks of this engine's earlier life
                # (same endpoint, killed): they are gone, unless adopted, and
                # then announced again below.
                events.queue.append(AllBlocksCleared())
        if not self.client.ensure(1, timeout=30.0):
            raise RuntimeError("kvelastic: the daemon granted no memory to this engine; "
                               "check KVELASTIC_MEMORY and `kvelastic status`")
        with self.lock:
            [null] = self.core.allocate(1)
        null.is_null = True
        # vLLM does not keep the null block's refcount (it frees it without
        # touching it first): pinned high, it never reaches 0 in the core pool.
        null.ref_cnt = NULL_PINNED
        self.null_block = null
        self._refused_at = 0.0
        # What vLLM's capacity check needs, heard through its hooks (``demand.py``).
        self.demand = Demand()
        # The most blocks one running request's capacity check can need: a
        # step's tokens and a block straddled, per cache group (set with the
        # scheduler's figures in ``engine.wrap_scheduler_init``).
        self.call_blocks = self.link.low_watermark
        self.may_grow = False
        self.short_below = 0
        # get_num_free_blocks asks the daemon first below this many free
        # blocks: ``short_below``, or every time while a need is heard.
        self._check_below = 0
        self.refresh()
        self.link.block_pool = self   # the step wrappers set ``in_step`` (engine.py)

    # ------------------------------------------------------------ capacity
    def refresh(self) -> None:
        """At each step's start (``engine._begin_step``): whether the pool may grow
        in this step (below its cap, and no demand refused by the daemon in
        the last ``REFUSAL_BACKOFF``), and below how many free blocks it is
        short: its reserve, while the I/O thread may refill it (no refill
        refused lately), else ``call_blocks``, below which a running request's
        check may fail. Slabs leave only between steps: this holds for the
        step. Above it every check costs one comparison: an engine under
        memory pressure pays nothing per request."""
        client = self.client
        now = time.monotonic()
        self.may_grow = client.can_grow() and now - self._refused_at > REFUSAL_BACKOFF
        if not self.may_grow:
            self.short_below = 0
        elif now >= client.refused_until:
            self.short_below = max(client.reserve.low_watermark, self.call_blocks)
        else:
            self.short_below = self.call_blocks
        self._check_below = self.short_below if self.demand.need is None else HEARD

    def expect(self, num_blocks: int) -> None:
        """vLLM is about to ask whether ``num_blocks`` (plus the margin) fit
        (``demand.hear``): the demand hears it, and the next check asks."""
        self.demand.expect(num_blocks)
        self._check_below = HEARD

    # The demand's counts, as ``kvelastic bench vllm`` reads them.
    @property
    def heard(self) -> int:
        return self.demand.heard

    @property
    def demands(self) -> int:
        return self.demand.asked

    @property
    def refused_demands(self) -> int:
        return self.demand.refused

    def get_num_free_blocks(self) -> int:
        # Asked once per request per step (hundreds of times at a large batch):
        # one comparison, unless the pool is short or an admission's need was
        # heard. A method of the class, never an attribute of the instance: an
        # instance attribute (or any touch of ``__dict__``) turns CPython's
        # specialized lookups of this pool's methods in vLLM's own code
        # (``allocate_slots``, ``cache_blocks``...) into generic ones, which
        # cost more than the whole call (``docs/benchmarks.md``). The answer is
        # an int the core keeps (free + cached), not a sum made here: a new
        # int object per call, hundreds a step, was half the pool's cost.
        core = self.core
        if core.num_free < self._check_below:
            self._demand()
        return core.num_available

    def _demand(self) -> None:
        """Grow the pool, where the daemon can, before the capacity check in
        progress answers: by the need heard (an admission), else by the most a
        running request's call can need (``call_blocks``)."""
        try:
            need = self.demand.take(-1)
            self._grow_for(need if need >= 0 else self.call_blocks, admission=need >= 0)
        finally:
            self._check_below = self.short_below   # until the next need heard

    def _grow_for(self, need: int, admission: bool = False) -> None:
        """An admission waits at most ``DEMAND_WAIT`` for the daemon (the
        request waits in the queue, the running ones step); a running
        request's grow up to ``DEMAND_TIMEOUT``, rather than be preempted."""
        core, client = self.core, self.client
        client.apply_grants()  # a slab that arrived mid-step is usable in this step
        free = core.num_free
        if need > free:
            if client.can_grow():
                now = time.monotonic()
                if now - self._refused_at > REFUSAL_BACKOFF:
                    self.demand.asked += 1
                    if not client.ensure(need, timeout=DEMAND_TIMEOUT, keep_cache=True,
                                         wait=DEMAND_WAIT if admission else None):
                        self.demand.refused += 1
                        self._refused_at = now
                        self.may_grow, self.short_below = False, 0   # until a step after the back-off
        elif free < client.reserve.low_watermark and client.can_grow():
            client.top_up()  # the I/O thread refills the reserve (an engine at its cap has none to refill)
            self.short_below = min(self.short_below, self.call_blocks)   # said once a step is enough

    def get_usage(self) -> float:
        # The share of the engine's virtual range (the device budget) in live use.
        return (self.core.num_live - 1) / max(1, self.num_gpu_blocks - 1)

    # -------------------------------------------------------------- blocks
    # The calls vLLM makes per request check ``in_step`` themselves and go
    # through ``_locked`` only outside a step: a call through it costs about
    # a twentieth of stock's whole call (docs/benchmarks.md).
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        core = self.core
        try:
            blocks = core.allocate(num_blocks) if self.in_step else self._locked(core.allocate, num_blocks)
        except OutOfBlocks as exc:  # vLLM's contract: ValueError
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool: {exc}") from None
        collector = self.metrics_collector
        if collector:
            for block in blocks:  # as stock: a reused block ends its sampled residency
                if self.enable_caching:
                    collector.on_block_evicted(block)
                collector.on_block_allocated(block)
        if core.num_free < self.short_below:
            self.client.top_up()
        return blocks

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        core = self.core
        if self.in_step:
            core.touch(blocks)
        else:
            self._locked(core.touch, blocks)
        if self.metrics_collector:
            for block in blocks:
                self.metrics_collector.on_block_accessed(block)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        # The null block rides along safely (its refcount is pinned high). Blocks
        # of another pool (HiSparse's deferred frees) are refused as unknown:
        # kvelastic serves attention-only models, which never have any.
        core = self.core
        if self.in_step:
            core.free(ordered_blocks)
        else:
            self._locked(core.free, ordered_blocks)
        # Sliding-window groups free the null block they put in place of
        # blocks out of the window, again and again: pinned high once more.
        self.null_block.ref_cnt = NULL_PINNED

    # ------------------------------------------------------- prefix cache
    def get_cached_block(self, block_hash: bytes, kv_cache_group_ids: list[int]) -> list[KVCacheBlock] | None:
        # The core's get_cached_block, inline: key -> its block, or
        # {block_id: block} when several hold the key (``HashIndex``). One
        # group (attention-only models) answers without a loop.
        entries, suffixes = self.core.index_entries, self._group_suffix
        if len(kv_cache_group_ids) == 1:
            group_id = kv_cache_group_ids[0]
            try:
                suffix = suffixes[group_id]
            except IndexError:
                suffix = self._suffix(group_id)
            block = entries.get(block_hash + suffix)
            if block is None:
                return None
            return [next(iter(block.values())) if type(block) is dict else block]
        cached = []
        for group_id in kv_cache_group_ids:
            try:
                suffix = suffixes[group_id]
            except IndexError:
                suffix = self._suffix(group_id)
            block = entries.get(block_hash + suffix)
            if block is None:
                return None
            cached.append(next(iter(block.values())) if type(block) is dict else block)
        return cached

    def _suffix(self, group_id: int) -> bytes:
        """The group's key suffix: ``make_block_hash_with_group_id(hash, g) == hash + suffix``."""
        suffixes = self._group_suffix
        while len(suffixes) <= group_id:
            suffixes.append(make_block_hash_with_group_id(BlockHash(b""), len(suffixes)))
        return suffixes[group_id]

    def cache_full_blocks(self, request: Any, blocks: list[KVCacheBlock], num_cached_blocks: int,
                          num_full_blocks: int, block_size: int, kv_cache_group_id: int,
                          block_mask: list[bool] | None = None) -> None:
        if num_cached_blocks >= num_full_blocks:
            return
        # make_block_hash_with_group_id, with the group's 4-byte suffix cached
        try:
            suffix = self._group_suffix[kv_cache_group_id]
        except IndexError:
            suffix = self._suffix(kv_cache_group_id)
        core = self.core
        if block_mask is None and block_size == self.hash_block_size and not self.enable_kv_cache_events:
            # The common case, one pass each (vLLM calls this per request per
            # step): every block stored, the request's own hashes (what
            # resolve_block_hashes returns at this block size), no labels.
            to_cache = blocks[num_cached_blocks:num_full_blocks]
            for block in to_cache:
                if block.is_null:
                    break
            else:
                keys = [h + suffix for h in request.block_hashes[num_cached_blocks:num_full_blocks]]
                lengths = range((num_cached_blocks + 1) * block_size, (num_full_blocks + 1) * block_size, block_size)
                if self.in_step:
                    core.cache(to_cache, keys, lengths)
                else:
                    self._locked(core.cache, to_cache, keys, lengths)
                return
        hashes = resolve_block_hashes(request.block_hashes, self.hash_block_size, block_size)
        events = self.enable_kv_cache_events
        to_cache, keys, prefix_lengths, stored = [], [], [], []
        for i, block in enumerate(blocks[num_cached_blocks:num_full_blocks]):
            if block.is_null or (block_mask is not None and not block_mask[i]):
                continue
            to_cache.append(block)
            keys.append(hashes[num_cached_blocks + i] + suffix)
            prefix_lengths.append((num_cached_blocks + i + 1) * block_size)
            stored.append(i)
        labels = None
        if events and stored:
            extra_keys = self._extra_keys(request, num_cached_blocks, num_full_blocks, block_size, stored)
            labels = [self._label(request, hashes, num_cached_blocks + i, block_size, kv_cache_group_id, extra)
                      for i, extra in zip(stored, extra_keys)]
        if self.in_step:
            core.cache(to_cache, keys, prefix_lengths, labels)
        else:
            self._locked(core.cache, to_cache, keys, prefix_lengths, labels)
        if events and stored:
            self._emit_stored(request, hashes, num_cached_blocks, num_full_blocks, block_size,
                              kv_cache_group_id, stored, extra_keys)

    @staticmethod
    def _extra_keys(request, first: int, last: int, block_size: int, stored: list[int]) -> list:
        """vLLM's per-block extra keys (LoRA, multimodal, salt) of the stored blocks."""
        from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

        out, mm_idx = [], 0
        for i in range(first, last):
            keys, mm_idx = generate_block_hash_extra_keys(request, i * block_size, (i + 1) * block_size, mm_idx)
            if i - first in stored:
                out.append(keys)
        return out

    def _lookahead(self, request, blocks: Sequence[int], block_size: int) -> dict[str, Any]:
        if not self.num_hash_lookahead_tokens:
            return {}
        # vLLM 0.33's lookahead hashing: a method of its BlockPool (0.32 lacks it).
        return {"lookahead_token_ids": [self._lookahead_token_ids(request, (j + 1) * block_size)  # type: ignore[attr-defined]
                                        for j in blocks]}

    def _label(self, request, hashes, j: int, block_size: int, group_id: int, extra_keys) -> bytes:
        """Block ``j``'s own ``BlockStored``, packed: what an engine that adopts it announces."""
        event = self._build_block_stored_event(
            request, block_hashes=[maybe_convert_block_hash(hashes[j])],
            parent_block_hash=maybe_convert_block_hash(hashes[j - 1]) if j else None,
            start_token_idx=j * block_size, end_token_idx=(j + 1) * block_size, block_size=block_size,
            kv_cache_group_id=group_id, extra_keys_list=[extra_keys], **self._lookahead(request, [j], block_size))
        label = msgspec.msgpack.encode(event)
        return label if len(label) <= MAX_LABEL_BYTES else b""   # unlabelled: adopters cannot announce it

    def _emit_stored(self, request, hashes, first, last, block_size, group_id, stored, extra_keys) -> None:
        """The range's event, as stock vLLM builds it."""
        parent = maybe_convert_block_hash(hashes[first - 1]) if first else None
        event = self._build_block_stored_event(
            request, block_hashes=[maybe_convert_block_hash(hashes[first + i]) for i in stored],
            parent_block_hash=parent, start_token_idx=first * block_size, end_token_idx=last * block_size,
            block_size=block_size, kv_cache_group_id=group_id, extra_keys_list=extra_keys,
            **self._lookahead(request, [first + i for i in stored], block_size))
        with self.lock:
            self.events.queue.append(event)

    def evict_blocks(self, block_ids: set[int]) -> None:
        with self.lock:
            blocks = [self.core.block(i) for i in block_ids]
            self.core.uncache(blocks)
        if self.metrics_collector:
            for block in blocks:
                self.metrics_collector.on_block_evicted(block)

    def reset_prefix_cache(self) -> bool:
        # Callers reset after changing the weights (RL weight updates, a
        # level-2 sleep): from now on this engine's cache is its own, whether
        # or not the reset succeeds (vLLM refuses while blocks are in use).
        self.client.diverge("prefix cache reset")
        with self.lock:
            if self.core.num_live != 1:  # the null block is always live
                log.warning("kvelastic: cannot reset the prefix cache: %d block(s) still in use",
                            self.core.num_live - 1)
                return False
            self.core.clear_index()
        if self.metrics_collector:
            self.metrics_collector.reset()
        log.info("kvelastic: prefix cache reset")
        return True

    def take_events(self) -> list[KVCacheEvent]:
        if not self.enable_kv_cache_events:
            return []
        with self.lock:
            return self.events.take()

    @property
    def kv_event_queue(self) -> list[KVCacheEvent]:
        """vLLM's name for the queue (its ``emit_cached_block_events`` appends to it)."""
        return self.events.queue

    @kv_event_queue.setter
    def kv_event_queue(self, events: list[KVCacheEvent]) -> None:
        self.events.queue = events

    # ------------------------------------------------- state-block caching
    # vLLM caches Mamba and linear-attention state blocks ("align" mode, the
    # default with prefix caching) through partial-block entries and hash
    # moves. A block's first key is its key in the core pool (journalled,
    # mirrored, kept); a further entry for the same block is an alias there
    # (lookups only), which leaves with the block's key, as stock's secondary
    # hashes leave with its primary. Same decisions as stock's ``BlockPool``
    # (``tests/vllm/test_state_caching.py`` drives both in lockstep).
    def cache_partial_block(self, request: Any, block: KVCacheBlock, num_tokens: int, kv_cache_group_id: int,
                            block_size: int, replace_existing_hashes: bool = False) -> BlockHashWithGroupId | None:
        if block.is_null:
            return None
        assert block_size % self.hash_block_size == 0
        # The entry is the prefix's chained hash at ``num_tokens`` (a multiple of the hash block size).
        units = num_tokens // self.hash_block_size
        hashed = units * self.hash_block_size
        assert 0 < units <= len(request.block_hashes)
        block_hash = request.block_hashes[units - 1]
        key = make_block_hash_with_group_id(block_hash, kv_cache_group_id)
        already = self._locked(self._enter_partial, block, key, hashed, replace_existing_hashes)
        if self.enable_kv_cache_events and not already:
            from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

            parent = request.block_hashes[units - 2] if units > 1 else None
            start = (units - 1) * self.hash_block_size
            extra, _ = generate_block_hash_extra_keys(request, start, num_tokens, 0)
            event = self._build_block_stored_event(
                request, block_hashes=[maybe_convert_block_hash(block_hash)],
                parent_block_hash=maybe_convert_block_hash(parent) if parent is not None else None,
                start_token_idx=start, end_token_idx=num_tokens, block_size=num_tokens - start,
                kv_cache_group_id=kv_cache_group_id, extra_keys_list=[extra])
            with self.lock:
                self.events.queue.append(event)
        return key

    def _enter_partial(self, block: KVCacheBlock, key: BlockHashWithGroupId, hashed: int, replace: bool) -> bool:
        """``cache_partial_block``'s change to the core pool; whether ``key``
        reached ``block`` already (no news then)."""
        core = self.core
        already = key in core.keys_of(block)
        if replace or (not already and block.block_hash is not None and block.block_hash_num_tokens is not None
                       and block.block_hash_num_tokens < hashed):
            core.uncache([block])          # every entry of the block goes (its KV is rewritten)
            already = False
        if block.block_hash is None:
            core.cache([block], [key], num_tokens=[hashed])
        elif not already:
            core.alias(block, key)
        return already

    def move_block_hashes(self, src_block: KVCacheBlock, dst_block: KVCacheBlock) -> None:
        """``src_block``'s entries now reach ``dst_block`` (a private copy the
        request's next writes leave alone); as stock, no events: the entries
        stay live, only their block changed."""
        assert dst_block.block_hash is None
        self._locked(self._move_entries, src_block, dst_block)

    def _move_entries(self, src_block: KVCacheBlock, dst_block: KVCacheBlock) -> None:
        core = self.core
        keys, num_tokens = core.keys_of(src_block), src_block.block_hash_num_tokens
        if not keys:
            return
        self.events.quiet = True
        try:
            core.uncache([src_block])
        finally:
            self.events.quiet = False
        core.cache([dst_block], [keys[0]], num_tokens=None if num_tokens is None else [num_tokens])
        for key in keys[1:]:
            core.alias(dst_block, key)

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        """Drop every entry of ``block`` (vLLM rewrites it in place next)."""
        if self.metrics_collector:
            self.metrics_collector.on_block_evicted(block)
        return self._locked(self.core.uncache, [block]) > 0

    def _locked(self, method: Callable[..., _T], *args: Any) -> _T:
        """``method(*args)`` with the client's lock held, unless the scheduler's
        step holds it already (``in_step``). The one place a call outside a
        step (an abort, a test) takes the lock."""
        if self.in_step:
            return method(*args)
        with self.lock:
            return method(*args)

    # ------------------------------------------- features kvelastic leaves out
    # HiSparse's pinned blocks, with vLLM's signature (``tests/vllm/signatures.py``),
    # refused clearly; ``engine._check_specs`` refuses its caches at start-up.
    def unpin_blocks(self, blocks: Iterable[KVCacheBlock], on_reuse: Any) -> None:
        raise NotImplementedError("kvelastic: pinned host blocks (HiSparse) are not available in the elastic "
                                  "block pool")
