"""What the allocator shows: the status report and its own invariant check.

A mixin of ``Allocator`` (``allocator.py``); read-only over its books.
"""

from __future__ import annotations

from kvelastic.daemon.arbiter import Rules, is_idle
from kvelastic.daemon.orphans import OrphanCache
from kvelastic.daemon.state import EngineRecord, PagePool, Phase
from kvelastic.errors import require
from kvelastic.status_report import EngineStatus, MemoryStatus, PageCounts, StatusReport


class Reporting:
    # The allocator's books it reads (``Allocator.__init__`` sets them).
    pools: dict[str, PagePool]
    engines: dict[str, EngineRecord]
    departing: dict[int, EngineRecord]
    orphans: OrphanCache
    backend: str
    page_size: int
    rules: Rules
    moves: dict[str, int]
    thrash: dict[str, int]
    _now: float

    def status(self) -> StatusReport:
        held = dict.fromkeys(self.pools, 0)
        cached = dict.fromkeys(self.pools, 0)
        quarantined = dict.fromkeys(self.pools, 0)
        for e in (*self.engines.values(), *self.departing.values()):
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
        for e in self.engines.values():
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
                idle=is_idle(e, self._now, self.rules), private=e.private,
                worker_devices={str(r): d for r, d in sorted(e.worker_devices.items())},
                starved_seconds=0.0 if e.starved_since is None else self._now - e.starved_since))
        devices = [pool.status(name, self.backend, held[name], cached[name], self.page_size, quarantined[name])
                   for name, pool in self.pools.items()]
        for d in devices:
            d.slab_moves, d.thrash = self.moves[d.device], self.thrash[d.device]
            d.memory.orphaned = len(self.orphans.pages_on(d.device)) * self.page_size
            d.kept_evictions = self.orphans.evictions_on(d.device)
        return StatusReport(
            device=devices[0].device, backend=self.backend, page_size=self.page_size,
            budget_bytes=sum(d.budget_bytes for d in devices),
            memory=MemoryStatus(**{k: sum(getattr(d.memory, k) for d in devices)
                                     for k in ("held", "cached", "free", "unallocated", "orphaned")}),
            pages=PageCounts(**{k: sum(getattr(d.pages, k) for d in devices)
                                  for k in ("created", "free", "adopted", "quarantined")}),
            devices=devices, engines=engines, orphans=self.orphans.status(self._now, self.page_size))

    def check(self) -> None:
        """Invariants 1 and 2 on every device (the tests and the simulator call
        it); a kept orphan slab's pages count as held (by no engine)."""
        in_slabs: dict[str, list[int]] = {name: [] for name in self.pools}
        adopted = dict.fromkeys(self.pools, 0)
        for e in (*self.engines.values(), *self.departing.values()):
            for s in e.slabs.values():
                for page_id, device in zip(s.pages, s.page_devices):
                    in_slabs[device].append(page_id)
                adopted[e.device] += s.adopted_pages
        for name, pool in self.pools.items():
            pool.check(in_slabs[name] + self.orphans.pages_on(name), adopted[name])
        for e in (*self.engines.values(), *self.departing.values()):
            require(e.in_flight == {sid for sid, s in e.slabs.items() if s.phase is not Phase.HELD}, "in-flight slabs")
            require(e.unmapping == sum(s.phase is Phase.UNMAPPING for s in e.slabs.values()), "unmapping count")
