"""Demand (``kvelastic_vllm/demand.py``): which of vLLM's capacity checks the
block pool hears, and what it asks the daemon for, with a real daemon and
vLLM's own KVCacheManager."""

import dis
import sys

import pytest

pytest.importorskip("vllm")

from kvelastic.client.engine import EngineClient
from kvelastic.core.pool import SlabPool
from kvelastic_vllm import demand
from kvelastic_vllm.bench.vllm_pool import PAGE, admit, elastic, manager, request
from kvelastic_vllm.state import state

pytestmark = pytest.mark.vllm
BS = 16


def hooked(mgr) -> bool:
    """The manager and its coordinator hear (``demand.hear``: a hearing subclass of vLLM's class)."""
    hearing = set(demand._HEARING.values())
    return type(mgr) in hearing and type(mgr.coordinator) in hearing


def drain(pool) -> list:
    """Take every free block (as running requests would)."""
    return pool.get_new_blocks(pool.core.num_free)


def test_an_admission_is_heard_until_the_steps_end_and_vllms_classes_stay_stock(daemon):
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    stock_allocate_slots = KVCacheManager.allocate_slots
    with elastic(daemon.socket, low_watermark=8) as link:
        mgr = manager(num_blocks=state().engine().num_blocks, block_size=BS)
        pool = mgr.block_pool
        assert not hooked(mgr) and pool.hearing is None
        held = link.pool.num_slabs
        long = request("long", list(range(48 * BS)))
        blocks, _ = admit(mgr, long)                         # 48 blocks: slabs of 8, on demand
        assert blocks is not None and link.pool.num_slabs >= held + 5
        assert pool.heard >= 1 and pool.demands >= 1
        assert pool.hearing is mgr and hooked(mgr)           # the lookup put the hooks on this manager
        assert KVCacheManager.allocate_slots is stock_allocate_slots
        demand.stop_hearing(pool)                            # the end of schedule()
        assert pool.hearing is None and not hooked(mgr)
        assert type(mgr) is KVCacheManager and "allocate_slots" not in vars(mgr)
        mgr.free(long)


def _specialized(site) -> bool:
    """Whether CPython specialized ``site``'s lookup of ``allocate_slots``."""
    ops = [i.opname for i in dis.get_instructions(site, adaptive=True) if i.argval == "allocate_slots"]
    return bool(ops) and ops[0] not in ("LOAD_METHOD", "LOAD_METHOD_ADAPTIVE", "LOAD_ATTR", "LOAD_ATTR_ADAPTIVE")


@pytest.mark.skipif(sys.version_info < (3, 11), reason="an interpreter that specializes its lookups")
def test_hearing_leaves_vllms_lookups_of_the_managers_methods_specialized(daemon):
    """An instance attribute named like a method (the hooks' first form), even
    deleted at once, stays in the instances' shared keys: every later call of
    ``allocate_slots`` on a manager missed CPython's specialized lookup, 256
    times a step at a batch of 256 (docs/benchmarks.md)."""
    with elastic(daemon.socket, low_watermark=8):
        mgr = manager(num_blocks=state().engine().num_blocks, block_size=BS)

        def site(m) -> None:   # vLLM's call sites, e.g. Scheduler.schedule's
            try:
                m.allocate_slots()
            except TypeError:   # the lookup is what counts here, not the call
                pass

        for _ in range(64):
            site(mgr)
        assert _specialized(site)
        demand.hear(mgr, mgr.block_pool)
        site(mgr)
        demand.stop_hearing(mgr.block_pool)
        for _ in range(256):
            site(mgr)
        assert _specialized(site)


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


def test_a_refused_demand_stops_asking_and_hearing_for_the_back_off(daemon_factory):
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
            assert pool.hearing is None and not hooked(mgr)               # nothing to hear either
            pool.free_blocks(taken)
    finally:
        other.close()
