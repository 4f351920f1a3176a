"""Counters the tier keeps, and its load latency histogram, for the daemon's
status and metrics (``kvelastic_tier_*`` series)."""

from __future__ import annotations

import bisect
import dataclasses

# Why an entry left the tier without a failure: pushed out by a more valuable
# demotion ("value"), its namespace invalidated ("invalidate"), or the tier
# found over its budget when rebuilt after a restart ("budget").
EVICTION_REASONS = ("value", "invalidate", "budget")
# Why a block was lost: a write that failed (the disk or host memory full, an I/O error), bytes
# that failed their check when read (torn, checksum, identity), an I/O error
# on read ("io"), a load the engine did not finish (killed mid-load: "load"),
# or a running engine's block copied while still cached (source B) that the
# engine dropped before it confirmed the copy ("raced": its bytes may have
# been rewritten while read) or never confirmed (it left, resent its index or
# ran past the deadline: "unconfirmed"), or discarded unconfirmed to give
# another tenant its share of the staging ("evicted_share").
FAILURE_REASONS = ("disk_full", "memory_full", "io", "torn", "checksum", "identity", "load", "raced", "unconfirmed",
                   "evicted_share")
# What a tenant (uid) was refused of what the node's tier shares, each
# counted once per refusal: a lookup cut short or refused because its
# tenant pins its share of the tier's budget or of its pins ("pin_share"),
# or because the blocks were pinned too long ("pin_held": they rest);
# a lookup refused because its tenant holds its leases ("leases"); a block
# of a running engine not copied for lack of room in the staging, its
# engine's or its tenant's share of it ("staging": retried later).
REFUSAL_REASONS = ("pin_share", "pin_held", "leases", "staging")


# Upper bounds (seconds) of the load latency histogram: from a block of a
# small model read from a warm page cache (~100 us) to a large one from a
# busy disk, or a lease an engine fetches slowly (10 s; the lease's deadline
# is 30 s: above the last bound).
LOAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                5.0, 10.0)
HISTOGRAM_FIELDS = ("load_counts", "load_seconds_sum")


@dataclasses.dataclass
class TierStats:
    demotions: int = 0        # blocks committed: their bytes are in the tier and findable
    demotions_reclaimed: int = 0   # of those, of cached slabs reclaimed from running engines (counted by the daemon)
    demotions_evicted: int = 0     # of those, of blocks running engines were about to evict (source B; likewise)
    already_held: int = 0     # demotions not needed: the key was in the tier already
    rejected_full: int = 0    # demotions refused: no room (what is left is held by loads and writes)
    restored: int = 0         # entries rebuilt from what a store found after a restart
    moved_down: int = 0       # blocks moved a level down (host memory to disk) to make room above
    moves: int = 0            # of those, moves whose bytes reached the level below
    lookups: int = 0          # lookup calls
    lookup_blocks: int = 0    # keys asked for
    hit_blocks: int = 0       # keys found (and pinned for a load)
    miss_blocks: int = 0      # keys asked for and not found: those after the found prefix
    promotions: int = 0       # blocks whose load ended well
    evictions: dict[str, int] = dataclasses.field(
        default_factory=lambda: dict.fromkeys(EVICTION_REASONS, 0))
    failures: dict[str, int] = dataclasses.field(
        default_factory=lambda: dict.fromkeys(FAILURE_REASONS, 0))
    refused: dict[str, int] = dataclasses.field(
        default_factory=lambda: dict.fromkeys(REFUSAL_REASONS, 0))
    staging_retried: int = 0  # blocks of running engines copied on a later journal, once refused for room
    # Seconds from a lease's lookup to each of its blocks loaded (its last
    # chunk read): a count per ``LOAD_BUCKETS`` bound, not cumulative, and one
    # more for above the last; and their sum.
    load_counts: list[int] = dataclasses.field(default_factory=lambda: [0] * (len(LOAD_BUCKETS) + 1))
    load_seconds_sum: float = 0.0

    def observe_load(self, seconds: float) -> None:
        """A block loaded ``seconds`` after its lease's lookup."""
        seconds = max(0.0, seconds)
        self.load_counts[bisect.bisect_left(LOAD_BUCKETS, seconds)] += 1
        self.load_seconds_sum += seconds

    def counters(self) -> dict[str, int]:
        """Every counter under one flat name (``evictions_value``, ``failures_torn``, ...)."""
        flat = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in ("evictions", "failures", "refused", *HISTOGRAM_FIELDS)}
        flat.update({f"evictions_{reason}": n for reason, n in self.evictions.items()})
        flat.update({f"failures_{reason}": n for reason, n in self.failures.items()})
        flat.update({f"refused_{reason}": n for reason, n in self.refused.items()})
        return flat

    def hit_rate(self) -> float:
        """Share of the keys asked for that the tier held."""
        return self.hit_blocks / self.lookup_blocks if self.lookup_blocks else 0.0
