"""Invariants the simulator checks from its own side, independent of the
allocator's self-check (``Allocator.check``), written against the books'
values only (``Allocator.departing`` is iterated, whatever it is keyed by):

- every page alive on the device is in exactly one place: free, in one slab
  of one record (registered engines and departing registrations, an engine
  id registered again meanwhile included), or in the kept cache; the budget
  holds;
- a page some worker process maps (an engine's, or a ghost's: a worker of an
  earlier registration still running) is neither free, kept, nor in a slab
  of another registration;
- acknowledgement deadlines: a record is failed only when one of its workers
  owed an ack for the whole deadline (a long step that says ``Busy`` owes
  nothing older than its last Busy), and an ack owed past it fails the
  record or ends the wait (a frozen worker is failed, as ever).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvelastic.daemon.state import EngineRecord, Phase

if TYPE_CHECKING:
    from kvelastic_tools.sim.world import World


def pages(w: World) -> None:
    """Every page alive is in exactly one place, within the budget; and a
    page a worker process maps belongs to that worker's registration (by its
    secret): not free, not kept, not in a slab of another registration."""
    alloc = w.allocator
    owner: dict[int, bytes] = {}               # page in a slab -> its registration's secret
    in_slabs = 0
    for records in (alloc.engines.values(), alloc.departing.values()):
        for record in records:
            for slab in record.slabs.values():
                if slab.pages:
                    in_slabs += len(slab.pages)
                    owner.update(dict.fromkeys(slab.pages, record.token))
    pool = alloc.pools["0"]
    # The pages of lent records a new daemon holds for their engines' claims
    # (keeper.py) are the daemon's too, in a part of their own: counted with the kept.
    held_lent = alloc.registration.lent_pages().get("0", [])
    free, kept, alive = pool.free, alloc.orphans.pages_on("0"), w.device.pages
    orphaned, kept = kept, kept + held_lent
    # A partition of the pages alive: each part inside, no two overlapping, the sizes adding up.
    slabs = owner.keys()
    if len(owner) != in_slabs or in_slabs + len(free) + len(kept) != len(alive) or not alive.issuperset(slabs) \
            or not alive.issuperset(free) or not alive.issuperset(kept) or not slabs.isdisjoint(free) \
            or not slabs.isdisjoint(kept) or not free.keys().isdisjoint(kept):
        every = set(slabs) | set(free) | set(kept)
        w.violation(f"pages: not each in exactly one place (free, a slab of one registration, kept): lost "
                    f"{sorted(alive - every)[:5]}, booked but not alive {sorted(every - alive)[:5]}, in two "
                    f"places {sorted((slabs & set(free)) | (slabs & set(kept)))[:5] or '(two slabs)'}")
    # (the pages of claimed lent records awaiting their workers count as their adopted slabs)
    if len(alive) - alloc.registration.awaiting_pages() + pool.adopted + pool.creating > pool.budget_pages:
        w.violation(f"over budget: {len(alive)} pages alive + {pool.adopted} adopted + {pool.creating} being "
                    f"created > {pool.budget_pages}")
    for worker in w.mappers():
        for slab_id, mapped in worker.mapped.items():
            if set(map(owner.get, mapped)) == {worker.token}:
                continue                       # its own registration's: the usual case
            for page in mapped:
                booked = owner.get(page)
                where = "free in the daemon" if page in free else "kept cache" if page in orphaned else \
                    "in a slab of another registration" if booked not in (None, worker.token) else ""
                if where:                      # (not booked at all: a page of an earlier daemon, adopted)
                    w.violation(f"page {page} that worker {worker.identity!r} maps (slab {slab_id}) is {where}")


def acks(w: World) -> None:
    """Right after a tick (failures happen there): each newly failed record
    owed an ack for the whole deadline; no ack is owed past it unnoticed."""
    alloc, now, limit = w.allocator, w.now, w.timing.ack_timeout
    records = (*alloc.engines.values(), *alloc.departing.values())
    if not any(r.failed and id(r) not in w.failed_seen for r in records) \
            and all(now - since <= limit + 1e-6 for since, _slab, _unmap in w.owed.values()):
        return                                      # the usual case: nothing failed, nothing overdue
    by_identity: dict[bytes, tuple[EngineRecord, int]] = {}
    for record in records:
        for rank, identity in record.workers.items():
            by_identity[identity] = (record, rank)
    latest: dict[tuple[bytes, int], float] = {}       # (worker, slab) -> the newest reason to wait from
    for (identity, _req), (since, owed_slab, _unmap) in w.owed.items():
        key = (identity, owed_slab)
        latest[key] = max(since, latest.get(key, since))
    for record in records:
        if not record.failed or id(record) in w.failed_seen:
            continue
        w.failed_seen[id(record)] = record
        w.counts["engines_failed"] += 1
        if record.engine_id in w.excused:           # its page channel failed: a failure with cause
            w.excused.discard(record.engine_id)
            continue
        mine = set(record.workers.values())
        if not any(now - since >= limit - 1e-9 for (identity, _slab), since in latest.items() if identity in mine):
            busy = max((w.busy_heard.get(identity, -1e9) for identity in mine), default=-1e9)
            w.violation(f"engine {record.engine_id} was failed, but none of its workers owed an ack for {limit:g} s: "
                        + (f"a long step held its unmaps and said Busy ({now - busy:.2f} s ago)" if now - busy < limit
                           else "each acknowledged in time"))
    for (identity, slab_id), since in latest.items():
        if now - since <= limit + 1e-6:
            continue
        found = by_identity.get(identity)
        if found is None or found[0].failed:
            continue
        record, rank = found
        slab = record.slabs.get(slab_id)
        if slab is not None and slab.phase is not Phase.HELD and rank in slab.waiting:
            sibling = any(now - w.busy_heard.get(other, -1e9) < limit
                          for r, other in record.workers.items() if r != rank)
            w.violation(f"worker {rank} of {record.engine_id} owes the ack of slab {slab_id} for {now - since:.2f} s "
                        f"(no Busy): the daemon neither failed it nor stopped waiting ({limit:g} s deadline)"
                        + ("; another worker of it said Busy meanwhile: a deadline is per rank" if sibling else ""))
