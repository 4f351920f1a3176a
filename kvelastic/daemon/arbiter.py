"""Who gives up memory for whose demand: the reclaim order. No I/O, no clock.

Only a *demand* grow (the scheduler cannot admit or continue a request)
reclaims from other engines; a reserve refill never does. Candidates are
held slabs with no live block (by the daemon's mirror; the owner refuses a
slab that turned live meanwhile) on the requester's device, never taking an
engine below its guaranteed minimum. In this order (``Tier``):

1. empty slabs of idle engines (a reserve nobody uses);
2. empty slabs of active engines (their reserve);
3. cached slabs of idle engines, least recently used across the node;
4. cached slabs of active engines, least recently used, and only for *hard*
   demand: when the requester's own cached blocks cannot cover it. An engine
   that can meet its demand by evicting its own cache does so; moving another
   active engine's cache costs an unmap and a map on both sides for no gain.

(Free pages come before all of these: the allocator looks for them first.)

No ping-pong: memory moved from engine A to engine B is not taken back from
B for A within ``hold_down`` seconds, whatever A's demand. (Letting hard
demand through was tried: at node scale two starving engines then traded
cache back and forth within a second, 145 times in a simulated day.) A
within the hold-down takes from others or evicts its own cache, and waits.
"""

from __future__ import annotations

import dataclasses
import enum
import heapq

from kvelastic.daemon.state import EngineRecord, Phase


class Tier(enum.IntEnum):
    IDLE_EMPTY = 1
    ACTIVE_EMPTY = 2
    IDLE_CACHED = 3
    ACTIVE_CACHED = 4


@dataclasses.dataclass(frozen=True)
class Rules:
    idle_grace: float        # no activity for this long: idle
    hold_down: float         # no move back within this, unless hard demand


def is_idle(engine: EngineRecord, now: float, rules: Rules) -> bool:
    return now - engine.active_at >= rules.idle_grace


def is_hard(requester: EngineRecord, slabs: int) -> bool:
    """The requester cannot meet a demand of ``slabs`` by evicting its own cache."""
    cached = sum(occ[1] for occ in requester.mirror.slabs.values())
    return cached < slabs * requester.blocks_per_slab


def pick_victims(engines: list[EngineRecord], requester: EngineRecord, slabs: int, now: float,
                 rules: Rules, exclude: frozenset[tuple[str, int]] = frozenset()) -> list[tuple[EngineRecord, int]]:
    """Slabs to reclaim so that ``slabs`` of the requester's size come free
    (``exclude``: (engine, slab) pairs not to ask for: already asked, or not
    yet granted to their engine)."""
    hard = is_hard(requester, slabs)
    candidates = []
    owned: dict[str, int] = {}
    for engine in engines:
        if engine is requester or engine.device != requester.device or engine.failed:
            continue
        if now - engine.received_from.get(requester.engine_id, -1e18) < rules.hold_down:
            continue          # it got this memory from the requester moments ago
        idle = is_idle(engine, now, rules)
        owned[engine.engine_id] = engine.owned_slabs()
        eid, last_used, held = engine.engine_id, engine.active, engine.slabs
        for slab_id, (live, cached, _free) in engine.mirror.slabs.items():
            if live or (exclude and (eid, slab_id) in exclude):
                continue
            slab = held.get(slab_id)
            if slab is None or slab.phase is not Phase.HELD:
                continue
            if cached:
                if not idle and not hard:
                    continue
                tier = Tier.IDLE_CACHED if idle else Tier.ACTIVE_CACHED
            else:
                tier = Tier.IDLE_EMPTY if idle else Tier.ACTIVE_EMPTY
            candidates.append((tier, last_used.get(slab_id, 0.0), eid, slab_id, engine))
    # Usually a few victims out of thousands of slabs: a heap, not a sort.
    heapq.heapify(candidates)
    bytes_needed = slabs * requester.slab_bytes
    chosen: list[tuple[EngineRecord, int]] = []
    taken: dict[str, int] = {}
    freed = 0
    while candidates and freed < bytes_needed:
        _tier, _t, engine_id, slab_id, engine = heapq.heappop(candidates)
        owned_after = owned[engine_id] - taken.get(engine_id, 0) - 1
        if owned_after * engine.slab_bytes < engine.min_bytes:
            continue
        taken[engine_id] = taken.get(engine_id, 0) + 1
        chosen.append((engine, slab_id))
        freed += engine.slab_bytes
    return chosen
