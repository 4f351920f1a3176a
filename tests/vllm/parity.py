"""Stock vLLM beside kvelastic on vLLM's own KVCacheManager and Scheduler.

Helpers for the parity tests: the same request stream goes to a stock
``BlockPool`` and to ``ElasticBlockPool`` (a real engine registered with a
real daemon, the plugin's scheduler-side patches installed, the production
reserve watermark), and the tests compare what vLLM observes.
"""

from __future__ import annotations

import contextlib
import itertools

import torch

from kvelastic_tools.vllm_bench.vllm_pool import PAGE, admit, elastic, manager, request  # noqa: F401

BS = 16
_ids = itertools.count()


def cold_daemon(tmp_path_factory, memory: str):
    """A module's daemon that keeps no cache between examples (each engine starts cold, as stock does)."""
    from tests.daemon_proc import DaemonProcess

    proc = DaemonProcess(tmp_path_factory.mktemp("daemon"), memory=memory, KVELASTIC_ORPHAN_CACHE_TTL="0").start()
    yield proc
    proc.stop()


def engine_blocks() -> int:
    from kvelastic_vllm.state import state

    return state().engine().num_blocks


@contextlib.contextmanager
def elastic_engine(socket_path: str, slabs: int, blocks_per_slab: int, max_num_batched_tokens: int = 64):
    """An engine of ``slabs * blocks_per_slab`` blocks of capacity (the same
    as a stock pool of that many blocks), watermark as in production."""
    from kvelastic_vllm.engine import reserve_watermark

    low = reserve_watermark(max_num_batched_tokens, BS, blocks_per_slab)
    with elastic(socket_path, blocks_per_slab=blocks_per_slab, engine_id=f"parity-{next(_ids)}",
                 low_watermark=low, max_bytes=slabs * PAGE) as link:
        yield link


def scheduler(model_path: str, num_blocks: int, max_num_batched_tokens: int = 64, max_num_seqs: int = 8):
    """vLLM's Scheduler over ``num_blocks`` blocks (ElasticBlockPool inside ``elastic_engine``)."""
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    init_none_hash(sha256)
    config = VllmConfig(
        model_config=ModelConfig(model=model_path, dtype="float32", seed=0, max_model_len=1024,
                                 skip_tokenizer_init=True),
        scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                         max_model_len=1024, is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=BS, cache_dtype="auto", enable_prefix_caching=True))
    config.cache_config.num_gpu_blocks = num_blocks
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32)
    kv = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                       kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    return Scheduler(vllm_config=config, kv_cache_config=kv, structured_output_manager=StructuredOutputManager(config),
                     block_size=BS, log_stats=True)


def step(sched, token: int = 7):
    """One engine step: schedule, then report one sampled token for every
    request whose prompt is done (what the model runner would)."""
    from vllm.v1.outputs import ModelRunnerOutput

    out = sched.schedule()
    req_ids = list(out.num_scheduled_tokens)
    sampled = []
    for rid in req_ids:  # schedule() already advanced num_computed_tokens
        req = sched.requests[rid]
        sampled.append([token] if req.num_computed_tokens >= req.num_tokens else [])
    sched.update_from_output(out, ModelRunnerOutput(
        req_ids=req_ids, req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
        sampled_token_ids=sampled, logprobs=None, prompt_logprobs_dict={}, pooler_output=[]))
    return out
