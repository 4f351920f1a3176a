"""Every Prometheus metric kvelastic exports, defined here and nowhere else.

Names follow Prometheus conventions (base units, ``_bytes``, ``_seconds``,
``_total`` for counters). Labels are ``device``, ``engine``, ``namespace``,
``reason``, ``state``, ``bound`` only: never a hash, a token or a prompt.

Per-engine series are produced at scrape time from the daemon's books
(``DaemonCollector``), so an engine that leaves takes its series with it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from kvelastic.core.stats import EVICTION_REASONS
from kvelastic.protocol import Reason
from kvelastic.status_report import LoadLatency, RestartStatus, StatusReport, TierStatus
from kvelastic.tier.reader import REFUSALS as TIER_READ_REFUSALS
from kvelastic.tier.stats import EVICTION_REASONS as TIER_EVICTION_REASONS
from kvelastic.tier.stats import FAILURE_REASONS as TIER_FAILURE_REASONS
from kvelastic.tier.stats import REFUSAL_REASONS as TIER_REFUSAL_REASONS

PREFIX = "kvelastic"
# Every reason the daemon rejects a message for, so each counter exists from
# start-up and rate() sees the first rejection.
REJECT_REASONS = tuple(reason.value for reason in Reason)
GRANT_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
DEMAND_WAIT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


# Per-engine counters from the engine's pool stats (``Journal.stats``):
# (metric name without the prefix, the stats key, help).
ENGINE_COUNTERS = (
    # The hit rate: tokens, as vLLM's prefix_cache_queries / prefix_cache_hits.
    ("prefix_cache_queries", "query_tokens",
     "Prompt tokens looked up in an engine's prefix cache (as vLLM counts them)."),
    ("prefix_cache_hits", "hit_tokens", "Prompt tokens served from an engine's prefix cache (as vLLM counts them)."),
    # Block-level figures of engines that look up through the core pool.
    ("prefix_cache_lookup_blocks", "lookup_blocks",
     "Whole blocks looked up through the core pool's lookup (non-vLLM engines; vLLM engines count tokens only)."),
    ("prefix_cache_hit_blocks", "hit_blocks", "Whole blocks served by the core pool's lookup (non-vLLM engines)."),
    ("adopted_blocks", "adopted_blocks",
     "Cached blocks an engine adopted with slabs handed on by another engine of its namespace or kept from a "
     "departed one (KV it did not compute)."),
    ("adopted_hits", "adopted_hits", "Adopted blocks that served a hit (each counted once)."),
)


class DaemonMetrics:
    """The daemon's own instruments plus the collector over its books."""

    def __init__(self, snapshot: Callable[[], StatusReport], devices: list[str]) -> None:
        self.registry = CollectorRegistry()
        self.grant_latency = Histogram(
            f"{PREFIX}_grant_latency_seconds",
            "Time from a grow request to the grant, workers' map acknowledgements included.",
            ["device"], buckets=GRANT_LATENCY_BUCKETS, registry=self.registry)
        self.demand_wait = Histogram(
            f"{PREFIX}_demand_wait_seconds",
            "Time an engine's demand grow (a request waiting for memory) took to be answered, "
            "reclaims from other engines included.",
            ["device"], buckets=DEMAND_WAIT_BUCKETS, registry=self.registry)
        self.rejected = Counter(
            f"{PREFIX}_rejected_messages",
            "Messages the daemon refused (malformed, wrong version, unknown engine, ...).",
            ["reason"], registry=self.registry)
        for device in devices:
            self.grant_latency.labels(device)
            self.demand_wait.labels(device)
        for reason in REJECT_REASONS:
            self.rejected.labels(reason)
        self.registry.register(DaemonCollector(snapshot))
        # The loop publishes a snapshot every tick (it was just taken when this
        # is built); a scrape reports how old the one it reads is.
        self._published_at = time.monotonic()
        self.registry.register(SnapshotAgeCollector(lambda: time.monotonic() - self._published_at))

    def published(self) -> None:
        """The loop has just published a fresh snapshot."""
        self._published_at = time.monotonic()


class SnapshotAgeCollector(Collector):
    """How old the numbers on /metrics are: they come from the snapshot the
    loop publishes each tick, so a loop that is stuck shows here (and fires
    KvelasticDaemonDown) while /metrics still answers."""

    def __init__(self, age: Callable[[], float]) -> None:
        self._age = age

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(f"{PREFIX}_snapshot_age_seconds",
                                "Seconds since the daemon's loop published the status snapshot these metrics "
                                "come from (it does every 0.1 s; more than a few seconds: the loop is stuck).",
                                value=max(0.0, self._age()))


