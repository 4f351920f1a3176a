"""KV events, in vLLM's wire format.

Same names, fields and encoding as ``vllm.distributed.kv_events``, so a
router decodes the daemon's stream with vLLM's own classes. Published on a
ZMQ PUB socket as (topic, 8-byte big-endian sequence number, msgpack
``KVEventBatch``), with vLLM's replay protocol on a ROUTER socket; topic
``kv@ENGINE@NAMESPACE``. The daemon publishes them (``daemon/events.py``), and
the plugin packs a cached key's label as a ``BlockStored`` (``block_pool.py``)."""

from __future__ import annotations

import msgspec


class KVCacheEvent(msgspec.Struct, omit_defaults=True, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    group_idx: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


def kv_events_topic(engine_id: str, namespace: str) -> bytes:
    return f"kv@{engine_id}@{namespace}".encode()
