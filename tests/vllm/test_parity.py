"""ElasticBlockPool answers vLLM as vLLM's own BlockPool does, with several
slabs per engine: vLLM's KVCacheManager and Scheduler, the plugin's
scheduler-side patches, the production reserve watermark, a real daemon.

Stock and elastic pools get the same request streams at the same capacity
(``slabs * blocks_per_slab`` blocks) and must give the same admissions, no
fewer prefix hits, and the same counters vLLM reports.
"""


import pytest

pytest.importorskip("vllm")

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvelastic_tools.vllm_bench.tinymodel import build_tiny_llama
from tests.vllm.parity import BS, admit, cold_daemon, elastic_engine, engine_blocks, manager, request, scheduler, step

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    yield from cold_daemon(tmp_path_factory, "256MiB")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return str(build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama"))


def tokens(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 30000 + 1 for i in range(n)]


# ------------------------------------------------------------ admission
def test_a_prompt_larger_than_the_reserve_is_admitted_at_once(daemon):
    # 128 blocks of capacity in 16 slabs; the reserve is 12 blocks; a 64-block
    # prompt must fit as a whole (vLLM's full_sequence_must_fit admission).
    with elastic_engine(daemon.socket, slabs=16, blocks_per_slab=8) as link:
        mgr = manager(num_blocks=engine_blocks(), block_size=BS)
        req = request("long", tokens(1, 64 * BS))
        computed, hit = mgr.get_computed_blocks(req)[:2]
        blocks = mgr.allocate_slots(req, req.num_tokens - hit, hit, computed, full_sequence_must_fit=True)
        assert blocks is not None and len(blocks.blocks[0]) == 64
        assert link.pool.num_slabs >= 8                  # fetched on demand, not only the reserve


def test_a_prompt_larger_than_the_engine_is_refused_as_stock_refuses_it(daemon):
    stock = manager(num_blocks=32, block_size=BS)
    with elastic_engine(daemon.socket, slabs=4, blocks_per_slab=8):
        mgr = manager(num_blocks=engine_blocks(), block_size=BS)
        for m in (stock, mgr):
            req = request("huge", tokens(2, 40 * BS))
            computed, hit = m.get_computed_blocks(req)[:2]
            assert m.allocate_slots(req, req.num_tokens - hit, hit, computed, full_sequence_must_fit=True) is None


def test_cached_prefixes_survive_while_the_daemon_has_memory(daemon):
    # Capacity 64 in 8-block slabs, a reserve of 8: a cached 12-block prompt
    # must not be evicted to make room for a 20-block one.
    def run(mgr):
        first = request("a", tokens(3, 12 * BS))
        admit(mgr, first)
        mgr.free(first)
        second = request("b", tokens(4, 20 * BS))
        assert admit(mgr, second)[0] is not None
        return mgr.get_computed_blocks(request("a2", tokens(3, 12 * BS) + [5]))[1]

    stock = run(manager(num_blocks=64, block_size=BS))
    with elastic_engine(daemon.socket, slabs=8, blocks_per_slab=8, max_num_batched_tokens=0):
        elastic = run(manager(num_blocks=engine_blocks(), block_size=BS))
    assert stock == 12 * BS and elastic == stock


# --------------------------------------------------- counters vLLM reads
def test_cache_creation_tokens_match_stock(daemon):
    def run(mgr):
        req = request("a", tokens(5, 3 * BS + 5))
        admit(mgr, req)
        return mgr.estimate_cached_tokens(req)

    stock = run(manager(num_blocks=64, block_size=BS))
    with elastic_engine(daemon.socket, slabs=8, blocks_per_slab=8):
        elastic = run(manager(num_blocks=engine_blocks(), block_size=BS))
    assert stock == 3 * BS and elastic == stock


def test_residency_metrics_see_the_same_evictions_and_resets_as_stock(daemon):
    from vllm.v1.core.kv_cache_metrics import KVCacheMetricsCollector

    def run(num_blocks):
        collector = KVCacheMetricsCollector(sample_rate=1.0)
        mgr = manager(num_blocks=num_blocks, block_size=BS, metrics_collector=collector)
        first = request("a", tokens(6, 4 * BS))
        admit(mgr, first)
        mgr.free(first)                              # 4 cached blocks
        second = request("b", tokens(7, 7 * BS))     # 3 never-used blocks + 4 evicted
        admit(mgr, second)
        evicted = len(collector.drain_events())
        mgr.free(second)
        assert collector.block_metrics               # blocks still sampled before the reset
        assert mgr.reset_prefix_cache()
        return evicted, len(collector.block_metrics)

    stock = run(8)
    with elastic_engine(daemon.socket, slabs=1, blocks_per_slab=8):
        elastic = run(engine_blocks())
    assert stock == (4, 0) and elastic == stock


# ------------------------------------------------ the scheduler, per step
FRESH_SCHEDULERS = 30


def test_grants_are_usable_in_the_step_they_arrive_in(daemon, tiny_model):
    # Over many fresh schedulers (the reserve grow of a new engine still in
    # flight at the first step): a 6-block prompt on a 10-block engine is
    # admitted at the first step, and a 10-block request growing into the
    # last free block is never preempted, exactly as on stock vLLM.
    def first_step_admits(sched):
        sched.add_request(request("six", tokens(8, 6 * BS)))
        return [r.req_id for r in step(sched).scheduled_new_reqs] == ["six"]

    def preemptions(sched):
        req = request("grows", tokens(9, 10 * BS - 2), max_tokens=6)   # 10 blocks, then an 11th
        sched.add_request(req)
        for _ in range(12):
            step(sched)
        return req.num_preemptions, req.num_output_tokens

    assert first_step_admits(scheduler(tiny_model, 12))
    assert preemptions(scheduler(tiny_model, 12)) == (0, 6)
    admitted = preempted = 0
    for _ in range(FRESH_SCHEDULERS):
        with elastic_engine(daemon.socket, slabs=6, blocks_per_slab=2):
            admitted += first_step_admits(scheduler(tiny_model, engine_blocks()))
        with elastic_engine(daemon.socket, slabs=6, blocks_per_slab=2):
            got, out = preemptions(scheduler(tiny_model, engine_blocks()))
            assert out == 6
            preempted += got > 0
    assert (admitted, preempted) == (FRESH_SCHEDULERS, 0)


# ------------------------------------------- randomized stock comparison
CAPACITY_SLABS, BPS = 6, 4          # 24 blocks: 23 usable beside the null block

request_spec = st.tuples(st.integers(0, 3), st.integers(0, 4), st.integers(0, 2 * BS), st.booleans())


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(st.lists(request_spec, min_size=4, max_size=30), st.integers(1, 3))
def test_random_streams_hit_no_less_than_stock_and_admit_what_stock_admits(daemon, stream, live_cap):
    # Shared prefixes of 0-4 blocks plus a unique tail; at most live_cap
    # requests live at once (the peak fits: 3 x 7 blocks <= 23); "finish"
    # frees a request at once, else the oldest goes when the cap is reached.
    prefixes = [tokens(100 + i, 4 * BS) for i in range(4)]

    def run(mgr):
        hits, live = [], []
        for i, (which, prefix_blocks, tail, finish) in enumerate(stream):
            req = request(str(i), prefixes[which][:prefix_blocks * BS] + tokens(1000 + i, tail + 1))
            blocks, hit = admit(mgr, req)
            assert blocks is not None, f"request {i} was not admitted"
            hits.append(hit)
            live.append(req)
            if finish or len(live) >= live_cap:
                mgr.free(live.pop(0))
        return hits

    stock = run(manager(num_blocks=CAPACITY_SLABS * BPS, block_size=BS))
    with elastic_engine(daemon.socket, slabs=CAPACITY_SLABS, blocks_per_slab=BPS):
        elastic = run(manager(num_blocks=engine_blocks(), block_size=BS))
    assert all(e >= s for e, s in zip(elastic, stock)), (stock, elastic)


# A request: (arrival step, shared prefix, its length in blocks, unique tail tokens, tokens to generate).
scheduled_spec = st.tuples(st.integers(0, 6), st.integers(0, 2), st.integers(0, 3), st.integers(1, 40),
                           st.integers(1, 8))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(st.lists(scheduled_spec, min_size=1, max_size=8))
def test_random_streams_through_the_scheduler_admit_and_hit_as_stock(daemon, tiny_model, stream):
    # The peak fits (8 requests of at most 6 blocks in 63), so stock never
    # evicts: every request must be admitted at the same step with the same
    # prefix hit as stock, and finish with no preemption. Steps are small
    # (64 tokens), so admissions queue and the engine grows while serving.
    prefixes = [tokens(200 + i, 3 * BS) for i in range(3)]

    def run(sched):
        admitted, reqs = {}, {}
        for t in range(80):
            for i, (at, which, prefix_blocks, tail, out_tokens) in enumerate(stream):
                if at == t:
                    reqs[i] = request(str(i), prefixes[which][:prefix_blocks * BS] + tokens(3000 + i, tail),
                                      max_tokens=out_tokens)
                    sched.add_request(reqs[i])
            for new in step(sched).scheduled_new_reqs:
                admitted.setdefault(new.req_id, (t, new.num_computed_tokens))
            if len(reqs) == len(stream) and not sched.get_num_unfinished_requests():
                break
        return admitted, [(r.num_output_tokens, r.num_preemptions) for r in reqs.values()]

    stock = run(scheduler(tiny_model, 64))
    with elastic_engine(daemon.socket, slabs=16, blocks_per_slab=4):
        elastic = run(scheduler(tiny_model, engine_blocks()))
    assert len(stock[0]) == len(stream) and all(p == 0 for _, p in stock[1])
    assert elastic == stock
