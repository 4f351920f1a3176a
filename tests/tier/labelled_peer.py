"""``tests/daemon/peer.py`` whose cached keys carry labels, as the vLLM plugin's
do (``block_pool.py``): each key's own one-block ``BlockStored`` (vLLM's hash
as vLLM publishes it by default, the low 64 bits; its parent; its token ids).
Run with ``vllm_keys``: a key is ``sha256(f"{prefix}-{i}")`` and a 4-byte group
id, and block ``i`` of a prefix holds ``tokens(prefix)[i * BLOCK_TOKENS:][:BLOCK_TOKENS]``."""

from __future__ import annotations

import hashlib

import msgspec

from kvelastic.core.pool import SlabPool
from kvelastic.kv_events import BlockStored

BLOCK_TOKENS = 4


def tokens(prefix: str, n: int) -> list[int]:
    """The prompt whose blocks a prefix's keys stand for: ``n`` blocks of it."""
    seed = hashlib.sha256(prefix.encode()).digest()
    return [1000 + (seed[i % 32] + 7 * i) % 20000 for i in range(n * BLOCK_TOKENS)]


def published(key: bytes) -> int:
    """A key's hash as vLLM publishes it: the low 64 bits, less the group id."""
    return int.from_bytes(key[:-4], "big") & ((1 << 64) - 1)


def label(prefix: str, i: int, keys: list[bytes]) -> bytes:
    return msgspec.msgpack.encode(BlockStored(
        block_hashes=[published(keys[i])], parent_block_hash=published(keys[i - 1]) if i else None,
        token_ids=tokens(prefix, i + 1)[i * BLOCK_TOKENS:], block_size=BLOCK_TOKENS, lora_id=None, medium="GPU",
        lora_name=None, group_idx=0))


def _labelled_cache(cache):
    """``SlabPool.cache`` giving the peer's keys (``sha256(f"{prefix}-{i}")``,
    ``i`` from 0) their labels."""
    def wrapped(self, blocks, keys, num_tokens=None, labels=None):
        if labels is None:
            keys = list(keys)
            labels = []
            for i, key in enumerate(keys):
                prefix = _prefix_of(key, i)
                labels.append(label(prefix, i, keys) if prefix is not None else b"")
        return cache(self, blocks, keys, num_tokens, labels)

    return wrapped


KNOWN_PREFIXES = ("sys", "new", "chat")


def _prefix_of(key: bytes, i: int) -> str | None:
    for prefix in KNOWN_PREFIXES:
        if hashlib.sha256(f"{prefix}-{i}".encode()).digest() == key[:-4]:
            return prefix
    return None


if __name__ == "__main__":
    SlabPool.cache = _labelled_cache(SlabPool.cache)  # type: ignore[method-assign]
    from tests.daemon import peer

    peer.main()