class DaemonCollector(Collector):
    def __init__(self, snapshot: Callable[[], StatusReport]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        s = self._snapshot()
        budget = GaugeMetricFamily(f"{PREFIX}_budget_bytes", "Device pool budget.", labels=["device"])
        memory = GaugeMetricFamily(f"{PREFIX}_memory_bytes",
                                   "Device memory by state: held by engines, cached (inside held), "
                                   "free in the daemon (created, not held), orphaned (departed engines' "
                                   "cache kept for their namespace), unused budget.",
                                   labels=["device", "state"])
        engines = GaugeMetricFamily(f"{PREFIX}_engines_connected", "Engines registered.", labels=["device"])
        quarantined = GaugeMetricFamily(f"{PREFIX}_quarantined_bytes",
                                        "Memory of failed engines, kept out of circulation until their "
                                        "processes are gone.", labels=["device"])
        for d in s.devices:
            budget.add_metric([d.device], d.budget_bytes)
            for state in ("held", "cached", "free", "orphaned", "unallocated"):
                memory.add_metric([d.device, state], getattr(d.memory, state))
            engines.add_metric([d.device], sum(1 for e in s.engines if e.device == d.device))
            quarantined.add_metric([d.device], d.pages.quarantined * s.page_size)
        moves = CounterMetricFamily(f"{PREFIX}_slab_moves",
                                    "Slabs one engine gave up for another engine's demand.", labels=["device"])
        thrash = CounterMetricFamily(f"{PREFIX}_slab_thrash",
                                     "Moves back to an engine within 1 s of a move away from it (ping-pong).",
                                     labels=["device"])
        for d in s.devices:
            moves.add_metric([d.device], d.slab_moves)
            thrash.add_metric([d.device], d.thrash)
        orphaned = GaugeMetricFamily(f"{PREFIX}_orphaned_cache_bytes",
                                     "Cache of departed engines kept for the next engine of their namespace "
                                     "(warm restart), until KVELASTIC_ORPHAN_CACHE_TTL or memory pressure.",
                                     labels=["device", "namespace"])
        orphaned_blocks = GaugeMetricFamily(f"{PREFIX}_orphaned_cache_blocks",
                                            "Valid cached blocks in the orphaned cache.",
                                            labels=["device", "namespace"])
        for o in s.orphans:
            orphaned.add_metric([o.device, o.namespace], o.bytes)
            orphaned_blocks.add_metric([o.device, o.namespace], o.blocks)
        yield from (budget, memory, engines, quarantined, moves, thrash, orphaned, orphaned_blocks)

        held = GaugeMetricFamily(f"{PREFIX}_engine_held_bytes", "Memory held by an engine.",
                                 labels=["device", "engine", "namespace"])
        cached = GaugeMetricFamily(f"{PREFIX}_engine_cached_bytes",
                                   "Memory in an engine's cached (evictable) prefix blocks.",
                                   labels=["device", "engine", "namespace"])
        idle = GaugeMetricFamily(f"{PREFIX}_engine_idle",
                                 "1 while an engine is idle (no activity for KVELASTIC_IDLE_GRACE): its reserve "
                                 "is gone and its cache yields first.", labels=["device", "engine"])
        starved = GaugeMetricFamily(f"{PREFIX}_engine_starved_seconds",
                                    "How long an engine's demand for memory has gone unmet (0: it has not).",
                                    labels=["device", "engine"])
        limit = GaugeMetricFamily(f"{PREFIX}_engine_limit_bytes", "An engine's guaranteed minimum and cap.",
                                  labels=["device", "engine", "bound"])
        slabs = {name: CounterMetricFamily(f"{PREFIX}_slab_{name}", help_, labels=["device", "engine"])
                 for name, help_ in (("grants", "Slabs granted to an engine."),
                                     ("returns", "Slabs an engine gave back when idle."),
                                     ("reclaims", "Slabs taken from an engine under pressure."))}
        stats = {key: CounterMetricFamily(f"{PREFIX}_{name}", help_, labels=["device", "engine"])
                 for name, key, help_ in ENGINE_COUNTERS}
        evictions = CounterMetricFamily(f"{PREFIX}_prefix_cache_evictions",
                                        "Cached blocks evicted, by reason (engine \"\": kept cache of departed "
                                        "engines: ttl, reclaim, invalidate).",
                                        labels=["device", "engine", "reason"])
        for e in s.engines:
            eid, ns, dev = e.engine_id, e.namespace, e.device
            held.add_metric([dev, eid, ns], e.held_bytes)
            idle.add_metric([dev, eid], int(e.idle))
            starved.add_metric([dev, eid], e.starved_seconds)
            cached.add_metric([dev, eid, ns], e.cached_bytes)
            limit.add_metric([dev, eid, "min"], e.min_bytes)
            limit.add_metric([dev, eid, "max"], e.max_bytes)
            for name in slabs:
                slabs[name].add_metric([dev, eid], getattr(e, name))
            for key, family in stats.items():
                family.add_metric([dev, eid], e.stats.get(key, 0))
            for reason in EVICTION_REASONS:  # every series from registration on
                evictions.add_metric([dev, eid, reason], e.stats.get(f"evictions_{reason}", 0))
        for d in s.devices:   # kept cache: no engine (ids are never empty)
            for reason in ("ttl", "reclaim", "invalidate"):
                evictions.add_metric([d.device, "", reason], d.kept_evictions.get(reason, 0))
        yield from (held, cached, idle, starved, limit, *slabs.values(), *stats.values(), evictions)
        if s.tier is not None:
            yield from tier_families(s.tier)
        if s.restart is not None:
            yield from restart_families(s.restart)


# Why a saved kept slab was not adopted (``saved._unfit``).
RESTART_DROP_REASONS = ("pages_gone", "over_budget", "device_gone", "malformed")
# Why a claimed slab was adopted without its pages (``registration.py``): no lent record of it, one of
# another namespace, uid, secret or shape, one let go at the grace period's end, one dropped at start, or
# its workers did not all re-register with it mapped before it was unmapped or the grace period ended.
LENT_UNMATCHED_REASONS = ("no_record", "mismatch", "late", "dropped", "unconfirmed")
# What became of the state file at start: read, or why not (``statefile.py``'s reasons, ``invalid`` for
# books of another version).
STATE_FILE_STATES = ("ok", "missing", "torn", "checksum", "version", "stale", "untrusted", "invalid", "io")


def restart_families(restart: RestartStatus) -> Iterator[Metric]:
    """What the daemon took back at start from its keeper and state file."""
    blocks = GaugeMetricFamily(f"{PREFIX}_restart_kept_blocks_adopted",
                               "Kept cache blocks this daemon adopted from its predecessor at start.")
    blocks.add_metric([], restart.kept_blocks)
    dropped = GaugeMetricFamily(f"{PREFIX}_restart_kept_slabs_dropped",
                                "Saved kept cache slabs this daemon did not adopt at start, by reason.",
                                labels=["reason"])
    for reason in RESTART_DROP_REASONS:
        dropped.add_metric([reason], restart.dropped.get(reason, 0))
    state = GaugeMetricFamily(f"{PREFIX}_restart_state_file",
                              "1 for what became of the state file at start: ok (read), missing, or why it was "
                              "not trusted (torn, checksum, version, stale, untrusted, invalid, io).", labels=["state"])
    for name in STATE_FILE_STATES:
        state.add_metric([name], int(restart.state_file == name))
    let_go = GaugeMetricFamily(f"{PREFIX}_restart_pages_let_go",
                               "Pages the keeper held at start that no saved books proved current (released).")
    let_go.add_metric([], restart.pages_let_go)
    yield from (blocks, dropped, state, let_go)
    yield from lent_families(restart)


def lent_families(restart: RestartStatus) -> Iterator[Metric]:
    """Running engines' slabs through the restart: the lent records held at start, and what
    their engines' claims found."""
    held = GaugeMetricFamily(f"{PREFIX}_restart_lent_slabs_held",
                             "Lent slab records of the state file this daemon held at start for their engines' "
                             "claims (their pages kept).")
    held.add_metric([], restart.lent_held)
    dropped = GaugeMetricFamily(f"{PREFIX}_restart_lent_slabs_dropped",
                                "Lent slab records of the state file dropped at start, by reason.", labels=["reason"])
    for reason in RESTART_DROP_REASONS:
        dropped.add_metric([reason], restart.lent_dropped.get(reason, 0))
    adopted = CounterMetricFamily(f"{PREFIX}_restart_lent_slabs_adopted",
                                  "Slabs running engines claimed at re-registration, adopted with their pages.")
    adopted.add_metric([], restart.lent_adopted)
    unmatched = CounterMetricFamily(f"{PREFIX}_restart_lent_slabs_unmatched",
                                    "Slabs running engines claimed at re-registration, adopted without their pages "
                                    "(their cache is not kept when they leave), by reason.", labels=["reason"])
    for reason in LENT_UNMATCHED_REASONS:
        unmatched.add_metric([reason], restart.lent_unmatched.get(reason, 0))
    let_go = CounterMetricFamily(f"{PREFIX}_restart_lent_slabs_let_go",
                                 "Held lent slab records no claim matched (their pages released).")
    let_go.add_metric([], restart.lent_let_go)
    yield from (held, dropped, adopted, unmatched, let_go)


# The tier's counters (``TierStats``): (metric name without the prefix, the counters key, help).
TIER_COUNTERS = (
    ("tier_demotions", "demotions", "Blocks written to the node's tier (findable from then on)."),
    ("tier_demotions_reclaimed", "demotions_reclaimed",
     "Of the blocks written to the node's tier, those of cached slabs reclaimed from running engines."),
    ("tier_demotions_evicted", "demotions_evicted",
     "Of the blocks written to the node's tier, those running engines were about to evict (copied while cached)."),
    ("tier_promotions", "promotions", "Blocks loaded back from the tier by an engine."),
    ("tier_lookup_blocks", "lookup_blocks", "Blocks engines asked the tier for."),
    ("tier_hit_blocks", "hit_blocks", "Blocks the tier held when asked (pinned for a load)."),
    ("tier_rejected_full", "rejected_full", "Demotions refused: the room left is held by loads and writes."),
    ("tier_restored", "restored", "Blocks found whole on disk when the daemon started."),
    ("tier_moved_down", "moved_down",
     "Blocks moved from the tier's host memory down to its disk to make room above (KVELASTIC_TIER_HOST_SIZE "
     "with KVELASTIC_TIER_DIR)."),
    ("tier_staging_retried", "staging_retried",
     "Blocks of running engines copied on a later journal, once refused for room in the staging."),
)


def tier_families(tier: TierStatus) -> Iterator[Metric]:
    """The node's tier (``KVELASTIC_TIER_DIR``, ``KVELASTIC_TIER_HOST_SIZE``): only when one is configured."""
    budget = GaugeMetricFamily(f"{PREFIX}_tier_budget_bytes",
                               "The node's tier's budget, every medium's (KVELASTIC_TIER_SIZE, "
                               "KVELASTIC_TIER_HOST_SIZE).")
    budget.add_metric([], tier.budget_bytes)
    used = GaugeMetricFamily(f"{PREFIX}_tier_bytes",
                             "Bytes in the tier: blocks that can be found, being written, or held by a load.")
    used.add_metric([], tier.bytes)
    blocks = GaugeMetricFamily(f"{PREFIX}_tier_blocks", "Blocks in the tier that can be found, by namespace.",
                               labels=["namespace"])
    for namespace, n in sorted(tier.namespaces.items()):
        blocks.add_metric([namespace], n)
    level_budget = GaugeMetricFamily(f"{PREFIX}_tier_medium_budget_bytes", "Each medium's budget of the tier.",
                                     labels=["medium"])
    level_used = GaugeMetricFamily(f"{PREFIX}_tier_medium_bytes", "Bytes each medium of the tier holds now.",
                                   labels=["medium"])
    for level in tier.levels:
        level_budget.add_metric([level.medium], level.budget_bytes)
        level_used.add_metric([level.medium], level.bytes)
    yield from (budget, used, blocks, level_budget, level_used)
    for name, key, help_ in TIER_COUNTERS:
        family = CounterMetricFamily(f"{PREFIX}_{name}", help_)
        family.add_metric([], tier.counters.get(key, 0))
        yield family
    evictions = CounterMetricFamily(f"{PREFIX}_tier_evictions",
                                    "Blocks that left the tier without a failure: value (pushed out by a more "
                                    "valuable one), invalidate, budget (a smaller budget after a restart).",
                                    labels=["reason"])
    for reason in TIER_EVICTION_REASONS:
        evictions.add_metric([reason], tier.counters.get(f"evictions_{reason}", 0))
    failures = CounterMetricFamily(f"{PREFIX}_tier_failures",
                                   "Blocks lost to a failure: disk_full, memory_full (the host tier's), io, torn, "
                                   "checksum, identity (bytes that failed their check, never served), load (a load "
                                   "not finished), evicted_share "
                                   "(a copy discarded unconfirmed for another tenant's share of the staging).",
                                   labels=["reason"])
    for reason in TIER_FAILURE_REASONS:
        failures.add_metric([reason], tier.counters.get(f"failures_{reason}", 0))
    refused = CounterMetricFamily(f"{PREFIX}_tier_fetches_refused",
                                  "Tier fetches refused (answered busy, nothing changed): tenant_bytes (the "
                                  "tenant's share of the tier's reader is taken by its fetches in flight).",
                                  labels=["reason"])
    for reason in TIER_READ_REFUSALS:
        refused.add_metric([reason], tier.reads.refused.get(reason, 0))
    yield from (evictions, failures, refused)
    yield from tier_share_families(tier)
    yield tier_load_family(tier.load_seconds)


def tier_share_families(tier: TierStatus) -> Iterator[Metric]:
    """What each tenant holds of what the tier shares, and what was refused for it (docs/tier.md, "Shares")."""
    refused = CounterMetricFamily(f"{PREFIX}_tier_share_refusals",
                                  "Refusals for a tenant's share of the tier, each counted once: pin_share (a "
                                  "lookup cut short or refused: its tenant pins its share), pin_held (the same: "
                                  "the block was pinned too long and rests), leases (a lookup refused: its "
                                  "tenant holds its leases), staging (a block not copied for room: retried).",
                                  labels=["reason"])
    for reason in TIER_REFUSAL_REASONS:
        refused.add_metric([reason], tier.counters.get(f"refused_{reason}", 0))
    pinned = GaugeMetricFamily(f"{PREFIX}_tier_tenant_pinned_bytes",
                               "Bytes of the tier a tenant's leases pin, by uid (a block pinned twice counts twice).",
                               labels=["uid"])
    staged = GaugeMetricFamily(f"{PREFIX}_tier_tenant_staged_bytes",
                               "Bytes of the staging a tenant's copies hold until their engines confirm them, by uid.",
                               labels=["uid"])
    for uid, share in tier.shares.tenants.items():
        pinned.add_metric([uid], share.pinned_bytes)
        staged.add_metric([uid], share.staged_bytes)
    yield from (refused, pinned, staged)


def tier_load_family(load: LoadLatency) -> HistogramMetricFamily:
    """``kvelastic_tier_load_seconds``: the tier's per-block counts made cumulative, as Prometheus has them."""
    family = HistogramMetricFamily(f"{PREFIX}_tier_load_seconds",
                                   "Seconds from an engine's tier lookup to each of its blocks loaded (the "
                                   "block's last chunk read by the daemon).")
    cumulative, total = [], 0
    for bound, n in zip([*(str(float(b)) for b in load.buckets), "+Inf"], load.counts):   # "0.0001", "10.0"
        total += n
        cumulative.append((bound, total))
    family.add_metric([], cumulative or [("+Inf", 0)], sum_value=load.sum)
    return family


ROUTER_ERRORS = ("bad_request", "tokenize", "indexer", "engine")


class RouterMetrics:
    """``kvelastic router``'s instruments: where requests went and how much
    of their prompts the chosen engine already held (per the indexer)."""

    def __init__(self, engines: list[str]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(f"{PREFIX}_router_requests", "Requests the router sent to an engine.",
                                ["engine"], registry=self.registry)
        self.prompt_tokens = Counter(f"{PREFIX}_router_prompt_tokens",
                                     "Prompt tokens of routed requests (as the router tokenized them).",
                                     ["engine"], registry=self.registry)
        self.matched_tokens = Counter(f"{PREFIX}_router_matched_tokens",
                                      "Prompt tokens the indexer reported the chosen engine holds.",
                                      ["engine"], registry=self.registry)
        self.errors = Counter(f"{PREFIX}_router_errors",
                              "Requests the router could not route as asked, by reason (bad_request: refused; "
                              "tokenize, indexer: routed without scores; engine: the engine failed).",
                              ["reason"], registry=self.registry)
        self.registrations = Counter(f"{PREFIX}_router_registrations",
                                     "Engines registered with the indexer again (the engine restarted, or the "
                                     "indexer did not list it).", ["engine"], registry=self.registry)
        for engine in engines:
            for family in (self.requests, self.prompt_tokens, self.matched_tokens, self.registrations):
                family.labels(engine)
        for reason in ROUTER_ERRORS:
            self.errors.labels(reason)
