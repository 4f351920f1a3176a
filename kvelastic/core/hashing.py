"""Chained block hashes for prefix caching: ``h_i = H(h_{i-1}, tokens_i, extra)``.

Stable across processes and machines (never Python's ``hash()``): the chain
starts from a digest of a fixed seed, tokens are encoded as little-endian
int64s, and ``extra`` (LoRA name, tenant salt, multimodal ids...) as msgpack.
SHA-256 is the default; xxh3-128 is the fast option where collision
resistance against adversarial prompts is not needed (pair it with the
pool's ``verify_tokens``).
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence
from typing import Any

import msgspec
import xxhash

ALGORITHMS = ("sha256", "xxh3_128")
DEFAULT_SEED = b"kvelastic-block-hash-v1"


class BlockHasher:
    def __init__(self, algorithm: str = "sha256", seed: bytes = DEFAULT_SEED) -> None:
        if algorithm not in ALGORITHMS:
            raise ValueError(f"unknown hash algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}")
        self.algorithm = algorithm
        self._digest = self._sha256 if algorithm == "sha256" else self._xxh3
        self.root = self._digest(seed)

    @staticmethod
    def _sha256(data: bytes) -> bytes:
        return hashlib.sha256(data).digest()

    @staticmethod
    def _xxh3(data: bytes) -> bytes:
        return xxhash.xxh3_128_digest(data)

    def hash_block(self, parent: bytes | None, tokens: Sequence[int], extra: Any = None) -> bytes:
        body = array("q", tokens)
        if sys.byteorder == "big":
            body.byteswap()  # keep the little-endian form, so hashes match across hosts
        payload = (parent or self.root) + len(tokens).to_bytes(4, "little") + body.tobytes()
        if extra is not None:
            payload += msgspec.msgpack.encode(extra)
        return self._digest(payload)

    def hash_tokens(self, tokens: Sequence[int], block_size: int, extra: Any = None,
                    parent: bytes | None = None) -> list[bytes]:
        """Hashes of every *full* block of ``tokens``; a trailing partial block has none."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        hashes: list[bytes] = []
        for start in range(0, len(tokens) - block_size + 1, block_size):
            parent = self.hash_block(parent, tokens[start:start + block_size], extra)
            hashes.append(parent)
        return hashes
