"""Demand (``kvelastic_vllm/demand.py``): which of vLLM's capacity checks the
block pool hears, and what it asks the daemon for, with a real daemon and
vLLM's own KVCacheManager."""

import pytest

pytest.importorskip("vllm")

from kvelastic.client.engine import EngineClient
from kvelastic.core.pool import SlabPool
from kvelastic_tools.vllm_bench.vllm_pool import PAGE, admit, elastic, manager, request
from kvelastic_vllm import demand
from kvelastic_vllm.state import state

pytestmark = pytest.mark.vllm
BS = 16


def hooked(mgr) -> bool:
    return "allocate_slots" in vars(mgr) or "get_num_blocks_to_allocate" in vars(mgr.coordinator)


def drain(pool) -> list:
    """Take every free block (as running requests would)."""
    return pool.get_new_blocks(pool.core.num_free)


def test_an_admission_is_heard_until_the_steps_end_and_vllms_classes_stay_stock(daemon):
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    stock_allocate_slots = KVCacheManager.allocate_slots
    with elastic(daemon.socket, low_watermark=8) as link:
        mgr = manager(num_blocks=state().engine().num_blocks, block_size=BS)
        pool = mgr.block_pool
        assert not hooked(mgr) and pool.demand.manager is None
        held = link.pool.num_slabs
        long = request("long", list(range(48 * BS)))
        blocks, _ = admit(mgr, long)                         # 48 blocks: slabs of 8, on demand
        assert blocks is not None and link.pool.num_slabs >= held + 5
        assert pool.heard >= 1 and pool.demands >= 1
        assert pool.demand.manager is mgr and hooked(mgr)    # the lookup put the hooks on this manager
        assert KVCacheManager.allocate_slots is stock_allocate_slots
        demand.stop_hearing(pool.demand)                     # the end of schedule()
        assert pool.demand.manager is None and not hooked(mgr)
        mgr.free(long)


def test_an_unheard_check_grows_the_pool_to_a_running_requests_most_first(daemon):
    with elastic(daemon.socket, low_watermark=8) as link:
        mgr = manager(num_blocks=state().engine().num_blocks, block_size=BS)
        pool = mgr.block_pool
        pool.call_blocks = 24                  # a step's tokens and a straddled block (the scheduler's figure)
        taken = drain(pool)
        pool.refresh()                         # a step starts: short below max(reserve, call_blocks)
        assert pool.may_grow and pool.short_below == 24
        asked = pool.demands
        free = pool.get_num_free_blocks()      # a running request's check: no need heard
        assert pool.demands == asked + 1 and pool.core.num_free >= 24 and free >= 24
        assert link.pool.num_slabs * 8 >= len(taken) + 24
        pool.free_blocks(taken)


def test_a_refused_demand_stops_asking_and_hearing_for_the_back_off(daemon_factory, monkeypatch):
    from kvelastic_vllm import block_pool

    # The back-off, long enough that a loaded machine stays within it between two steps.
    monkeypatch.setattr(block_pool, "REFUSAL_BACKOFF", 60.0)
    daemon = daemon_factory(memory="8MiB")           # 4 slabs of 2 MiB
    other = EngineClient(SlabPool(8), socket_path=daemon.socket, engine_id="other", namespace="other",
                         page_size=PAGE, pages_per_worker=1, num_workers=0, block_bytes=PAGE // 8,
                         min_bytes=3 * PAGE, max_bytes=3 * PAGE).start()
    try:
        assert other.ensure(3 * 8, timeout=30)       # 3 slabs: only one is left
        with other.lock:                              # in use: an idle engine's empty slabs would go back
            other.pool.allocate(other.pool.num_free)
        with elastic(daemon.socket, low_watermark=0) as link:
            mgr = manager(num_blocks=state().engine().num_blocks, block_size=BS)
            pool = mgr.block_pool
            assert link.client.can_grow()            # its cap is the daemon's 4 slabs; it holds 1
            pool.call_blocks = 4
            taken = drain(pool)
            pool.refresh()
            assert pool.get_num_free_blocks() == 0   # it asked; the daemon had nothing to give
            assert (pool.demands, pool.refused_demands) == (1, 1)
            assert not pool.may_grow and pool.short_below == 0
            pool.refresh()                           # the next step, within the back-off
            assert pool.get_num_free_blocks() == 0 and pool.demands == 1   # one comparison, no round trip
            mgr.get_computed_blocks(request("next", list(range(4 * BS))))
            assert pool.demand.manager is None and not hooked(mgr)        # nothing to hear either
            pool.free_blocks(taken)
    finally:
        other.close()
