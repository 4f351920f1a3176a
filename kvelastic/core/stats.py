"""Counters the pool keeps for the daemon's metrics and vLLM's stats."""

from __future__ import annotations

import dataclasses

EVICTION_REASONS = ("lru", "ttl", "size_limit", "reclaim", "invalidate", "explicit")


@dataclasses.dataclass
class PoolStats:
    lookups: int = 0          # lookup() calls
    lookup_blocks: int = 0    # keys asked for
    hit_blocks: int = 0       # keys served from the cache
    token_mismatches: int = 0  # hash hits refused because the token ids differed
    evictions: dict[str, int] = dataclasses.field(
        default_factory=lambda: dict.fromkeys(EVICTION_REASONS, 0))

    def hit_rate(self) -> float:
        return self.hit_blocks / self.lookup_blocks if self.lookup_blocks else 0.0
