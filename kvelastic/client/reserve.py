"""When an engine tops up its reserve and when it gives slabs back. No I/O.

The reserve is the free blocks an engine keeps ahead of need (its low
watermark), so a request rarely waits for the daemon. It is worth its memory
only while the engine is *active*: a pool operation (a journal to ship) or a
demand within ``idle_grace`` seconds. Then (DESIGN.md, Flows):
- an active engine refills its reserve from the daemon's free memory (a
  reserve grow never reclaims from another engine) and keeps
  ``keep_idle_slabs`` empty slabs beyond it for ``shrink_grace`` seconds;
- an idle engine never grows, and its reserve decays to nothing: every empty
  slab goes back, whatever the watermark. Its cached slabs stay (they yield
  to other engines' demand, idle engines' first);
- slabs the daemon asked it to drain (``Drain``: another engine's demand
  goes unmet while this one holds more than its fair share) go back as soon
  as no block in them is live, until the drain lapses.

``EngineClient`` and the simulators call the same ``ReservePolicy``.
"""

from __future__ import annotations

import dataclasses
import math

from kvelastic.core.pool import SlabPool
from kvelastic.protocol import IDLE_GRACE  # the daemon's default; ``Registered.idle_grace`` carries its setting


@dataclasses.dataclass
class ReservePolicy:
    low_watermark: int                 # free blocks to keep while active
    keep_idle_slabs: int = 1           # empty slabs kept beyond the watermark while active
    shrink_grace: float = 5.0          # an empty slab beyond those goes back after this
    idle_grace: float = IDLE_GRACE     # no activity for this long: the engine is idle
    active_at: float = 0.0             # last pool activity or demand
    idle_since: dict[int, float] = dataclasses.field(default_factory=dict)   # empty slab -> since
    drain_until: float = 0.0           # slabs drain for another engine's demand until then

    def touch(self, now: float) -> None:
        """The engine did something (a pool operation, a demand)."""
        self.active_at = max(self.active_at, now)

    def is_idle(self, now: float) -> bool:
        return now - self.active_at >= self.idle_grace

    def refill(self, pool: SlabPool, now: float, max_slabs: int) -> int:
        """Slabs to ask for as a reserve grow now (0: none)."""
        if self.is_idle(now) or pool.num_free >= self.low_watermark or pool.num_slabs >= max_slabs:
            return 0
        want = math.ceil((self.low_watermark - pool.num_free) / pool.blocks_per_slab)
        return max(1, min(want, max_slabs - pool.num_slabs))

    def drain(self, pool: SlabPool, slab_ids: list[int], now: float, seconds: float) -> list[int]:
        """The daemon's ``Drain``: the slabs take no new block, until ``seconds``
        from now (a later drain extends it). Returns those now draining."""
        self.drain_until = max(self.drain_until, now + seconds)
        return pool.drain(slab_ids)

    def to_return(self, pool: SlabPool, now: float) -> list[int]:
        """Slabs to give back now: drained ones (``drain``), then empty ones,
        highest ids first (the arena stays compact at its low end). The
        caller takes them out of the pool."""
        if self.drain_until and now >= self.drain_until:
            self.drain_until = 0.0
            pool.undrain()             # the drain lapsed: what is still held is used again
        return pool.drained_slabs() + self._empty_to_return(pool, now)

    def _empty_to_return(self, pool: SlabPool, now: float) -> list[int]:
        idle = pool.idle_slabs()
        idle_set = set(idle)
        for slab_id in [s for s in self.idle_since if s not in idle_set]:
            del self.idle_since[slab_id]
        for slab_id in idle:
            self.idle_since.setdefault(slab_id, now)
        if self.is_idle(now):          # the reserve decays to nothing
            return sorted(idle, reverse=True)
        keep_free = self.low_watermark
        if len(idle) <= self.keep_idle_slabs or pool.num_free - pool.blocks_per_slab < keep_free:
            return []
        expired = sorted((s for s in idle if now - self.idle_since[s] >= self.shrink_grace), reverse=True)
        out: list[int] = []
        free = pool.num_free
        for slab_id in expired[:len(idle) - self.keep_idle_slabs]:
            if free - pool.blocks_per_slab < keep_free:
                break
            free -= pool.blocks_per_slab
            out.append(slab_id)
        return out

    def forget(self, slab_ids: list[int]) -> None:
        for slab_id in slab_ids:
            self.idle_since.pop(slab_id, None)
