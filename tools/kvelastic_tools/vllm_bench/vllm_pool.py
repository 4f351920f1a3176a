"""vLLM's own KVCacheManager over a stock BlockPool or over ElasticBlockPool
(registered with a real daemon), for the vLLM behaviour tests and `kvelastic bench vllm`."""

from __future__ import annotations

import contextlib

import torch

from kvelastic.client.engine import EngineClient
from kvelastic.core.pool import SlabPool
from kvelastic.vmm.base import DEFAULT_PAGE_SIZE as PAGE


def kv_config(num_blocks: int, block_size: int, groups: int = 1):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec([f"layer{g}"], spec) for g in range(groups)])


def manager(num_blocks: int, block_size: int = 16, groups: int = 1, events: bool = False, metrics_collector=None):
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import init_none_hash

    init_none_hash(sha256)
    return KVCacheManager(kv_config(num_blocks, block_size, groups), max_model_len=8192,
                          scheduler_block_size=block_size, hash_block_size=block_size, enable_caching=True,
                          log_stats=True, enable_kv_cache_events=events, metrics_collector=metrics_collector)


@contextlib.contextmanager
def elastic(socket_path: str, blocks_per_slab: int = 8, engine_id: str = "test-engine", namespace: str = "test",
            **client_kw):
    """Inside: KVCacheManagers and Schedulers built here run with the plugin's
    scheduler-side patches (ElasticBlockPool, ...) on a registered engine."""
    from kvelastic_vllm import engine, install_scheduler_patches, restore
    from kvelastic_vllm.state import state

    pool = SlabPool(blocks_per_slab)
    low = client_kw.pop("low_watermark", 0)
    client = EngineClient(pool, socket_path=socket_path, engine_id=engine_id, namespace=namespace,
                          page_size=PAGE, pages_per_worker=1, num_workers=0,
                          block_bytes=PAGE // blocks_per_slab, low_watermark=0, **client_kw).start()
    plugin = state()
    link = engine.attach(plugin, client, engine.Geometry(PAGE // blocks_per_slab, 1, blocks_per_slab,
                                                         PAGE // blocks_per_slab), low)
    replaced = install_scheduler_patches()
    try:
        yield link
    finally:
        restore(replaced)
        plugin.detach()
        client.close()


def request(request_id: str, tokens: list[int], block_size: int = 16, max_tokens: int = 16):
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    return Request(request_id, tokens, SamplingParams(max_tokens=max_tokens), None,
                   block_hasher=get_request_block_hasher(block_size, sha256))


def admit(mgr, req):
    """What the scheduler does for a waiting request: look up, then allocate."""
    computed, num_computed = mgr.get_computed_blocks(req)[:2]
    blocks = mgr.allocate_slots(req, req.num_tokens - num_computed, num_computed, computed)
    if blocks is not None:
        mgr.record_prefix_cache_stats(req, num_computed)
    return blocks, num_computed
