"""What an engine's pool answers the daemon with, in the protocol's terms:
its keys on the wire, its journal as frames, the slabs a reclaim or a
return takes back (with the cached blocks they carry on to a replica, and
the ones whose pages may go while a step runs), and a namespace of its
own after its weights changed. Pure functions of the pool: the client calls them under its lock,
and the simulator's engines call the same ones."""

from __future__ import annotations

import secrets

import msgspec

from kvelastic import protocol as p
from kvelastic.core.journal import REMOVE, STORE, JournalBatch
from kvelastic.core.pool import SlabPool
from kvelastic.errors import PoolError


def wire_key(key) -> bytes:
    """Prefix-cache keys travel as bytes (vLLM's already are)."""
    return key if type(key) is bytes else msgspec.msgpack.encode(key)


JOURNAL_MAX_OPS = 20000       # ops a frame: the daemon takes a long journal in parts


def journal_frames(engine_id: str, batch: JournalBatch, counters: dict[str, int], *, bytes_keys: bool,
                   tier_ack: int, scope: int) -> list[p.JournalFrame]:
    """``batch`` as the frames the lifeline carries: the occupancy, counters
    and tier ticket on the last. The core's op tuples are their wire form
    once keys are bytes (vLLM's are): shipped as they stand, no object per op."""
    ops = batch.ops if bytes_keys else [
        (op[0], wire_key(op[1]), op[2]) if op[0] in (STORE, REMOVE) else op for op in batch.ops]
    frames = []
    for start in range(0, max(len(ops), 1), JOURNAL_MAX_OPS):
        chunk = ops if len(ops) <= JOURNAL_MAX_OPS else ops[start:start + JOURNAL_MAX_OPS]
        last = start + JOURNAL_MAX_OPS >= len(ops)
        frames.append(p.JournalFrame(engine_id=engine_id, ops=chunk, occupancy=batch.occupancy if last else {},
                                     stats=counters if last else {}, tier_ack=tier_ack if last else 0,
                                     scope=scope))
    return frames


def give_up(pool: SlabPool, engine_id: str, msg: p.Reclaim) -> p.ReclaimDone:
    """Answer a reclaim: take each slab back from ``pool`` if it can go. A
    slab whose block turned live meanwhile, or that the pool does not hold,
    is refused; ``cached`` holds the given slabs' cached blocks as they were
    (oldest first), which the daemon hands on with the pages to an engine of
    the same namespace; ``settled``, those no step can still write (read
    before they go: the pool forgets a slab it gave back)."""
    entries = pool.cached_entries(msg.slabs)
    settled = set(pool.settled(msg.slabs))
    given, refused = [], []
    cached: dict[int, list[p.CachedBlock]] = {}
    for slab_id in msg.slabs:
        try:
            pool.take_slab_back(slab_id, reason="reclaim")
        except PoolError:
            refused.append(slab_id)
            continue
        given.append(slab_id)
        if entries.get(slab_id):
            cached[slab_id] = [p.CachedBlock(offset, wire_key(key), label)
                               for offset, key, label in entries[slab_id]]
    return p.ReclaimDone(req_id=msg.req_id, engine_id=engine_id, given=given, refused=refused, cached=cached,
                         settled=[s for s in given if s in settled])


def hand_back(pool: SlabPool, engine_id: str, slab_ids: list[int]) -> p.Return:
    """Return slabs the pool may let go of (idle, or drained: no block
    live), with the ones no step can still write."""
    settled = pool.settled(slab_ids)
    for slab_id in slab_ids:
        pool.take_slab_back(slab_id, reason="return")
    return p.Return(engine_id=engine_id, slabs=slab_ids, settled=settled)


def private_namespace(namespace: str) -> str:
    """A namespace nobody else has: ``namespace`` with a random suffix
    (128 bits), within the protocol's 128 characters."""
    return f"{namespace[:95]}~{secrets.token_hex(16)}"
