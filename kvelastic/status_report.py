"""The daemon's state as ``kvelastic status``, ``top`` and ``/metrics`` show
it: the answer to a ``Status`` request (``protocol.StatusReply``), built by
``daemon/report.py``. Byte counts are bytes; the top-level memory and pages
add up every device's."""

from __future__ import annotations

import msgspec

from kvelastic.names import ShownName


class MemoryStatus(msgspec.Struct, kw_only=True):
    held: int                    # by engines (cached is part of it)
    cached: int                  # in engines' evictable prefix blocks
    free: int                    # pages created, free in the daemon
    unallocated: int             # budget not created yet
    orphaned: int = 0            # departed engines' cache kept for their namespace


class PageCounts(msgspec.Struct, kw_only=True):
    created: int
    free: int
    adopted: int                 # exist only in engines (after a daemon restart)
    quarantined: int = 0         # of failed engines: never lent again while their processes live


class DeviceStatus(msgspec.Struct, kw_only=True):
    device: str
    backend: str
    budget_bytes: int
    memory: MemoryStatus
    pages: PageCounts
    slab_moves: int = 0          # slabs given up by one engine for another's demand
    thrash: int = 0              # moves back to an engine within THRASH_WINDOW of a move away from it
    # Blocks of kept cache (departed engines') dropped, by eviction reason:
    # ttl, reclaim (memory for a demand), invalidate.
    kept_evictions: dict[str, int] = {}


class EngineStatus(msgspec.Struct, kw_only=True):
    engine_id: ShownName
    namespace: ShownName
    pid: int
    device: str
    workers: int
    slabs: int
    slab_bytes: int
    held_bytes: int
    cached_bytes: int
    live_blocks: int
    cached_blocks: int
    min_bytes: int
    max_bytes: int
    grants: int
    returns: int
    reclaims: int
    stats: dict[str, int]        # the engine's cumulative pool counters (lookups, hits, evictions_*)
    idle: bool = False           # no activity for the idle grace: reserve decayed, never grows
    starved_seconds: float = 0.0 # how long its demand has gone unmet (0: it has not)
    private: bool = False        # its cache is its own (weights that may change in memory)
    worker_devices: dict[str, str] = {}   # rank (as text, as JSON has it) -> the device its pages live on


class OrphanStatus(msgspec.Struct, kw_only=True):
    """Cache of one namespace kept after its engines left (warm start)."""
    namespace: ShownName
    device: str
    slabs: int
    blocks: int                  # valid cached blocks in them
    bytes: int
    oldest_seconds: float        # age of the oldest (it expires at the orphan TTL)


class LoadLatency(msgspec.Struct, kw_only=True):
    """Seconds from a tier lease's lookup to each of its blocks loaded (its
    last chunk read), as a histogram (``TierStats.observe_load``)."""
    buckets: list[float] = []    # upper bounds, seconds (``tier.stats.LOAD_BUCKETS``)
    counts: list[int] = []       # per bound, not cumulative, and one more: above the last
    sum: float = 0.0


class TierReads(msgspec.Struct, kw_only=True):
    """The tier's reader (``tier/reader.py``): fetches read off the loop,
    round-robin between tenants, within a share of bytes each."""
    queued: int = 0              # fetches queued or being read
    bytes: int = 0               # held for them: chunks and blocks to read, blocks served, answers not sent
    refused: dict[str, int] = {} # fetches refused (answered ``busy``) by reason: tenant_bytes (its share taken)


class TenantTierShare(msgspec.Struct, kw_only=True):
    """What one tenant (uid) holds of what the node's tier shares."""
    pins: int = 0                # pins its engines' leases hold (a block pinned twice counts twice)
    pinned_bytes: int = 0        # the bytes they hold, counted likewise
    leases: int = 0              # its engines' leases
    staged_bytes: int = 0        # its running engines' copies awaiting their ack (source B)


class TierShares(msgspec.Struct, kw_only=True):
    """Each tenant's part of the tier's pins, leases and staging, and the
    bounds on it (docs/tier.md, "Shares"); refusals are ``refused_*`` counters."""
    pin_share_bytes: int = 0     # the bytes one tenant's pins may hold
    max_pins: int = 0            # the pins one tenant may hold
    max_leases: int = 0          # the leases one tenant's engines may hold
    staging_share_bytes: int = 0  # the staging one tenant's copies may hold
    tenants: dict[str, TenantTierShare] = {}   # uid (as text, as JSON has it) -> what it holds now


class TierLevelStatus(msgspec.Struct, kw_only=True):
    """One medium of the tier (the top first): its budget and the bytes it holds now."""
    medium: str
    budget_bytes: int
    bytes: int


class TierStatus(msgspec.Struct, kw_only=True):
    """The node's tier below device memory (``KVELASTIC_TIER_DIR`` or ``KVELASTIC_TIER_HOST_SIZE``)."""
    budget_bytes: int
    medium: str = "disk"         # "disk", "host" (memory the daemon owns) or "host+disk" (host above)
    levels: list[TierLevelStatus] = []      # per medium, the top first
    bytes: int                   # in use: blocks found, being written, or held by a load
    blocks: int                  # blocks that can be found, or will be once written
    writing: int = 0             # of those, blocks being written (or staged: source B)
    namespaces: dict[ShownName, int] = {}   # namespace -> its blocks
    counters: dict[str, int] = {}           # TierStats.counters(): demotions, hits, evictions_*, failures_*
    load_seconds: LoadLatency = msgspec.field(default_factory=LoadLatency)
    shares: TierShares = msgspec.field(default_factory=TierShares)
    reads: TierReads = msgspec.field(default_factory=TierReads)   # the loop's, not the books'


class RestartStatus(msgspec.Struct, kw_only=True):
    """What this daemon took back of its predecessor's at start."""
    state_file: str              # "ok", or why the saved books were not used (metrics.STATE_FILE_STATES)
    kept_slabs: int = 0          # kept cache slabs adopted
    kept_blocks: int = 0         # their cached blocks
    dropped: dict[str, int] = {} # saved kept slabs not adopted, by reason
    pages_let_go: int = 0        # pages the keeper held that nothing proved current
    # Running engines' slabs: the lent records of the state file
    # held at start for their engines' claims (their pages kept), those
    # dropped at start by reason (metrics.RESTART_DROP_REASONS); claimed
    # slabs adopted with their pages, and without, by reason
    # (metrics.LENT_UNMATCHED_REASONS); held records no claim matched, let go.
    lent_held: int = 0
    lent_dropped: dict[str, int] = {}
    lent_adopted: int = 0
    lent_unmatched: dict[str, int] = {}
    lent_let_go: int = 0


class StatusReport(msgspec.Struct, kw_only=True):
    """The daemon's state as ``status``, ``top`` and ``/metrics`` show it; the
    top-level memory and pages add up every device's."""

    device: str
    backend: str
    page_size: int
    budget_bytes: int
    memory: MemoryStatus
    pages: PageCounts
    devices: list[DeviceStatus]
    engines: list[EngineStatus]
    orphans: list[OrphanStatus] = []
    tier: TierStatus | None = None
    restart: RestartStatus | None = None   # None: no keeper was used at start
