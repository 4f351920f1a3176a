"""The behaviours vLLM's tests/v1/core/test_prefix_caching.py asserts, held by
ElasticBlockPool under vLLM's own KVCacheManager, with a real daemon.

Block ids are not compared (best-fit placement picks others); hits, refcounts,
eviction order, stats, events and capacity are.
"""

import dis
import random
import sys

import pytest

pytest.importorskip("vllm")

from kvelastic_tools.vllm_bench.vllm_pool import admit, elastic, manager, request

pytestmark = pytest.mark.vllm
BS = 16


def ids(blocks):
    return [b.block_id for b in blocks.blocks[0]]


def test_prefill_hits_and_refcounts(daemon):
    with elastic(daemon.socket, low_watermark=8):
        mgr = manager(num_blocks=elastic_blocks(), block_size=BS)
        common = list(range(48))                         # 3 full blocks
        r0 = request("0", common + [100, 101, 102])
        blocks0, hit0 = admit(mgr, r0)
        assert hit0 == 0 and len(blocks0.blocks[0]) == 4
        r1 = request("1", common + [200, 201])
        blocks1, hit1 = admit(mgr, r1)
        assert hit1 == 48                                 # the shared prefix, in tokens
        shared = mgr.coordinator.single_type_managers[0].req_to_blocks["1"][:3]
        assert shared == mgr.coordinator.single_type_managers[0].req_to_blocks["0"][:3]
        assert all(b.ref_cnt == 2 for b in shared)        # one record, two users
        mgr.free(r0)
        assert all(b.ref_cnt == 1 for b in shared)
        mgr.free(r1)
        assert all(b.ref_cnt == 0 and b.block_hash is not None for b in shared)  # cached, evictable


def test_touch_revives_cached_blocks(daemon):
    with elastic(daemon.socket, low_watermark=8):
        mgr = manager(num_blocks=elastic_blocks(), block_size=BS)
        pool = mgr.block_pool
        r0 = request("0", list(range(64)))
        admit(mgr, r0)
        mgr.free(r0)
        in_use_before = in_use(pool)
        r1 = request("1", list(range(64)) + [7])
        _, hit = admit(mgr, r1)
        assert hit == 64
        # 4 cached blocks turned live, 1 new block for the tail
        assert pool.core.num_live - 1 == 5
        assert in_use(pool) == in_use_before + 5


def in_use(pool) -> int:
    """Held blocks that are not allocatable (the pool may grow meanwhile)."""
    with pool.lock:   # not get_num_free_blocks: a capacity check may grow the pool first
        return pool.core.num_blocks - pool.core.num_available


def test_lru_eviction_takes_the_tail_of_a_chain_first(daemon):
    # capacity: 2 slabs of 8 blocks, one is the null block -> 15 usable
    with elastic(daemon.socket, low_watermark=8, max_bytes=2 * (2 << 20)):
        mgr = manager(num_blocks=elastic_blocks(), block_size=BS)
        pool = mgr.block_pool
        pool.client.ensure(16)
        assert pool.get_num_free_blocks() == 15
        a = request("a", list(range(6 * BS)))          # 6 blocks
        admit(mgr, a)
        mgr.free(a)                                       # cached: head ... tail
        b = request("b", list(range(1000, 1000 + 11 * BS)))  # needs 11: 9 free + 2 evicted
        admit(mgr, b)
        assert pool.core.stats.evictions["lru"] == 2
        mgr.free(b)
        a2 = request("a2", list(range(6 * BS)) + [5])
        _, hit = admit(mgr, a2)
        assert hit == 4 * BS                              # the head survived, the 2 tail blocks went


