"""What an engine's pool answers the daemon with, in the protocol's terms:
its keys on the wire, the slabs a reclaim takes back (and the cached blocks
they carry on to a replica), and a namespace of its own after its weights
changed. Pure functions of the pool: the client calls them under its lock,
and the simulator's engines call the same ones."""

from __future__ import annotations

import secrets

import msgspec

from kvelastic import protocol as p
from kvelastic.core.pool import SlabPool
from kvelastic.errors import PoolError


def wire_key(key) -> bytes:
    """Prefix-cache keys travel as bytes (vLLM's already are)."""
    return key if type(key) is bytes else msgspec.msgpack.encode(key)


def give_up(pool: SlabPool, slab_ids: list[int]) -> tuple[list[int], list[int], dict[int, list[p.CachedBlock]]]:
    """Answer a reclaim: take each slab back from ``pool`` if it can go.
    Returns (given, refused, cached): a slab whose block turned live
    meanwhile, or that the pool does not hold, is refused; ``cached`` holds
    the given slabs' cached blocks as they were (oldest first), which the
    daemon hands on with the pages to an engine of the same namespace."""
    entries = pool.cached_entries(slab_ids)
    given, refused = [], []
    cached: dict[int, list[p.CachedBlock]] = {}
    for slab_id in slab_ids:
        try:
            pool.take_slab_back(slab_id, reason="reclaim")
        except PoolError:
            refused.append(slab_id)
            continue
        given.append(slab_id)
        if entries.get(slab_id):
            cached[slab_id] = [p.CachedBlock(offset, wire_key(key), label)
                               for offset, key, label in entries[slab_id]]
    return given, refused, cached


def private_namespace(namespace: str) -> str:
    """A namespace nobody else has: ``namespace`` with a random suffix
    (128 bits), within the protocol's 128 characters."""
    return f"{namespace[:95]}~{secrets.token_hex(16)}"
