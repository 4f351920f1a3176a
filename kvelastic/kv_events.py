"""KV events, in vLLM's wire format.

Same names, fields and encoding as ``vllm.distributed.kv_events``, so a
router decodes the daemon's stream with vLLM's own classes. Published on a
ZMQ PUB socket as (topic, 8-byte big-endian sequence number, msgpack
``KVEventBatch``), with vLLM's replay protocol on a ROUTER socket; topic
``kv@ENGINE@NAMESPACE``. The daemon publishes them (``daemon/events.py``), and
the plugin packs a cached key's label as a ``BlockStored`` (``block_pool.py``).
Blocks in the node's tier are published under the pseudo-engine ``TIER_ENGINE``
(``""``: no engine id is empty) with the medium ``MEDIUM_STORAGE``."""

from __future__ import annotations

import msgspec


class KVCacheEvent(msgspec.Struct, omit_defaults=True, tag=True):
    pass


# A block's hash as vLLM publishes it: its bytes, or their low 64 bits
# (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, vLLM's default).
ExternalBlockHash = bytes | int


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    group_idx: int | None = None
    # vLLM's later fields (a label keeps them; an engine's own events omit them)
    extra_keys: list[object] | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


# vLLM's media (``vllm.distributed.kv_events``): device memory, host memory, disk.
MEDIUM_GPU, MEDIUM_CPU, MEDIUM_STORAGE = "GPU", "CPU", "STORAGE"
TIER_ENGINE = ""     # the pseudo-engine the node's tier blocks are published under

KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


def kv_events_topic(engine_id: str, namespace: str) -> bytes:
    return f"kv@{engine_id}@{namespace}".encode()


def tier_topic(namespace: str) -> bytes:
    """``kv@@NAMESPACE``: the tier's blocks of ``namespace`` (any engine of it may load them)."""
    return kv_events_topic(TIER_ENGINE, namespace)
