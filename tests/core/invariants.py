"""The invariants of DESIGN.md that the pool must hold after every operation."""

from kvelastic.core.journal import Mirror
from kvelastic.core.pool import SlabPool


def check_pool(pool: SlabPool, mirror: Mirror | None = None) -> None:
    bps = pool.blocks_per_slab
    live = cached = free = withheld = 0
    index = set(pool.cached_keys())
    draining = set(pool.draining_slabs())
    assert draining <= set(pool.slab_ids())
    for slab_id in pool.slab_ids():
        n_live = n_cached = n_free = 0
        for i in range(bps):
            blk = pool.block(slab_id * bps + i)
            assert blk.block_id == slab_id * bps + i
            assert blk.ref_cnt >= 0
            if blk.ref_cnt > 0:
                n_live += 1
            elif blk.block_hash is not None:
                n_cached += 1
            else:
                n_free += 1
            if blk.block_hash is not None:
                # every block holding a key is findable under it
                assert (blk.block_hash, blk.block_id) in index
        # refcount sync: the slab's counts equal what its blocks say
        assert pool.occupancy(slab_id) == (n_live, n_cached, n_free)
        assert n_live + n_cached + n_free == bps
        if slab_id in draining:   # promised back: nothing cached, its free blocks withheld
            assert n_cached == 0
            live, withheld = live + n_live, withheld + n_free
            continue
        live, cached, free = live + n_live, cached + n_cached, free + n_free
    assert (pool.num_live, pool.num_cached, pool.num_free, pool.num_withheld) == (live, cached, free, withheld)
    assert sorted(pool.drained_slabs()) == sorted(s for s in draining if pool.occupancy(s)[0] == 0)
    # best fit's buckets: each held slab with k >= 1 free blocks in bucket k
    # alone, a full one in none, and none below the scan's start
    by_free = {}
    for slab_id in pool.slab_ids():
        if slab_id not in draining:
            by_free.setdefault(pool.occupancy(slab_id)[2], set()).add(slab_id)
    by_free.pop(0, None)
    assert {k: set(bucket) for k, bucket in enumerate(pool._by_free) if bucket} == by_free
    assert all(not pool._by_free[k] for k in range(1, pool._min_hint))
    # every index entry points at a held block that holds that key
    for key, block_id in index:
        assert pool.block(block_id).block_hash == key
    # aliases: only keyed blocks have them, and the index reaches the block under each
    entries = set(pool._index.items())
    for block_id, aliases in pool._aliases.items():
        assert pool.block(block_id).block_hash is not None and aliases
        assert all((key, block_id) in entries for key in aliases)
    assert len(entries) == len(index) + sum(map(len, pool._aliases.values()))
    if pool.max_cached_blocks is not None:
        assert pool.num_cached <= pool.max_cached_blocks
    if mirror is not None:
        mirror.apply(pool.take_journal())
        assert mirror.slabs == pool.occupancies()
        assert mirror.index_pairs() == index
        assert mirror.demoted == pool.demoted


def snapshot(pool: SlabPool):
    """Everything observable, for 'a failure changed nothing' assertions."""
    bps = pool.blocks_per_slab
    blocks = {}
    for slab_id in pool.slab_ids():
        for i in range(bps):
            blk = pool.block(slab_id * bps + i)
            blocks[blk.block_id] = (blk.ref_cnt, blk.block_hash)
    return (blocks, pool.occupancies(), sorted(pool.cached_keys(), key=repr),
            pool.lru_ids(), dict(pool._cached_at), pool.num_free, pool.num_live, set(pool.demoted),
            list(pool.journal.ops), set(pool.journal.dirty), repr(pool.stats))
