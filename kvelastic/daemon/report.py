"""What the allocator shows: the status report and its own invariant check,
read-only over its books (``books.py``).
"""

from __future__ import annotations

from kvelastic.daemon.arbiter import is_idle
from kvelastic.daemon.books import Books
from kvelastic.daemon.staging import MAX_STAGED_PER_TENANT, Staging
from kvelastic.daemon.state import Phase
from kvelastic.daemon.tiering import MAX_TENANT_LEASES, Tiering
from kvelastic.errors import require
from kvelastic.status_report import (
    EngineStatus,
    LoadLatency,
    MemoryStatus,
    PageCounts,
    StatusReport,
    TenantTierShare,
    TierLevelStatus,
    TierShares,
    TierStatus,
)
from kvelastic.tier.index import TierIndex
from kvelastic.tier.stats import LOAD_BUCKETS


def status(books: Books, shares: TierShares | None = None) -> StatusReport:
    """``shares``: each tenant's part of the tier (``tier_shares``), where the caller has the parts that hold it."""
    held = dict.fromkeys(books.pools, 0)
    cached = dict.fromkeys(books.pools, 0)
    quarantined = dict.fromkeys(books.pools, 0)
    for e in (*books.engines.values(), *books.departing.values()):
        for slab in e.slabs.values():
            if not slab.page_devices:                    # adopted: its pages live in the engine
                held[e.device] += e.page_size * slab.adopted_pages
                quarantined[e.device] += e.failed * slab.adopted_pages
                continue
            for device in set(slab.page_devices):
                n = slab.page_devices.count(device)
                held[device] += e.page_size * n
                quarantined[device] += e.failed * n
    engines = []
    for e in books.engines.values():
        e_cached = e.cached_bytes()
        cached[e.device] += e_cached
        engines.append(EngineStatus(
            engine_id=e.engine_id, namespace=e.namespace, pid=e.pid, device=e.device,
            workers=len(e.workers), slabs=len(e.slabs), slab_bytes=e.slab_bytes,
            held_bytes=e.held_bytes(), cached_bytes=e_cached,
            live_blocks=sum(o[0] for o in e.mirror.slabs.values()),
            cached_blocks=sum(o[1] for o in e.mirror.slabs.values()),
            min_bytes=e.min_bytes, max_bytes=e.max_bytes,
            grants=e.grants, returns=e.returns, reclaims=e.reclaims, stats=dict(e.stats),
            idle=is_idle(e, books.now, books.rules), private=e.private,
            worker_devices={str(r): d for r, d in sorted(e.worker_devices.items())},
            starved_seconds=0.0 if e.starved_since is None else books.now - e.starved_since))
    devices = [pool.status(name, books.backend, held[name], cached[name], books.page_size, quarantined[name])
               for name, pool in books.pools.items()]
    for d in devices:
        d.slab_moves, d.thrash = books.moves[d.device], books.thrash[d.device]
        d.memory.orphaned = len(books.orphans.pages_on(d.device)) * books.page_size
        d.kept_evictions = books.orphans.evictions_on(d.device)
    return StatusReport(
        device=devices[0].device, backend=books.backend, page_size=books.page_size,
        budget_bytes=sum(d.budget_bytes for d in devices),
        memory=MemoryStatus(**{k: sum(getattr(d.memory, k) for d in devices)
                                 for k in ("held", "cached", "free", "unallocated", "orphaned")}),
        pages=PageCounts(**{k: sum(getattr(d.pages, k) for d in devices)
                              for k in ("created", "free", "adopted", "quarantined")}),
        devices=devices, engines=engines, orphans=books.orphans.status(books.now, books.page_size),
        tier=None if books.tier is None else tier_status(books.tier, shares), restart=books.restart)


def tier_status(tier: TierIndex, shares: TierShares | None = None) -> TierStatus:
    namespaces = tier.namespaces()
    levels = [TierLevelStatus(medium=m, budget_bytes=b, bytes=u)
              for m, b, u in zip(tier.media, tier.budgets, tier.level_used, strict=True)]
    return TierStatus(budget_bytes=tier.budget_bytes, medium=tier.medium, levels=levels, bytes=tier.bytes_used,
                      blocks=sum(namespaces.values()), writing=tier.writing(),
                      namespaces=namespaces, counters=tier.stats.counters(),
                      load_seconds=LoadLatency(buckets=list(LOAD_BUCKETS), counts=list(tier.stats.load_counts),
                                               sum=tier.stats.load_seconds_sum),
                      shares=TierShares() if shares is None else shares)


def tier_shares(tiering: Tiering, staging: Staging) -> TierShares | None:
    """What each tenant holds of the tier's pins (the index's), leases and
    staging now, and the bounds on them; None without a tier."""
    tier = tiering.tier
    if tier is None:
        return None
    tenants: dict[str, TenantTierShare] = {}
    for uid, held in tier.pins.tenants.items():
        tenants.setdefault(str(uid), TenantTierShare()).pins = held.pins
        tenants[str(uid)].pinned_bytes = held.nbytes
    for uid, n in tiering.tenant_leases.items():
        tenants.setdefault(str(uid), TenantTierShare()).leases = n
    for uid, n in staging.tenant_bytes.items():
        tenants.setdefault(str(uid), TenantTierShare()).staged_bytes = n
    return TierShares(pin_share_bytes=int(tier.budget_bytes * tier.pins.share), max_pins=tier.pins.max_pins,
                      max_leases=MAX_TENANT_LEASES, staging_share_bytes=MAX_STAGED_PER_TENANT,
                      tenants=dict(sorted(tenants.items())))


def check(books: Books) -> None:
    """Invariants 1 and 2 on every device (the tests and the simulator call
    it); a kept orphan slab's pages count as held (by no engine)."""
    in_slabs: dict[str, list[int]] = {name: [] for name in books.pools}
    adopted = dict.fromkeys(books.pools, 0)
    for e in (*books.engines.values(), *books.departing.values()):
        for s in e.slabs.values():
            for page_id, device in zip(s.pages, s.page_devices):
                in_slabs[device].append(page_id)
            adopted[e.device] += s.adopted_pages
    for name, pool in books.pools.items():
        pool.check(in_slabs[name] + books.orphans.pages_on(name), adopted[name])
    for e in (*books.engines.values(), *books.departing.values()):
        require(e.in_flight == {sid for sid, s in e.slabs.items() if s.phase is not Phase.HELD}, "in-flight slabs")
        require(e.unmapping == sum(s.phase is Phase.UNMAPPING for s in e.slabs.values()), "unmapping count")
