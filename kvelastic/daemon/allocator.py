"""The allocator: every decision of the daemon, over its books, with no I/O.

It takes one input at a time (a decoded message with its sender, a peer that
opened or closed, pages created, a tick) together with the current time, and
returns the effects (``effects.py``) the loop must perform. No sockets,
threads, clock or backend calls live here, so a seeded simulator drives it
exactly as the loop does.

Rules it keeps (the invariants the tests and the simulator check):
- A page is free in a device pool, or in exactly one slab of one engine
  record (registered, departing or failed). Pages created + adopted +
  being created never exceed a device's budget.
- A page is handed to another engine only as a fresh page: a free page keeps
  its last owner's tag and is reused only by that owner (engine id and
  namespace); for anyone else it is released and a new one created. The one
  exception stays inside a namespace: a slab given up for a grow of the same
  namespace and geometry is handed on as it is, with its cached blocks, and
  a departed engine's slab with valid cached blocks is kept (``orphans.py``)
  for the next engine of its namespace (``handoff.py``).
- Every wait has a deadline. A map or unmap not acknowledged in time fails
  the engine: its pages are quarantined (never re-lent) until every process
  of it is gone. A grow is answered by its deadline with what it got.
- Stopping the daemon unmaps nothing: engines keep their pages and adopt
  them again when they re-register; adopted slabs are checked against the
  budget, the engine's capacity and for duplicates.
- A message is checked whole before anything changes (a failed handler
  raises ``Rejected`` and leaves the books as they were).

It is composed of parts, each with one job and its own state, all handed the
same books (``books.py``): ``registration.py`` admits engines and workers,
``growth.py`` answers grows, ``reclaims.py`` asks memory back,
``unmapping.py`` takes slabs back, ``handoff.py`` decides where cache goes
with its pages, ``invalidation.py`` where it may no longer go. This module
routes each input to its part and decides an engine's departure and failure.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Iterator
from typing import Any

from kvelastic import protocol as p
from kvelastic.daemon import effects as fx
from kvelastic.daemon import journal_intake, report
from kvelastic.daemon.arbiter import Rules
from kvelastic.daemon.books import Books
from kvelastic.daemon.channels import OpenChannels
from kvelastic.daemon.events import journal_events
from kvelastic.daemon.growth import Growth
from kvelastic.daemon.handoff import CacheHandoff
from kvelastic.daemon.invalidation import CacheScope
from kvelastic.daemon.orphans import OrphanCache
from kvelastic.daemon.reclaims import Reclaims
from kvelastic.daemon.registration import LENT_GRACE, Registration
from kvelastic.daemon.rejected import RefusalLog, Rejected
from kvelastic.daemon.requests import GrowRequest, ReclaimRequest, ReturnRequest, Timing
from kvelastic.daemon.saved import Adoption, SavedLent, token_digest
from kvelastic.daemon.staging import Staging
from kvelastic.daemon.state import EngineRecord, PagePool, owner_tag
from kvelastic.daemon.tenancy import Credential
from kvelastic.daemon.tiering import Tiering
from kvelastic.daemon.unmapping import Unmapping
from kvelastic.errors import require
from kvelastic.kv_events import AllBlocksCleared, kv_events_topic
from kvelastic.status_report import RestartStatus, StatusReport
from kvelastic.tier.index import TierIndex
from kvelastic.tier.store import StoredBlock

log = logging.getLogger("kvelastic.daemon")

STARVED_RESET = 2.0          # no unmet demand for this long: the engine is no longer starved


class Allocator:
    def __init__(self, budgets: dict[str, int], page_size: int, *, backend: str = "host",
                 timing: Timing = Timing(), events: bool = True,
                 token_source: Callable[[], bytes] = lambda: secrets.token_bytes(16),
                 max_engines: int = 256, hash_secret: bytes | None = None,
                 aliases: dict[str, str] | None = None, tier: TierIndex | None = None) -> None:
        """``budgets``: device name -> budget in pages (the first is the default device).
        ``aliases``: other names of a device -> its name (a GPU's UUID, which
        a worker knows whatever ``CUDA_VISIBLE_DEVICES`` numbers it).
        ``hash_secret``: the key of the namespaces' hash seeds (``hash_seed``);
        the daemon keeps one across restarts, by default a fresh random one.
        ``tier``: the node's tier's index (its store is the loop's), or None."""
        self.books = books = Books(budgets, page_size, backend, timing, events)
        books.tier = tier
        self.tiering = Tiering(books)
        self.staging = Staging(books, self.tiering)     # source B: running engines' evictions
        self.cache = CacheHandoff(books, self.tiering)
        self.growth = Growth(books, self.cache)
        self.unmapping = Unmapping(books, self.cache, self.growth)
        self.reclaiming = Reclaims(books, self.cache, self.growth, self.unmapping)
        self.growth.wire(self.unmapping, self.reclaiming)
        self.scope = CacheScope(books, self.cache, self.growth)
        self.registration = Registration(
            books, self.growth, default_device=next(iter(budgets)), aliases=dict(aliases or {}),
            max_engines=max_engines, token_source=token_source,
            hash_secret=secrets.token_bytes(32) if hash_secret is None else hash_secret)
        self.refusals = RefusalLog()
        self._next_page = 0
        # Message type -> its part's handler. ``Any``: each handler takes its
        # own message type, which ``handle`` picked it by.
        self._handlers: dict[type[p.Msg], Callable[[bytes, Any], p.Msg | None]] = {
            p.RegisterEngine: self.registration.on_register_engine,
            p.RegisterWorker: self.registration.on_register_worker,
            p.Heartbeat: self.registration.on_heartbeat, p.SetLimit: self.registration.on_set_limit,
            p.Grow: self.growth.on_grow, p.Mapped: self.growth.on_mapped,
            p.ReclaimDone: self.reclaiming.on_reclaim_done,
            p.Return: self.unmapping.on_return, p.Unmapped: self.unmapping.on_unmapped,
            p.Busy: self.unmapping.on_busy,
            p.Invalidate: self.scope.on_invalidate, p.Diverge: self.scope.on_diverge,
            p.Journal: self._on_journal, p.Unregister: self._on_unregister, p.Status: self._on_status,
            p.TierLookup: self.tiering.on_lookup, p.TierFetch: self.tiering.on_fetch,
            p.TierRelease: self.tiering.on_release,
        }

    # The books and parts' state, as the loop, the simulator and the tests read them.
    @property
    def engines(self) -> dict[str, EngineRecord]:
        return self.books.engines

    @property
    def departing(self) -> dict[int, EngineRecord]:
        return self.books.departing

    @property
    def pools(self) -> dict[str, PagePool]:
        return self.books.pools

    @property
    def orphans(self) -> OrphanCache:
        return self.books.orphans

    @property
    def channels(self) -> OpenChannels:
        return self.books.channels

    @property
    def moves(self) -> dict[str, int]:
        return self.books.moves

    @property
    def thrash(self) -> dict[str, int]:
        return self.books.thrash

    @property
    def rules(self) -> Rules:
        return self.books.rules

    @property
    def page_size(self) -> int:
        return self.books.page_size

    @property
    def grows(self) -> dict[int, GrowRequest]:
        return self.growth.grows

    @property
    def reclaims(self) -> dict[int, ReclaimRequest]:
        return self.reclaiming.pending

    @property
    def returns(self) -> dict[tuple[bytes, int], ReturnRequest]:
        return self.unmapping.returns

    @property
    def more_work(self) -> bool:
        """A grow was paced: the loop calls ``resume`` at once."""
        return self.growth.more_work

    def status(self) -> StatusReport:
        return report.status(self.books, report.tier_shares(self.tiering, self.staging))

    def check(self) -> None:
        report.check(self.books)
        # Lent records held for claims: their pages are the daemon's, in no slab, free or kept.
        books, held, pending = self.books, self.registration.lent_pages(), self.registration.pending_pages()
        for device, pool in books.pools.items():
            require(pool.held_lent == pending.get(device, 0), f"device {device}: held lent pages miscounted")
        for device, pages in held.items():
            require(device in books.pools, f"a held lent record's page on unknown device {device}")
            elsewhere = set(books.pools[device].free) | set(books.orphans.pages_on(device)) | {
                pg for e in (*books.engines.values(), *books.departing.values()) for s in e.slabs.values()
                for pg, d in zip(s.pages, s.page_devices) if d == device}
            require(len(pages) == len(set(pages)) and elsewhere.isdisjoint(pages),
                    "a held lent record's page is named twice, or is free, kept or in a slab")

    # -------------------------------------------- the lent slabs, as saved (``saved.Saving``)
    def lent_version(self) -> tuple[int, ...]:
        """Moves whenever a running engine's slab (or a held record) comes or goes."""
        return (self.registration.lent_version,
                *(x for e in self.books.engines.values() for x in (e.serial, e.lent_changes)))

    def lent_new(self) -> Iterator[tuple[str, int, list[int]]]:
        """(engine, slab, pages) of the slabs started mapping since the last write."""
        for e in self.books.engines.values():
            for slab_id in e.lent_new:
                slab = e.slabs.get(slab_id)
                if slab is not None and slab.pages:
                    yield e.engine_id, slab_id, slab.pages

    def lent_records(self) -> list[SavedLent]:
        """Every running engine's slab with pages, and the held records of engines not back yet."""
        out = self.registration.records_to_save()
        for e in self.books.engines.values():
            if e.failed:
                continue
            digest = token_digest(e.token)
            out += [SavedLent(e.engine_id, e.namespace, e.uid, digest, s.slab_id, e.device, list(s.pages),
                              list(s.page_devices)) for s in e.slabs.values() if s.pages]
        return out

    def lent_written(self) -> None:
        for e in self.books.engines.values():
            e.lent_new.clear()

    # ================================================================ inputs
    def handle(self, identity: bytes, msg: p.Msg, now: float, cred: Credential | None = None) -> list[fx.Effect]:
        """One decoded message from ``identity``: its reply and everything it set off.
        ``cred``: who sent it, as the kernel says (None: an in-process caller,
        trusted as the daemon's own user). A tenant's engine ids and namespaces
        are qualified with its uid here, before any handler sees them."""
        books = self.books
        books.now = now
        books.cred = cred
        handler = self._handlers.get(type(msg))
        try:
            if handler is None:
                raise Rejected(p.Reason.UNEXPECTED, f"{type(msg).__name__} is not a request")
            if cred is not None and cred.tenant and not isinstance(msg, (p.SetLimit, p.Invalidate)):
                if hasattr(msg, "engine_id"):
                    msg.engine_id = cred.scope(msg.engine_id)
                if isinstance(msg, (p.RegisterEngine, p.Diverge)):
                    msg.namespace = cred.scope(msg.namespace)
            reply = handler(identity, msg)
        except Rejected as exc:
            engine_id = getattr(msg, "engine_id", "-")
            self.refusals.warn(exc.reason, engine_id, identity, "rejected %s from engine %s: %s (%s)",
                               type(msg).__name__, engine_id, exc, exc.reason.value)
            books.emit(fx.Rejected(exc.reason))
            reply = p.Error(reason=exc.reason.value, message=str(exc))
        if reply is not None:
            reply.req_id = msg.req_id
            books.emit(fx.Send(identity, reply))
        return books.take()

    def reject(self, identity: bytes, reason: p.Reason, message: str, req_id: int = 0) -> list[fx.Effect]:
        """A frame that could not be decoded: the loop's verdict, counted here too."""
        self.refusals.warn(reason, "-", identity, "rejected a frame: %s (%s)", message, reason.value)
        return [fx.Rejected(reason), fx.Send(identity, p.Error(req_id=req_id, reason=reason.value, message=message))]

    def peer_opened(self, engine_id: str, rank: int, now: float, token: bytes = b"") -> list[fx.Effect]:
        self.books.now = now
        self.books.channels.opened(engine_id, rank, token)
        self.growth.progress()
        return self.books.take()

    def peer_closed(self, engine_id: str, rank: int, now: float, token: bytes = b"") -> list[fx.Effect]:
        """A lifeline or page channel closed: that process is gone (or going).
        Only a channel that showed a record's secret speaks for it: closing
        one that did not (an impostor's, whatever rank it named) changes nothing."""
        books = self.books
        books.now = now
        books.channels.closed(engine_id, rank, token)
        for gone in books.departed(engine_id):
            if gone.token == token and not books.channels.alive(gone, rank):
                self.unmapping.settle_departed(gone)      # nothing of that process maps its pages now
        engine = books.engines.get(engine_id)
        if engine is None or engine.token != token or books.channels.alive(engine, rank):
            return books.take()     # not its secret, or another channel of that process is still open
        # A worker that never finished registering (it came back before its
        # engine after a daemon restart) takes nothing with it.
        if rank < 0 or rank in engine.workers:
            who = "engine" if rank < 0 else f"worker {rank}"
            engine.workers.pop(rank, None)
            self._drop(engine, f"{who} disconnected")
        return books.take()

    def channel_failed(self, engine_id: str, rank: int, why: str, now: float) -> list[fx.Effect]:
        """Page descriptors could not be sent to a worker in time: the engine is failed."""
        self.books.now = now
        engine = self.books.engines.get(engine_id)
        if engine is not None:
            self._fail(engine, f"page channel of worker {rank} failed: {why}")
        return self.books.take()

    def pages_unsent(self, engine_id: str, rank: int, slab_id: int, why: str, now: float) -> list[fx.Effect]:
        """The loop could not export a slab's pages for a worker (``Growth.pages_unsent``)."""
        self.books.now = now
        self.growth.pages_unsent(engine_id, rank, slab_id, why)
        return self.books.take()

    def pages_created(self, device: str, asked: int, page_ids: list[int], now: float) -> list[fx.Effect]:
        """The loop created ``page_ids`` (``asked`` were asked for; fewer: creation failed)."""
        self.books.now = now
        self.growth.pages_created(device, asked, page_ids)
        return self.books.take()

    def tier_written(self, committed: list[int], failed: list[tuple[int, str]], now: float) -> list[fx.Effect]:
        """The loop wrote a ``DemoteBlocks``' blocks (``failed``: slot, reason)."""
        self.books.now = now
        self.tiering.written(committed, failed)
        return self.books.take()

    def tier_copied(self, staged: list[int], failed: list[tuple[int, str]], now: float) -> list[fx.Effect]:
        """The loop staged a running engine's demoted blocks (source B)."""
        self.books.now = now
        self.staging.copied(staged, failed)
        return self.books.take()

    def tier_restored(self, entries: list[StoredBlock], now: float) -> list[fx.Effect]:
        """At start: the tier's store held ``entries``, now in the index (published to routers)."""
        self.books.now = now
        return [*self.tiering.restored(entries), *self.books.take()]

    def tier_deleted(self, slots: tuple[int, ...]) -> list[fx.Effect]:
        """The loop deleted the bytes of ``slots`` (a ``DeleteTierBlocks``, an
        effect of the input being performed: its clock, its books' effects)."""
        return self.tiering.deleted(slots)

    def tier_read(self, lease: int, block: int, error: str, now: float) -> list[fx.Effect]:
        """The loop sent a tier block's last chunk, or found it bad (``error``: why)."""
        self.books.now = now
        self.tiering.read(lease, block, error)
        return self.books.take()

    def new_page_ids(self, n: int) -> list[int]:
        """Ids for pages the loop creates (unique across devices)."""
        ids = list(range(self._next_page, self._next_page + n))
        self._next_page += n
        return ids

    @property
    def next_page(self) -> int:
        return self._next_page

    def skip_page_ids(self, below: int) -> None:
        """Never hand out an id below ``below`` (a predecessor's, which its keeper may still name)."""
        self._next_page = max(self._next_page, below)

    def adopt_kept(self, adoption: Adoption, status: RestartStatus, now: float | None = None) -> None:
        """Take back a predecessor's kept cache at start (``saved.adopt``
        chose it within ``room()``; the loop holds its pages now), and hold
        its lent records (and their pages) for their engines' claims for
        ``LENT_GRACE`` from ``now``; ``status``: all that was taken back, as
        ``status`` shows it."""
        if now is not None:
            self.books.now = now
        self.books.restart = status
        self.skip_page_ids(adoption.next_page)
        self.skip_page_ids(max((pg for rec in adoption.lent for pg in rec.pages), default=-1) + 1)
        self.registration.hold_lent(adoption.lent, dict.fromkeys(adoption.lent_gone, "dropped"),
                                    self.books.now + LENT_GRACE)
        for device, pages in adoption.pages.items():
            pool = self.books.pools[device]
            require(len(pages) <= pool.creatable(), f"device {device}: adopted kept cache over budget")
            pool.took_over(len(pages))
        self.books.orphans.adopt(adoption.kept)
        for o in adoption.kept:
            log.info("namespace %s: kept cache slab with %d cached block(s) of %s adopted from the last daemon",
                     o.namespace, len(o.cached), o.engine_id)

    def room(self) -> dict[str, int]:
        """Device -> pages that may still be created or adopted."""
        return {name: pool.creatable() for name, pool in self.books.pools.items()}

    def resume(self, now: float) -> list[fx.Effect]:
        """Go on with grows paced in an earlier pass (``more_work``)."""
        self.books.now = now
        self.growth.resume()
        return self.books.take()

    def tick(self, now: float) -> list[fx.Effect]:
        """Deadlines and idle work, a few times a second."""
        books = self.books
        books.now = now
        t = books.timing
        for engine in list(books.engines.values()):
            if now - engine.last_seen > t.heartbeat_timeout:
                # A stalled engine is not a dead one: while its lifeline is
                # open its process lives and maps its pages, and unmapping
                # them under it would crash it. Only the lifeline's end drops it.
                if not books.channels.alive(engine, -1):
                    self._drop(engine, f"no heartbeat for {now - engine.last_seen:.1f} s and no lifeline")
                    continue
                if engine.silent(True):
                    log.warning("engine %s: no heartbeat for %.1f s, but its process is alive (lifeline open): "
                                "kept, with its memory", engine.engine_id, now - engine.last_seen)
            if engine.overdue(now):
                self._fail(engine, f"no map/unmap acknowledgement within {t.ack_timeout:g} s")
            engine.stopped_asking(now, STARVED_RESET)
        for gone in list(books.departing.values()):
            if not gone.failed and gone.overdue(now):
                self.unmapping.quarantine(gone, f"no unmap acknowledgement within {t.ack_timeout:g} s")
        self.reclaiming.expire()
        self.registration.expire_lent()
        self.cache.expire()
        self.tiering.expire()
        self.staging.expire()
        self.growth.progress()
        self._release_stale()
        return books.take()

    def shutdown(self) -> list[fx.Effect]:
        """The daemon stops: nothing is unmapped (engines keep serving from what
        they hold and adopt it again from the next daemon); pages are only let go."""
        books = self.books
        out: list[fx.Effect] = [fx.ReleasePages(name, tuple(pool.free))
                                for name, pool in books.pools.items() if pool.free]
        kept = [(o.pages, o.page_devices) for o in books.orphans]   # the cache kept dies with the daemon
        kept += [(rec.pages, rec.page_devices) for rec in self.registration.held_records()]
        for engine in (*books.engines.values(), *books.departing.values()):
            kept += [(slab.pages, slab.page_devices) for slab in engine.slabs.values()]
        for pages, devices in kept:
            for device in set(devices):
                out.append(fx.ReleasePages(device, tuple(pg for pg, d in zip(pages, devices) if d == device)))
        return out

    def worker_identity(self, engine_id: str, rank: int, token: bytes) -> bytes | None:
        """The control identity of worker ``rank`` of the registration (live or
        departing) whose secret is ``token``: whom an ack on a page channel
        that showed that secret speaks for. None: no such worker registered."""
        for engine in (self.books.engines.get(engine_id), *self.books.departed(engine_id)):
            if engine is not None and engine.token == token and rank in engine.workers:
                return engine.workers[rank]
        return None

    # ========================================================= small requests
    def _on_unregister(self, identity: bytes, m: p.Unregister) -> p.Msg:
        self._drop(self.books.own_engine(identity, m.engine_id), "unregistered")
        return p.Ok()

    def _on_status(self, identity: bytes, m: p.Status) -> p.Msg:
        return p.StatusReply(status=self.status())

    def _on_journal(self, identity: bytes, m: p.Journal) -> p.Msg | None:
        books = self.books
        if m.engine_id not in books.engines:
            for gone in books.departed(m.engine_id):
                if gone.identity == identity and not gone.failed:
                    journal_intake.accept_departed(gone, m)
                    return p.Ok() if m.sync else None
        engine = books.own_engine(identity, m.engine_id)
        try:
            journal_intake.accept(engine, m, books.now)
        except Rejected:
            self.staging.refused(engine)     # the drops it carried are unknown
            raise
        self.staging.journal(engine, m)
        if books.events:
            events = journal_events(m.ops, engine.block_tokens, engine.key_group_suffix, books.medium)
            if events:
                books.emit(fx.Publish(kv_events_topic(engine.engine_id, engine.namespace), tuple(events)))
        return p.Ok() if m.sync else None

    # ============================================================ engine death
    def _forget(self, engine: EngineRecord, why: str) -> None:
        """Take ``engine`` off the books: its grows are answered and its reclaims end now."""
        books = self.books
        del books.engines[engine.engine_id]
        self.growth.answer_gone(engine, why)
        self.reclaiming.end_for(engine.engine_id)
        self.tiering.end_for(engine)      # no pin outlives its engine
        self.staging.end_for(engine)      # nor a copy it did not confirm
        self.registration.departed(engine)   # its slabs never take their saved pages now
        if books.events:  # its prefix cache is gone with it
            books.emit(fx.Publish(kv_events_topic(engine.engine_id, engine.namespace), (AllBlocksCleared(),)))
        books.departing[engine.serial] = engine

    def _drop(self, engine: EngineRecord, why: str) -> None:
        """The engine left (or died): every slab is unmapped by the workers still there."""
        if self.books.engines.get(engine.engine_id) is not engine:
            return
        kept = self.cache.mark_orphans(engine)
        log.log(logging.INFO if why == "unregistered" else logging.WARNING,
                "engine %s %s: returning its %d slab(s)%s", engine.engine_id,
                why if why == "unregistered" else f"gone ({why})", len(engine.slabs),
                f", {kept} with valid cache kept for namespace {engine.namespace}" if kept else "")
        self._forget(engine, why)
        self.unmapping.unmap_all(engine)
        self.growth.progress()

    def _fail(self, engine: EngineRecord, why: str) -> None:
        """The engine missed a deadline: quarantine its pages, close its peers."""
        if self.books.engines.get(engine.engine_id) is not engine:
            return
        self._forget(engine, why)
        self.unmapping.quarantine(engine, why)
        # Told, so it stops short of more grows and its operator sees why it
        # must restart; its pages stay quarantined while its processes live.
        self.books.emit(fx.Send(engine.identity, p.Failed(reason=why)))
        self.growth.progress()

    def _release_stale(self) -> None:
        """Idle work: free pages of owners no longer registered go back to the
        driver (or the kernel), a batch per tick."""
        live = {owner_tag(e) for e in self.books.engines.values()}
        for device, pool in self.books.pools.items():
            stale = pool.take_orphaned(live, 64)
            if stale:
                self.books.emit(fx.ReleasePages(device, tuple(stale)))