def test_exhaustion_makes_the_scheduler_wait_not_crash(daemon):
    with elastic(daemon.socket, low_watermark=8, max_bytes=2 << 20):   # one slab: 7 usable blocks
        mgr = manager(num_blocks=elastic_blocks(), block_size=BS)
        r0 = request("0", list(range(5 * BS)))
        blocks, _ = admit(mgr, r0)
        assert blocks is not None
        r1 = request("1", list(range(500, 500 + 5 * BS)))
        blocks, _ = admit(mgr, r1)
        assert blocks is None                             # not enough: wait or preempt
        mgr.free(r0)
        blocks, _ = admit(mgr, r1)
        assert blocks is not None                         # memory came back, it runs


def test_capacity_grows_from_the_daemon(daemon):
    with elastic(daemon.socket, low_watermark=8) as link:
        mgr = manager(num_blocks=elastic_blocks(), block_size=BS)
        held_before = len(link.pool.slab_ids())
        reqs = [request(str(i), list(range(i * 1000, i * 1000 + 8 * BS))) for i in range(6)]
        for r in reqs:
            blocks, _ = admit(mgr, r)
            assert blocks is not None
        assert len(link.pool.slab_ids()) > held_before   # 48 blocks: slabs granted on demand
        for r in reqs:
            mgr.free(r)


def test_reset_prefix_cache(daemon):
    with elastic(daemon.socket, low_watermark=8):
        mgr = manager(num_blocks=elastic_blocks(), block_size=BS)
        r0 = request("0", list(range(64)))
        admit(mgr, r0)
        assert not mgr.reset_prefix_cache()               # blocks in use: refused
        mgr.free(r0)
        assert mgr.reset_prefix_cache()
        _, hit = admit(mgr, request("1", list(range(64)) + [1]))
        assert hit == 0                                   # new requests miss


def test_prefix_cache_stats(daemon):
    with elastic(daemon.socket, low_watermark=8):
        mgr = manager(num_blocks=elastic_blocks(), block_size=BS)
        admit(mgr, request("0", list(range(64))))
        admit(mgr, request("1", list(range(64)) + [9]))
        stats = mgr.make_prefix_cache_stats()
        assert stats.requests == 2 and stats.queries == 64 + 65 and stats.hits == 64


def test_kv_cache_events(daemon):
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    with elastic(daemon.socket, low_watermark=8, max_bytes=2 << 20):
        mgr = manager(num_blocks=elastic_blocks(), block_size=BS, events=True)
        r0 = request("0", list(range(4 * BS)))
        admit(mgr, r0)
        events = mgr.take_events()
        stored = [e for e in events if isinstance(e, BlockStored)]
        assert sum(len(e.block_hashes) for e in stored) == 4
        mgr.free(r0)
        r1 = request("1", list(range(900, 900 + 7 * BS)))
        admit(mgr, r1)                                    # 3 free + 4 evicted
        removed = [e for e in mgr.take_events() if isinstance(e, BlockRemoved)]
        assert sorted(h for e in removed for h in e.block_hashes) == \
            sorted(h for e in stored for h in e.block_hashes)
        mgr.free(r1)
        assert mgr.reset_prefix_cache()
        assert any(isinstance(e, AllBlocksCleared) for e in mgr.take_events())


def test_several_kv_cache_groups_hit_together(daemon):
    with elastic(daemon.socket, low_watermark=8):
        mgr = manager(num_blocks=elastic_blocks(), block_size=BS, groups=2)
        r0 = request("0", list(range(3 * BS)) + [1])
        admit(mgr, r0)
        _, hit = admit(mgr, request("1", list(range(3 * BS)) + [2]))
        assert hit == 3 * BS
        for group in range(2):
            a = mgr.coordinator.single_type_managers[group].req_to_blocks["0"][:3]
            b = mgr.coordinator.single_type_managers[group].req_to_blocks["1"][:3]
            assert a == b


