"""An engine's journal as the daemon takes it in: checked whole, then
applied to the engine's record (its mirror, counters and activity). No I/O;
the allocator publishes the KV events a journal sets off.

A journal may name only slabs granted to its engine (held, or on their way
back), never one being mapped for it, so the mirror stays as large as what
the engine holds, whatever a client sends.
"""

from __future__ import annotations

from kvelastic import protocol as p
from kvelastic.core.journal import JournalBatch, Op
from kvelastic.core.stats import COUNTER_NAMES
from kvelastic.daemon.rejected import Rejected
from kvelastic.daemon.state import EngineRecord, Phase

BLOCK_OPS = (p.StoreKey, p.RemoveKey, p.DemoteBlock, p.PromoteBlock)


def may_name(engine: EngineRecord, slab_id: int) -> bool:
    """A slab granted to the engine (held, or on its way back)."""
    slab = engine.slabs.get(slab_id)
    return slab is not None and slab.phase is not Phase.MAPPING


def check_blocks(engine: EngineRecord, m: p.Journal) -> None:
    """Decoding checked every op's shape and types; what is left to check
    whole, before anything is applied, is that they name granted slabs."""
    for op in m.ops:
        slab_id = op.block // engine.blocks_per_slab if isinstance(op, BLOCK_OPS) else \
            op.slab if isinstance(op, (p.AddSlab, p.RemoveSlab)) else None
        if slab_id is not None and not may_name(engine, slab_id):
            raise Rejected(p.Reason.BAD_JOURNAL, f"{type(op).__name__} names slab {slab_id}, which engine "
                                                 f"{engine.engine_id} does not hold")


def accept(engine: EngineRecord, m: p.Journal, now: float) -> None:
    """Check ``m`` whole (``Rejected``, nothing changed), then apply it."""
    check_blocks(engine, m)
    unknown = set(m.stats) - COUNTER_NAMES
    if unknown:
        raise Rejected(p.Reason.BAD_JOURNAL, f"unknown counters {sorted(unknown)[:3]}")
    for slab_id, occ in m.occupancy.items():
        if not may_name(engine, slab_id):
            raise Rejected(p.Reason.BAD_JOURNAL, f"occupancy of slab {slab_id}, which engine "
                                                 f"{engine.engine_id} does not hold")
        if len(occ) != 3 or sum(occ) != engine.blocks_per_slab or min(occ) < 0:
            raise Rejected(p.Reason.BAD_JOURNAL, f"slab {slab_id}: occupancy {occ} does not add up to "
                                                 f"{engine.blocks_per_slab} blocks")
    ops = [op.core() for op in m.ops]
    if m.stats.get("block_ops", engine.stats["block_ops"]) != engine.stats["block_ops"]:
        engine.touched(now)         # blocks allocated, touched or freed: not slabs coming and going
    engine.apply_journal(JournalBatch(ops, m.occupancy), now)
    engine.clears_heard = max(engine.clears_heard, min(m.scope, engine.clears_sent))
    engine.stats.update(m.stats)
    engine.last_seen = now


def accept_departed(engine: EngineRecord, m: p.Journal) -> None:
    """The journal of an engine the daemon dropped while its process may
    still run steps (one of its workers died first), on the connection it
    registered: its keys and steps still reach the mirror, so the cache kept
    once its slabs are unmapped leaves out a block such a step rewrote (its
    seal is answered). Nothing else of it counts any more."""
    check_blocks(engine, m)
    keys: list[Op] = [op.core() for op in m.ops if not isinstance(op, (p.AddSlab, p.RemoveSlab))]
    engine.mirror.apply(JournalBatch(keys, {}))
    engine.clears_heard = max(engine.clears_heard, min(m.scope, engine.clears_sent))
