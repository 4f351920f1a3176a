"""Engines' loads from the tier in the simulator (``tier.py``): a device
miss looks the rest of a prompt's keys up (``TierLookup``, mostly of a
prompt the tier holds a part of), and a lease granted is fetched block by
block, chunk by chunk (``TierFetch`` -> ``TierData``), released part-way
(``TierRelease``) or abandoned (left to its deadline). A block of another
layout of the namespace is not loaded (released, as the connector does).
``check`` ends the loads of engines that died, and of leases abandoned once
the daemon ended them.

They draw on the tier's ``random.Random`` (``SimTier.rng``), as they did
when they lived in ``tier.py``: its stream is unchanged.
"""

from __future__ import annotations

import collections
import dataclasses
import random
from typing import Any, Protocol

from kvelastic import protocol as p
from kvelastic.daemon import tiering
from kvelastic.tier.index import TierIndex
from kvelastic_tools.sim.engine import SimEngine

# Of leases granted: abandoned (left to expire), released part-way.
ABANDON, RELEASE = 0.08, 0.12


class LoadsWorld(Protocol):
    """What the loads use of the world (``tier.TierWorld`` and ``World`` fit it)."""

    @property
    def counts(self) -> collections.Counter[str]: ...

    @property
    def wires(self) -> dict[bytes, Any]: ...

    def violation(self, what: str) -> None: ...


@dataclasses.dataclass(eq=False)
class Load:
    """An engine's lookup and the lease it got: fetched block by block."""

    identity: bytes
    namespace: str                     # the engine's when it looked up
    keys: list[bytes]
    req: int                           # the request whose answer it waits for
    lease: int = 0
    nbytes: list[int] = dataclasses.field(default_factory=list)
    block: int = 0
    abandoned: bool = False


class TierLoads:
    def __init__(self, world: LoadsWorld, rng: random.Random) -> None:
        self.world = world
        self.rng = rng
        self.loads: dict[bytes, Load] = {}  # engine identity -> its load in flight

    def lookup(self, engine: SimEngine, index: TierIndex) -> None:
        """A device miss: the engine asks the tier for the rest of a prompt's keys."""
        if not engine.alive or not engine.registered or engine.dying or engine.leaving \
                or engine.identity in self.loads:
            return
        rng = self.rng
        held = sorted(index._keys.get(engine.namespace, {}))     # mostly a prompt the tier holds a part of
        if held and rng.random() < 0.7:
            _ns, prompt_s, first_s = rng.choice(held).decode().rsplit(":", 2)
            prompt, first = int(prompt_s), int(first_s)      # the prefix before it was on the device
        else:
            prompt, first = rng.randrange(12), 0
        keys = [engine.key(prompt, i) for i in range(first, first + rng.randint(1, 6))]
        keys = keys[len(engine.pool.lookup(keys)):]
        if keys:
            req = engine.send(p.TierLookup(engine_id=engine.name, keys=keys))
            self.loads[engine.identity] = Load(engine.identity, engine.namespace, keys, req)

    def on_reply(self, engine: SimEngine, msg: p.Msg) -> bool:
        """A message to ``engine``: True when it is the tier's (taken here)."""
        load = self.loads.get(engine.identity)
        if load is None or msg.req_id != load.req:
            return isinstance(msg, (p.TierPinned, p.TierData))
        w, rng = self.world, self.rng
        if isinstance(msg, p.TierPinned) and msg.lease:
            load.lease, load.nbytes = msg.lease, list(msg.nbytes)
            x = rng.random()
            if msg.nbytes[0] != engine.block_bytes:   # another layout of its namespace: not loaded (as the connector)
                w.counts["tier_other_layout"] += 1
                self.release(engine, load)
            elif x < ABANDON:
                load.abandoned = True          # never fetched nor released: its deadline ends it
                w.counts["tier_lease_abandoned"] += 1
            elif x < ABANDON + RELEASE:
                self.release(engine, load)
            else:
                self.fetch(engine, load, 0)
            return True
        if isinstance(msg, p.TierData):
            if msg.size >= 0 and (msg.block != load.block or msg.size != load.nbytes[load.block]):
                w.violation(f"tier: engine {engine.name} asked for block {load.block} of lease {load.lease} "
                            f"({load.nbytes[load.block]} bytes), got block {msg.block} of {msg.size}")
            if msg.size >= 0 and msg.offset + tiering.CHUNK < msg.size:
                self.fetch(engine, load, msg.offset + tiering.CHUNK)
                return True
            w.counts["tier_promoted" if msg.size >= 0 else "tier_dropped_at_fetch"] += 1
            load.block += 1
            if load.block < len(load.nbytes) and load.nbytes[load.block] != engine.block_bytes:
                w.counts["tier_other_layout"] += 1
                self.release(engine, load)
            elif load.block >= len(load.nbytes):
                del self.loads[engine.identity]       # the daemon ended the lease with its last block
            elif rng.random() < RELEASE / 2:
                self.release(engine, load)
            else:
                self.fetch(engine, load, 0)
            return True
        del self.loads[engine.identity]               # a miss, an Error, the Ok of a release
        return True

    def fetch(self, engine: SimEngine, load: Load, offset: int) -> None:
        load.req = engine.send(p.TierFetch(engine_id=engine.name, lease=load.lease, block=load.block, offset=offset))

    def release(self, engine: SimEngine, load: Load) -> None:
        load.req = engine.send(p.TierRelease(engine_id=engine.name, lease=load.lease))
        self.world.counts["tier_released"] += 1

    def check(self, leases: dict[int, Any]) -> None:
        """Loads end with their engine, and an abandoned one with its lease (``leases``: the daemon's)."""
        w = self.world
        for identity, load in list(self.loads.items()):
            if identity not in w.wires:       # the engine died
                if load.lease:
                    w.counts["lease_engine_died"] += 1
                del self.loads[identity]
            elif load.lease and load.lease not in leases:
                if load.abandoned:
                    w.counts["lease_expired"] += 1
                    del self.loads[identity]