def test_same_hits_as_stock_vllm_on_a_random_workload(daemon):
    rng = random.Random(0)
    prefixes = [[rng.randrange(30000) for _ in range(rng.randint(1, 6) * BS)] for _ in range(4)]
    workload = []
    for i in range(60):
        toks = rng.choice(prefixes) + [rng.randrange(30000) for _ in range(rng.randint(0, 40))]
        workload.append((str(i), toks, rng.random() < 0.5))

    def run(mgr):
        hits, live = [], []
        for rid, toks, finish_early in workload:
            r = request(rid, toks)
            blocks, hit = admit(mgr, r)
            assert blocks is not None
            hits.append(hit)
            live.append(r)
            if finish_early or len(live) > 6:
                mgr.free(live.pop(0))
        return hits

    stock = run(manager(num_blocks=1024, block_size=BS))
    with elastic(daemon.socket, low_watermark=64):
        elastic_hits = run(manager(num_blocks=elastic_blocks(), block_size=BS))
    assert sum(stock) > 0 and elastic_hits == stock


def read_in_step(pool) -> bool:
    return pool.in_step


@pytest.mark.skipif(sys.version_info < (3, 11), reason="CPython specializes attribute loads from 3.11")
def test_the_pools_attributes_stay_inline_so_loads_of_them_stay_specialized(daemon):
    """CPython keeps an instance's attributes inline, and specializes every
    ``pool.x`` in vLLM's code and the pool's own on them, only while its class
    has met fewer than 30 attribute names: one more and each load becomes a
    dict lookup (the hot path's ratio to stock rose by points). Checked after
    what a step sets: an admission heard, a refresh, the scheduler's figures."""
    with elastic(daemon.socket, low_watermark=8):
        mgr = manager(num_blocks=elastic_blocks(), block_size=BS)
        pool = mgr.block_pool
        pool.call_blocks = 24
        pool.refresh()
        r0 = request("0", list(range(4 * BS)) + [1])
        admit(mgr, r0)
        mgr.free(r0)
        for _ in range(100):
            read_in_step(pool)
        loads = {i.opname for i in dis.get_instructions(read_in_step, adaptive=True) if "LOAD_ATTR" in i.opname}
        assert loads == {"LOAD_ATTR_INSTANCE_VALUE"}, f"{loads}: {len(vars(pool))} attributes on the pool"


def elastic_blocks() -> int:
    from kvelastic_vllm.state import state

    return state().engine().num_blocks


def test_an_engine_announces_the_cache_it_adopts_as_its_first_engine_stored_it(daemon):
    """Kept cache after a restart: the next engine of the namespace adopts the
    blocks, and publishes a BlockStored per block (hash, parent, token ids)
    equal to what the first engine published, parents first: a router learns
    of KV the new engine did not compute, before any request hits it."""
    from vllm.distributed.kv_events import BlockStored

    prompt = [random.Random(3).randrange(30000) for _ in range(5 * BS)] + [1]
    with elastic(daemon.socket, low_watermark=8, engine_id="first"):
        mgr = manager(num_blocks=elastic_blocks(), block_size=BS, events=True)
        r0 = request("0", prompt)
        admit(mgr, r0)
        mgr.free(r0)
        first = [e for e in mgr.take_events() if isinstance(e, BlockStored)]
    # The first engine's range event, one block at a time.
    expected = []
    for e in first:
        parent = e.parent_block_hash
        for i, h in enumerate(e.block_hashes):
            expected.append((h, parent, e.token_ids[i * BS:(i + 1) * BS]))
            parent = h
    assert len(expected) == 5

    with elastic(daemon.socket, low_watermark=8, engine_id="second") as link:
        mgr = manager(num_blocks=elastic_blocks(), block_size=BS, events=True)
        assert link.pool.stats.adopted_blocks == 5
        announced = [e for e in mgr.take_events() if isinstance(e, BlockStored)]
        assert [(e.block_hashes[0], e.parent_block_hash, e.token_ids) for e in announced] == expected
        assert all(len(e.block_hashes) == 1 and e.medium == mgr.block_pool.medium for e in announced)
        _, hit = admit(mgr, request("1", prompt))
        assert hit == 5 * BS                                  # the KV is there, as announced
