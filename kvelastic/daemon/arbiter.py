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
cache back and forth within a second, 145 times in a simulated day; so did
letting it through for an A below its fair share against a B above its
own: 62 to 382 moves back in the simulated day.) A within the hold-down
takes from others or evicts its own cache, and waits.

Fairness where nothing is free to take (``pick_drains``): an engine whose
hard demand has gone unmet for ``hold_down`` while it holds less than its
fair share (``fair_share``: the device's budget over the engines active on
it) asks the engines over theirs to drain slabs, the ones with fewest live blocks first
(``Drain``: they place nothing new there and give each back once its
running requests let go of it), never more than takes them to their share.
So an engine whose queue would take every block its finished requests free
cannot starve another that has requests waiting: the two end at their
shares, as a static split would have them, and the memory no one needs
stays elastic.
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


def fair_share(engines: list[EngineRecord], requester: EngineRecord, budget_bytes: int, now: float,
               rules: Rules) -> int:
    """Bytes each engine active on the requester's device is due: the
    device's budget split evenly among them (the requester counts, idle
    engines do not: their memory is anyone's)."""
    active = sum(1 for e in engines if e.device == requester.device and not e.failed
                 and (e is requester or not is_idle(e, now, rules)))
    return budget_bytes // max(1, active)


def held_bytes(engine: EngineRecord) -> int:
    return engine.owned_slabs() * engine.slab_bytes


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


def pick_drains(engines: list[EngineRecord], requester: EngineRecord, slabs: int, fair: int,
                draining: dict[str, set[int]]) -> list[tuple[EngineRecord, list[int]]]:
    """Slabs to drain for a requester whose hard demand of ``slabs`` went
    unmet: none unless it holds less than ``fair``; then from the engines
    over ``fair`` on its device, largest excess first, each at most down to
    its share or its minimum (slabs already draining, in ``draining`` by
    engine, count as gone), the slabs with fewest live blocks first (they empty soonest)."""
    if held_bytes(requester) >= fair:
        return []
    need = min(slabs * requester.slab_bytes, fair - held_bytes(requester))
    over = []
    for engine in engines:
        if engine is requester or engine.device != requester.device or engine.failed:
            continue
        gone = draining.get(engine.engine_id, set())
        excess = held_bytes(engine) - len(gone) * engine.slab_bytes - max(fair, engine.min_bytes)
        if excess >= engine.slab_bytes:
            over.append((excess, engine.engine_id, engine, gone))
    out: list[tuple[EngineRecord, list[int]]] = []
    for excess, _eid, engine, gone in sorted(over, key=lambda o: (-o[0], o[1])):
        if need <= 0:
            break
        held = [(occ[0], -occ[2], slab_id) for slab_id, occ in engine.mirror.slabs.items()
                if slab_id not in gone and (slab := engine.slabs.get(slab_id)) is not None
                and slab.phase is Phase.HELD]
        n = min(excess // engine.slab_bytes, -(-need // engine.slab_bytes), len(held))
        if n <= 0:
            continue
        chosen = [slab_id for _live, _free, slab_id in heapq.nsmallest(n, held)]
        out.append((engine, chosen))
        need -= n * engine.slab_bytes
    return out
