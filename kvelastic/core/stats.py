"""Counters the pool keeps for the daemon's metrics and vLLM's stats."""

from __future__ import annotations

import dataclasses

EVICTION_REASONS = ("lru", "ttl", "size_limit", "reclaim", "invalidate", "explicit", "drain")


@dataclasses.dataclass
class PoolStats:
    lookups: int = 0          # requests looked up
    lookup_blocks: int = 0    # keys asked for (engines that look up through lookup())
    hit_blocks: int = 0       # keys served from the cache
    # The hit rate operators compare with vLLM's: tokens, counted as vLLM
    # counts prefix_cache_queries / prefix_cache_hits (the vLLM plugin feeds
    # these from vLLM's own figures through record_query; lookup() counts
    # whole blocks' tokens).
    query_tokens: int = 0
    hit_tokens: int = 0
    # allocate/touch/free calls: the engine's activity (one that makes none is
    # idle; slabs coming and going are not activity).
    block_ops: int = 0
    # Blocks adopted with slabs handed on by another engine of the namespace,
    # and hits on them (each adopted block counts once, at its first hit).
    adopted_blocks: int = 0
    adopted_hits: int = 0
    evictions: dict[str, int] = dataclasses.field(
        default_factory=lambda: dict.fromkeys(EVICTION_REASONS, 0))

    def counters(self) -> dict[str, int]:
        """The counters as an engine reports them (``Journal.stats``), named
        as in ``COUNTER_NAMES``."""
        flat = {name: getattr(self, name) for name in _PLAIN}   # every journal flush: no fields() walk
        flat.update({f"evictions_{reason}": n for reason, n in self.evictions.items()})
        return flat

    def hit_rate(self) -> float:
        """Share of queried tokens served from the cache."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


_PLAIN = tuple(f.name for f in dataclasses.fields(PoolStats) if f.name != "evictions")
# The counters an engine reports to the daemon (``Journal.stats``): the daemon
# keeps these and no others.
COUNTER_NAMES = frozenset([*_PLAIN, *(f"evictions_{reason}" for reason in EVICTION_REASONS)])
