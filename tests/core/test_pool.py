"""Unit tests of SlabPool: every operation and every failure path."""

import pytest

from kvelastic.core.block import Block
from kvelastic.core.journal import Mirror
from kvelastic.core.pool import SlabPool
from kvelastic.core.stats import COUNTER_NAMES
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
from tests.core.invariants import check_pool, snapshot


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def make_pool(slabs=(0, 1), bps=4, **kw):
    pool = SlabPool(bps, **kw)
    for s in slabs:
        pool.add_slab(s)
    return pool


def keys(*names):
    return [f"k{n}".encode() for n in names]


def assert_unchanged(pool, op, exc):
    before = snapshot(pool)
    with pytest.raises(exc):
        op()
    assert snapshot(pool) == before
    check_pool(pool)


# ------------------------------------------------------------- allocation
def test_allocate_is_best_fit_from_fullest_slab():
    pool = make_pool(slabs=(0, 1, 2), bps=4)
    a = pool.allocate(3)                  # all from one slab
    assert {b.block_id // 4 for b in a} == {a[0].block_id // 4}
    b = pool.allocate(1)                  # the fullest slab with room: the same one
    assert b[0].block_id // 4 == a[0].block_id // 4
    c = pool.allocate(1)                  # that slab is full now: another one
    assert c[0].block_id // 4 != a[0].block_id // 4
    pool.free(a[:2])                      # slab of a: 2 free; slab of c: 3 free
    d = pool.allocate(1)
    assert d[0].block_id // 4 == a[0].block_id // 4
    check_pool(pool)


def test_allocate_spans_slabs_and_sets_refcounts():
    pool = make_pool(slabs=(0, 1), bps=4)
    blocks = pool.allocate(6)
    assert len({b.block_id for b in blocks}) == 6
    assert all(b.ref_cnt == 1 for b in blocks)
    assert pool.num_live == 6 and pool.num_free == 2
    check_pool(pool)


def test_allocate_more_than_available_changes_nothing():
    pool = make_pool(slabs=(0,), bps=4)
    pool.allocate(1)
    assert_unchanged(pool, lambda: pool.allocate(4), OutOfBlocks)
    assert_unchanged(pool, lambda: pool.allocate(-1), PoolError)
    assert pool.allocate(0) == []


def test_allocate_evicts_lru_cached_blocks_when_no_free_block():
    pool = make_pool(slabs=(0,), bps=4)
    blocks = pool.allocate(4)
    pool.cache(blocks, keys(0, 1, 2, 3))
    pool.free([blocks[3], blocks[2]])     # tail of the chain first
    pool.free([blocks[1], blocks[0]])
    got = pool.allocate(1)
    assert got == [blocks[3]]             # the tail went first
    assert pool.lookup(keys(0, 1, 2, 3)) == blocks[:3]
    assert pool.stats.evictions["lru"] == 1
    check_pool(pool)


# ---------------------------------------------------------- touch / free
def test_touch_revives_cached_block_and_counts_refs():
    pool = make_pool(slabs=(0,), bps=4)
    [blk] = pool.allocate(1)
    pool.cache([blk], keys(0))
    pool.free([blk])
    assert pool.num_cached == 1
    pool.touch([blk])
    assert blk.ref_cnt == 1 and pool.num_cached == 0 and pool.num_live == 1
    pool.touch([blk])
    assert blk.ref_cnt == 2
    pool.free([blk, blk])
    assert pool.num_cached == 1
    check_pool(pool)


def test_touch_free_block_fails_and_changes_nothing():
    pool = make_pool(slabs=(0,), bps=4)
    [a, b] = pool.allocate(2)
    pool.cache([a], keys(0))
    pool.free([a, b])                      # a cached, b free
    assert_unchanged(pool, lambda: pool.touch([a, b]), BlockNotCached)
    assert a.ref_cnt == 0


def test_double_free_fails_and_changes_nothing():
    pool = make_pool(slabs=(0,), bps=4)
    [a, b] = pool.allocate(2)
    pool.free([a])
    assert_unchanged(pool, lambda: pool.free([b, a]), BlockNotLive)
    assert_unchanged(pool, lambda: pool.free([b, b]), BlockNotLive)
    pool.free([b])
    check_pool(pool)


def test_free_puts_unhashed_blocks_back_on_their_slab():
    pool = make_pool(slabs=(0,), bps=4)
    blocks = pool.allocate(4)
    pool.free(blocks)
    assert pool.num_free == 4 and pool.num_cached == 0
    assert pool.idle_slabs() == [0]


def test_foreign_block_is_rejected():
    pool = make_pool(slabs=(0,), bps=4)
    other = make_pool(slabs=(0,), bps=4)
    [foreign] = other.allocate(1)
    pool.allocate(1)
    assert_unchanged(pool, lambda: pool.free([foreign]), UnknownBlock)
    assert_unchanged(pool, lambda: pool.touch([foreign]), UnknownBlock)
    assert_unchanged(pool, lambda: pool.cache([foreign], keys(0)), UnknownBlock)
    with pytest.raises(UnknownBlock):
        pool.block(99)
    with pytest.raises(UnknownBlock):
        pool.block(-1)


# ---------------------------------------------------------- cache / lookup
def test_cache_and_lookup_longest_prefix():
    pool = make_pool(slabs=(0, 1), bps=4)
    blocks = pool.allocate(3)
    pool.cache(blocks, keys(0, 1, 2))
    assert pool.lookup(keys(0, 1, 2, 3)) == blocks
    assert pool.lookup(keys(0, 9, 2)) == blocks[:1]
    assert pool.lookup(keys(9)) == []
    assert (pool.stats.lookup_blocks, pool.stats.hit_blocks) == (8, 4)
    check_pool(pool)


def test_cache_unallocated_block_fails_and_changes_nothing():
    pool = make_pool(slabs=(0,), bps=4)
    [a, b] = pool.allocate(2)
    pool.free([b])
    assert_unchanged(pool, lambda: pool.cache([a, b], keys(0, 1)), BlockNotLive)
    assert_unchanged(pool, lambda: pool.cache([a], keys(0, 1)), PoolError)


def test_one_key_may_map_to_several_blocks():
    pool = make_pool(slabs=(0,), bps=4)
    [a, b] = pool.allocate(2)
    pool.cache([a], keys(0))
    pool.cache([b], keys(0))              # same content filled twice
    assert pool.lookup(keys(0))[0] in (a, b)
    pool.free([a])
    pool.allocate(3)                       # 2 free + evicts a
    assert pool.lookup(keys(0)) == [b]
    check_pool(pool)


def test_recache_replaces_key():
    pool = make_pool(slabs=(0,), bps=4, )
    [a] = pool.allocate(1)
    pool.cache([a], keys(0))
    pool.cache([a], keys(0))               # idempotent
    pool.cache([a], keys(1))
    assert pool.lookup(keys(0)) == [] and pool.lookup(keys(1)) == [a]
    check_pool(pool)


def test_group_ids_in_keys_keep_groups_apart():
    pool = make_pool(slabs=(0,), bps=4)
    [a, b] = pool.allocate(2)
    pool.cache([a, b], [(b"h", 0), (b"h", 1)])
    assert pool.lookup([(b"h", 1)]) == [b]


def test_queries_count_in_tokens_whole_blocks_through_lookup():
    pool = make_pool(slabs=(0,), bps=4)
    [a] = pool.allocate(1)
    pool.cache([a], keys(0))
    assert pool.lookup(keys(0, 1)) == [a]
    pool.record_query(query_tokens=40, hit_tokens=24)       # vLLM's own counts, from the plugin
    s = pool.stats
    assert (s.lookups, s.lookup_blocks, s.hit_blocks) == (2, 2, 1)
    assert (s.query_tokens, s.hit_tokens) == (2 * pool.block_size + 40, pool.block_size + 24)
    assert s.counters()["hit_tokens"] == s.hit_tokens and set(s.counters()) == COUNTER_NAMES


# ------------------------------------------------------------------ limits
def test_size_limit_evicts_whole_idle_slabs_first():
    pool = make_pool(slabs=(0, 1), bps=4, block_bytes=100, max_cached_bytes=500)
    s0 = pool.allocate(4)
    s1 = pool.allocate(4)
    pool.cache(s0 + s1, keys(*range(8)))
    pool.free(s0)                          # 4 cached, slab of s0 has no live block
    pool.free(s1[:2])                      # 6 cached > limit 5
    assert pool.num_cached <= 5
    # the oldest block's slab held no live block, so its whole cache went
    assert pool.occupancy(s0[0].block_id // 4) == (0, 0, 4)
    assert pool.stats.evictions["size_limit"] == 4
    check_pool(pool)


def test_ttl_expires_old_cached_blocks():
    clock = FakeClock()
    pool = make_pool(slabs=(0,), bps=4, ttl=10.0, clock=clock)
    [a, b] = pool.allocate(2)
    pool.cache([a, b], keys(0, 1))
    pool.free([a])
    clock.now += 6
    pool.free([b])
    clock.now += 6                          # a is 12 s old, b 6 s
    assert pool.expire() == 1
    assert pool.lookup(keys(0)) == [] and pool.lookup(keys(1)) == [b]
    assert pool.stats.evictions["ttl"] == 1
    check_pool(pool)


def test_explicit_evict_returns_count():
    pool = make_pool(slabs=(0,), bps=4)
    blocks = pool.allocate(3)
    pool.cache(blocks, keys(0, 1, 2))
    pool.free(blocks)
    assert pool.evict(1) == 3              # slab had no live block: all its cache
    assert pool.evict(5) == 0
    assert pool.stats.evictions["explicit"] == 3


# ------------------------------------------------------------------- slabs
def test_take_slab_back_evicts_cache_then_removes():
    pool = make_pool(slabs=(0, 1), bps=4)
    blocks = pool.allocate(2)
    slab = blocks[0].block_id // 4
    pool.cache(blocks, keys(0, 1))
    pool.free(blocks)
    assert pool.take_slab_back(slab) == 2
    assert slab not in pool.slab_ids() and pool.lookup(keys(0)) == []
    assert pool.stats.evictions["reclaim"] == 2
    assert pool.num_blocks == 4
    check_pool(pool)


def test_take_slab_back_with_live_blocks_fails_and_changes_nothing():
    pool = make_pool(slabs=(0,), bps=4)
    pool.allocate(1)
    assert_unchanged(pool, lambda: pool.take_slab_back(0), SlabBusy)
    assert_unchanged(pool, lambda: pool.take_slab_back(7), UnknownSlab)


def test_add_slab_twice_fails_and_changes_nothing():
    pool = make_pool(slabs=(0,), bps=4)
    assert_unchanged(pool, lambda: pool.add_slab(0), SlabAlreadyHeld)
    assert_unchanged(pool, lambda: pool.add_slab(-3), UnknownSlab)


def test_reclaimable_and_idle_slabs():
    pool = make_pool(slabs=(0, 1, 2), bps=2)
    a = pool.allocate(2)                   # one slab full and live
    b = pool.allocate(1)
    pool.cache(b, keys(0))
    pool.free(b)                           # one slab with a cached block
    live_slab, cached_slab = a[0].block_id // 2, b[0].block_id // 2
    assert set(pool.reclaimable_slabs()) == {0, 1, 2} - {live_slab}
    assert set(pool.idle_slabs()) == {0, 1, 2} - {live_slab, cached_slab}


# ----------------------------------------------------- invalidate / reset
def test_clear_index_keeps_live_blocks_and_frees_cached():
    pool = make_pool(slabs=(0,), bps=4)
    blocks = pool.allocate(3)
    pool.cache(blocks, keys(0, 1, 2))
    pool.free(blocks[2:])
    assert pool.clear_index() == 1
    assert all(b.ref_cnt == 1 for b in blocks[:2])
    assert pool.lookup(keys(0)) == []
    assert pool.num_free == 2 and pool.num_cached == 0
    pool.free(blocks[:2])                  # running requests finish normally
    assert pool.num_free == 4 and pool.num_cached == 0
    assert pool.stats.evictions["invalidate"] == 1
    check_pool(pool)


def test_reset_needs_no_live_block():
    pool = make_pool(slabs=(0,), bps=4)
    blocks = pool.allocate(2)
    pool.cache(blocks, keys(0, 1))
    assert_unchanged(pool, pool.reset, PoolBusy)
    pool.free(blocks)
    pool.lookup(keys(0))
    pool.reset()
    assert pool.num_cached == 0 and pool.stats.lookups == 0
    check_pool(pool)


# ----------------------------------------------------------------- journal
def test_journal_replays_into_mirror():
    pool = make_pool(slabs=(), bps=4)
    mirror = Mirror()
    pool.add_slab(3)
    blocks = pool.allocate(3)
    pool.cache(blocks, keys(0, 1, 2))
    check_pool(pool, mirror)
    assert mirror.slabs == {3: (3, 0, 1)}
    pool.free(blocks)
    pool.allocate(4)                        # evicts one
    check_pool(pool, mirror)
    pool.clear_index()
    check_pool(pool, mirror)
    assert mirror.index == {}
    pool.add_slab(5)
    pool.take_slab_back(5)
    check_pool(pool, mirror)
    assert set(mirror.slabs) == {3}
    assert not pool.take_journal()          # nothing new since the last batch


def test_uncache_drops_keys_and_frees_cached_blocks():
    pool = make_pool(slabs=(0,), bps=4)
    removed = []
    pool.on_key_removed = removed.append
    [a, b, c] = pool.allocate(3)
    pool.cache([a, b], keys(0, 1))
    pool.free([b])                          # b cached, a live with a key, c live without
    assert pool.uncache([a, b, c]) == 2
    assert a.ref_cnt == 1 and a.block_hash is None
    assert pool.num_cached == 0 and pool.num_free == 2
    assert removed == keys(0, 1)
    assert_unchanged(pool, lambda: pool.uncache([Block(99)]), UnknownBlock)
    check_pool(pool)


# ---------------------------------------------------------------- handoff
def test_labels_travel_with_their_keys_to_the_mirror_and_an_adopter():
    giver = make_pool(slabs=(0,), bps=4)
    mirror = Mirror()
    blocks = giver.allocate(3)
    giver.cache(blocks, keys(0, 1, 2), labels=[b"L0", b"", b"L2"])
    mirror.apply(giver.take_journal())
    assert mirror.label_of == {blocks[0].block_id: b"L0", blocks[2].block_id: b"L2"}
    giver.cache([blocks[2]], keys(7))                  # re-keyed without a label: the old label goes
    giver.free(blocks)
    mirror.apply(giver.take_journal())
    assert mirror.label_of == {blocks[0].block_id: b"L0"}
    assert giver.labelled_keys() == [(blocks[0].block_id, b"L0")]
    entries = giver.cached_entries([0])[0]
    assert sorted(entries) == sorted([(blocks[0].block_id, b"k0", b"L0"), (blocks[1].block_id, b"k1", b""),
                                      (blocks[2].block_id, b"k7", b"")])
    with pytest.raises(PoolError, match="2 labels"):
        giver.cache(blocks[:1], keys(5), labels=[b"a", b"b"])

    taker = make_pool(slabs=(), bps=4)
    heard: list = []
    taker.on_adopted = heard.append
    taker.add_slab(3)
    taker_mirror = Mirror()
    assert taker.adopt(3, entries) == 3
    taker_mirror.apply(taker.take_journal())
    assert heard == [[(b"k0", b"L0")]]                 # only labelled blocks are announced
    assert taker_mirror.label_of == {12 + blocks[0].block_id: b"L0"}
    taker.clear_index()
    taker_mirror.apply(taker.take_journal())
    assert taker.labelled_keys() == [] and taker_mirror.label_of == {}
    check_pool(taker)


def test_a_handed_on_slab_is_adopted_with_its_keys_oldest_first():
    giver = make_pool(slabs=(0,), bps=4)
    blocks = giver.allocate(4)
    giver.cache(blocks, keys(0, 1, 2, 3))
    giver.free([blocks[2], blocks[0], blocks[3], blocks[1]])        # LRU: k2, k0, k3, k1
    entries = giver.cached_entries([0])[0]
    assert entries == [(blocks[i].block_id, f"k{i}".encode(), b"") for i in (2, 0, 3, 1)]

    taker = make_pool(slabs=(1,), bps=4)
    [own] = taker.allocate(1)
    taker.cache([own], keys(9))
    taker.free([own])                                               # taker's own cached block
    taker.add_slab(5)
    mirror = Mirror()
    mirror.apply(taker.take_journal())
    assert taker.adopt(5, entries) == 4
    hits = taker.lookup(keys(0, 1, 2, 3))
    assert [b.block_id for b in hits] == [20 + blocks[i].block_id for i in range(4)]   # the same places
    assert taker.occupancy(5) == (0, 4, 0) and taker.stats.adopted_blocks == 4
    mirror.apply(taker.take_journal())
    check_pool(taker, mirror)                                       # the daemon's mirror learns the keys
    taker.touch(hits[:2])
    assert taker.stats.adopted_hits == 2
    taker.free(hits[:2])
    taker.touch(hits[:1])                                           # a block counts once
    assert taker.stats.adopted_hits == 2
    # Adopted blocks are older than the taker's own: they go first (k2, k3; k0/k1 were touched since).
    assert taker.evict(2) == 2 and taker.lookup(keys(9)) and not taker.lookup(keys(2))


def test_adoption_checks_everything_first_and_skips_keys_already_cached():
    taker = make_pool(slabs=(0, 1), bps=4)
    [a] = taker.allocate(1)
    taker.cache([a], keys(7))
    assert_unchanged(taker, lambda: taker.adopt(1, [(0, b"x"), (4, b"y")]), PoolError)   # outside the slab
    assert_unchanged(taker, lambda: taker.adopt(1, [(0, b"x"), (0, b"y")]), PoolError)   # one place twice
    assert_unchanged(taker, lambda: taker.adopt(0, [(1, b"x")]), SlabBusy)               # not just granted
    assert_unchanged(taker, lambda: taker.adopt(9, [(1, b"x")]), UnknownSlab)
    assert taker.adopt(1, [(0, b"k7"), (1, b"x"), (2, b"x")]) == 1                       # k7 is here already
    assert taker.occupancy(1) == (0, 1, 3) and [b.block_id for b in taker.lookup([b"x"])] == [5]
    check_pool(taker)


def test_a_sealed_batch_carries_the_ops_and_the_next_batch_the_occupancy():
    # A seal (``EngineClient.seal_step``) ships ops alone: the daemon's index
    # must follow at once; the occupancy of the slabs touched comes with the
    # next full batch, including slabs touched only before the seal.
    pool = make_pool(slabs=(), bps=4)
    mirror = Mirror()
    pool.add_slab(3)
    pool.add_slab(5)
    check_pool(pool, mirror)
    blocks = pool.allocate(4)
    pool.cache(blocks, keys(0, 1, 2, 3))
    pool.free(blocks)
    mirror.apply(pool.take_journal())       # shipped: the daemon knows these keys
    [fresh] = pool.allocate(1)              # from the other slab: nothing evicted
    pool.allocate(4)                        # its last three, then the oldest cached block
    assert pool.journal.removed
    sealed = pool.take_journal(occupancy=False)
    assert sealed.ops and sealed.occupancy == {} and sealed.removed
    mirror.apply(sealed)
    assert mirror.index_pairs() == set(pool.cached_keys())   # the dropped key is gone from the daemon's books
    assert mirror.slabs != pool.occupancies()                # the counts have not come yet
    assert not pool.journal.removed and not pool.journal.ops
    pool.free([fresh])
    check_pool(pool, mirror)                 # the full batch: the counts of both slabs, touched before the seal
    # one evicted block live again beside three cached; three live and one free again
    assert mirror.slabs == pool.occupancies() == {3: (1, 3, 0), 5: (3, 0, 1)}


def test_a_key_dropped_in_the_batch_that_stored_it_needs_no_seal():
    # The daemon never heard of it: its STORE is cancelled, no REMOVE goes,
    # and the step that rewrites its block has nothing to seal. A key it
    # had heard of, dropped in the same batch, still asks for a seal.
    pool = make_pool(slabs=(), bps=4)
    mirror = Mirror()
    pool.add_slab(3)
    check_pool(pool, mirror)
    blocks = pool.allocate(4)
    pool.cache(blocks, keys(0, 1, 2, 3))
    pool.free(blocks)
    pool.allocate(2)                        # evicts two keys stored in this very batch
    assert not pool.journal.removed
    check_pool(pool, mirror)                # the daemon ends with the pool's two keys all the same
    pool.allocate(1)                        # a key the daemon knows now
    assert pool.journal.removed
    check_pool(pool, mirror)


# ------------------------------------------------------------- settled slabs
def test_no_slab_is_settled_while_steps_are_not_numbered():
    pool = make_pool()
    pool.free(pool.allocate(2))
    assert pool.settled([0, 1]) == []


def test_a_slab_is_settled_once_the_step_open_at_its_last_free_ended():
    pool = make_pool()
    first = pool.begin_step()
    blocks = pool.allocate(4)                         # best fit: all in one slab
    held = blocks[0].slab.slab_id
    other = 1 - held
    assert pool.settled([0, 1]) == [other]            # never live: no step writes it
    second = pool.begin_step()                        # async scheduling: scheduled before the free
    pool.free(blocks)
    pool.end_step(first)
    assert pool.settled([0, 1]) == [other]            # step 2 may still write the freed blocks
    pool.end_step(second)
    assert sorted(pool.settled([0, 1, 7])) == [0, 1]  # a slab not held is never settled


def test_a_live_block_or_a_cached_block_freed_late_keeps_its_slab_unsettled():
    pool = make_pool(slabs=(0,))
    step = pool.begin_step()
    blocks = pool.allocate(2)
    pool.cache(blocks[:1], keys(1))
    pool.free(blocks[1:])
    pool.end_step(step)
    assert pool.settled([0]) == []                    # a block is live
    later = pool.begin_step()
    pool.free(blocks[:1])                             # cached now, freed while step ``later`` runs
    assert pool.settled([0]) == []
    pool.end_step(later)
    assert pool.settled([0]) == [0]
