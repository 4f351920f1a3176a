"""Counters the tier keeps, for the daemon's metrics (``tier_*`` series, to come)."""

from __future__ import annotations

import dataclasses

# Why an entry left the tier without a failure: pushed out by a more valuable
# demotion ("value"), its namespace invalidated ("invalidate"), or the tier
# found over its budget when rebuilt after a restart ("budget").
EVICTION_REASONS = ("value", "invalidate", "budget")
# Why a block was lost: a write that failed (disk full, an I/O error), bytes
# that failed their check when read (torn, checksum, identity), an I/O error
# on read ("io"), or a load the engine did not finish (killed mid-load: "load").
FAILURE_REASONS = ("disk_full", "io", "torn", "checksum", "identity", "load")


@dataclasses.dataclass
class TierStats:
    demotions: int = 0        # blocks committed: their bytes are in the tier and findable
    demotions_reclaimed: int = 0   # of those, of cached slabs reclaimed from running engines (counted by the daemon)
    already_held: int = 0     # demotions not needed: the key was in the tier already
    rejected_full: int = 0    # demotions refused: no room (what is left is held by loads and writes)
    restored: int = 0         # entries rebuilt from what a store found after a restart
    lookups: int = 0          # lookup calls
    lookup_blocks: int = 0    # keys asked for
    hit_blocks: int = 0       # keys found (and pinned for a load)
    miss_blocks: int = 0      # keys asked for and not found: those after the found prefix
    promotions: int = 0       # blocks whose load ended well
    evictions: dict[str, int] = dataclasses.field(
        default_factory=lambda: dict.fromkeys(EVICTION_REASONS, 0))
    failures: dict[str, int] = dataclasses.field(
        default_factory=lambda: dict.fromkeys(FAILURE_REASONS, 0))

    def counters(self) -> dict[str, int]:
        """Every counter under one flat name (``evictions_value``, ``failures_torn``, ...)."""
        flat = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in ("evictions", "failures")}
        flat.update({f"evictions_{reason}": n for reason, n in self.evictions.items()})
        flat.update({f"failures_{reason}": n for reason, n in self.failures.items()})
        return flat

    def hit_rate(self) -> float:
        """Share of the keys asked for that the tier held."""
        return self.hit_blocks / self.lookup_blocks if self.lookup_blocks else 0.0
