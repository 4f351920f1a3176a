"""The allocator: the daemon's books and every decision, with no I/O.

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
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable
from typing import Any, ClassVar

from kvelastic import protocol as p
from kvelastic.daemon import effects as fx
from kvelastic.daemon import journal_intake
from kvelastic.daemon.arbiter import Rules, pick_victims
from kvelastic.daemon.channels import OpenChannels
from kvelastic.daemon.events import journal_events
from kvelastic.daemon.growth import Growth
from kvelastic.daemon.handoff import CacheHandoff
from kvelastic.daemon.invalidation import CacheScope
from kvelastic.daemon.orphans import OrphanCache
from kvelastic.daemon.registration import Registration
from kvelastic.daemon.rejected import RefusalLog, Rejected
from kvelastic.daemon.report import Reporting
from kvelastic.daemon.requests import GrowRequest, Handoff, ReclaimRequest, ReturnRequest, Timing
from kvelastic.daemon.state import EngineRecord, PagePool, Phase, SlabRecord, owner_tag
from kvelastic.daemon.tenancy import Credential
from kvelastic.kv_events import AllBlocksCleared, kv_events_topic

log = logging.getLogger("kvelastic.daemon")

STARVED_RESET = 2.0          # no unmet demand for this long: the engine is no longer starved


class Allocator(Registration, Growth, CacheHandoff, CacheScope, Reporting):
    def __init__(self, budgets: dict[str, int], page_size: int, *, backend: str = "host",
                 timing: Timing = Timing(), events: bool = True,
                 token_source: Callable[[], bytes] = lambda: secrets.token_bytes(16),
                 max_engines: int = 256, hash_secret: bytes | None = None,
                 aliases: dict[str, str] | None = None) -> None:
        """``budgets``: device name -> budget in pages (the first is the default device).
        ``aliases``: other names of a device -> its name (a GPU's UUID, which
        a worker knows whatever ``CUDA_VISIBLE_DEVICES`` numbers it).
        ``hash_secret``: the key of the namespaces' hash seeds (``hash_seed``);
        the daemon keeps one across restarts, by default a fresh random one."""
        self.pools = {name: PagePool(pages) for name, pages in budgets.items()}
        self.backend = backend
        self.medium = "GPU" if backend == "cuda" else "CPU"
        self.default_device = next(iter(budgets))
        self.device_aliases = dict(aliases or {})
        self.page_size = page_size
        self.timing = timing
        self.rules = Rules(idle_grace=timing.idle_grace, hold_down=timing.hold_down)
        self.moves = dict.fromkeys(budgets, 0)     # device -> slabs moved between engines
        self.thrash = dict.fromkeys(budgets, 0)    # device -> moves back within THRASH_WINDOW
        self.events = events
        self.engines: dict[str, EngineRecord] = {}
        # Engines gone from the books whose slabs still wait for their workers
        # (unmap acks, or their processes to exit when they failed), by their
        # registration's serial: an id registered again meanwhile never
        # overwrites its predecessor's record (no page leaves the books).
        self.departing: dict[int, EngineRecord] = {}
        self._serial = 0
        self._cred: Credential | None = None       # the sender of the message being handled
        self.orphans = OrphanCache()                      # departed engines' cache, kept for their namespace
        self.grows: dict[int, GrowRequest] = {}           # by arrival: answered in order
        self._grow_seq = 0
        self._progressing = self._again = self.more_work = False
        self.export_failed_at = -1e9
        self._started = 0
        self.reclaims: dict[int, ReclaimRequest] = {}
        self.returns: dict[tuple[bytes, int], ReturnRequest] = {}   # by (client, Return req_id)
        self.channels = OpenChannels()     # which processes of each engine are alive
        self._token_source = token_source
        self.hash_secret = secrets.token_bytes(32) if hash_secret is None else hash_secret
        self._next_req = 1 << 32
        self.refusals = RefusalLog()
        self.max_engines = max_engines
        self._next_page = 0
        self._now = 0.0
        self._out: list[fx.Effect] = []

    # ================================================================ inputs
    def handle(self, identity: bytes, msg: p.Msg, now: float, cred: Credential | None = None) -> list[fx.Effect]:
        """One decoded message from ``identity``: its reply and everything it set off.
        ``cred``: who sent it, as the kernel says (None: an in-process caller,
        trusted as the daemon's own user). A tenant's engine ids and namespaces
        are qualified with its uid here, before any handler sees them."""
        self._now = now
        self._cred = cred
        handler = self._HANDLERS.get(type(msg))
        try:
            if handler is None:
                raise Rejected(p.Reason.UNEXPECTED, f"{type(msg).__name__} is not a request")
            if cred is not None and cred.tenant and not isinstance(msg, (p.SetLimit, p.Invalidate)):
                if hasattr(msg, "engine_id"):
                    msg.engine_id = cred.scope(msg.engine_id)
                if isinstance(msg, (p.RegisterEngine, p.Diverge)):
                    msg.namespace = cred.scope(msg.namespace)
            reply = handler(self, identity, msg)
        except Rejected as exc:
            engine_id = getattr(msg, "engine_id", "-")
            self.refusals.warn(exc.reason, engine_id, identity, "rejected %s from engine %s: %s (%s)",
                           type(msg).__name__, engine_id, exc, exc.reason.value)
            self._out.append(fx.Rejected(exc.reason))
            reply = p.Error(reason=exc.reason.value, message=str(exc))
        if reply is not None:
            reply.req_id = msg.req_id
            self._out.append(fx.Send(identity, reply))
        return self._take()

    def reject(self, identity: bytes, reason: p.Reason, message: str, req_id: int = 0) -> list[fx.Effect]:
        """A frame that could not be decoded: the loop's verdict, counted here too."""
        self.refusals.warn(reason, "-", identity, "rejected a frame: %s (%s)", message, reason.value)
        return [fx.Rejected(reason), fx.Send(identity, p.Error(req_id=req_id, reason=reason.value, message=message))]

    def _operator(self, what: str) -> None:
        """Refuse ``what`` unless the sender holds the operator's credential."""
        cred = self._cred
        if cred is not None and not cred.operator:
            raise Rejected(p.Reason.NOT_OPERATOR, f"{what} needs the operator's credential (root, the daemon's "
                                                  f"user or the operator group); uid {cred.uid} is a tenant")

    def departed(self, engine_id: str) -> list[EngineRecord]:
        """Departing records of ``engine_id`` (earlier registrations of it)."""
        return [e for e in self.departing.values() if e.engine_id == engine_id]

    def peer_opened(self, engine_id: str, rank: int, now: float, token: bytes = b"") -> list[fx.Effect]:
        self._now = now
        self.channels.opened(engine_id, rank, token)
        self._progress_grows()
        return self._take()

    def peer_closed(self, engine_id: str, rank: int, now: float, token: bytes = b"") -> list[fx.Effect]:
        """A lifeline or page channel closed: that process is gone (or going).
        Only a channel that showed a record's secret speaks for it: closing
        one that did not (an impostor's, whatever rank it named) changes nothing."""
        self._now = now
        self.channels.closed(engine_id, rank, token)
        for gone in self.departed(engine_id):
            if gone.token == token and not self.channels.alive(gone, rank):
                self._settle_departed(gone)      # nothing of that process maps its pages now
        engine = self.engines.get(engine_id)
        if engine is None or engine.token != token or self.channels.alive(engine, rank):
            return self._take()     # not its secret, or another channel of that process is still open
        # A worker that never finished registering (it came back before its
        # engine after a daemon restart) takes nothing with it.
        if rank < 0 or rank in engine.workers:
            who = "engine" if rank < 0 else f"worker {rank}"
            engine.workers.pop(rank, None)
            self._drop(engine, f"{who} disconnected")
        return self._take()

    def channel_failed(self, engine_id: str, rank: int, why: str, now: float) -> list[fx.Effect]:
        """Page descriptors could not be sent to a worker in time: the engine is failed."""
        self._now = now
        engine = self.engines.get(engine_id)
        if engine is not None:
            self._fail(engine, f"page channel of worker {rank} failed: {why}")
        return self._take()

    def pages_unsent(self, engine_id: str, rank: int, slab_id: int, why: str, now: float) -> list[fx.Effect]:
        """The loop could not export a slab's pages for a worker (the daemon is
        out of descriptors): nothing was sent to it, and the slab fails to map
        as if that worker had said so. The engine is not at fault."""
        self._now = now
        engine = self.engines.get(engine_id)
        slab = engine.slabs.get(slab_id) if engine is not None else None
        self.export_failed_at = now
        if engine is not None and slab is not None and slab.phase is Phase.MAPPING and rank in slab.waiting:
            log.error("engine %s: pages of slab %d not sent to worker %d: %s", engine_id, slab_id, rank, why)
            slab.waiting.discard(rank)
            slab.failed = True
            if not slab.waiting:
                self._mapped(engine, slab)
        return self._take()

    def pages_created(self, device: str, asked: int, page_ids: list[int], now: float) -> list[fx.Effect]:
        """The loop created ``page_ids`` (``asked`` were asked for; fewer: creation failed)."""
        self._now = now
        pool = self.pools[device]
        pool.creating -= asked
        pool.created += len(page_ids)
        for page_id in page_ids:
            pool.free[page_id] = ""
        if len(page_ids) < asked:
            log.error("device %s: created %d of %d page(s)", device, len(page_ids), asked)
            pool.creation_failed_at = now
        self._progress_grows()
        return self._take()

    def new_page_ids(self, n: int) -> list[int]:
        """Ids for pages the loop creates (unique across devices)."""
        ids = list(range(self._next_page, self._next_page + n))
        self._next_page += n
        return ids

    def resume(self, now: float) -> list[fx.Effect]:
        """Go on with grows paced in an earlier pass (``more_work``)."""
        self._now = now
        self.more_work = False
        self._progress_grows()
        return self._take()

    def tick(self, now: float) -> list[fx.Effect]:
        """Deadlines and idle work, a few times a second."""
        self._now = now
        t = self.timing
        for engine in list(self.engines.values()):
            if now - engine.last_seen > t.heartbeat_timeout:
                # A stalled engine is not a dead one: while its lifeline is
                # open its process lives and maps its pages, and unmapping
                # them under it would crash it. Only the lifeline's end drops it.
                if not self.channels.alive(engine, -1):
                    self._drop(engine, f"no heartbeat for {now - engine.last_seen:.1f} s and no lifeline")
                    continue
                if not engine.unresponsive:
                    engine.unresponsive = True
                    log.warning("engine %s: no heartbeat for %.1f s, but its process is alive (lifeline open): "
                                "kept, with its memory", engine.engine_id, now - engine.last_seen)
            if engine.overdue(now):
                self._fail(engine, f"no map/unmap acknowledgement within {t.ack_timeout:g} s")
            if engine.starved_since is not None and now - engine.last_unmet > STARVED_RESET:
                engine.starved_since = None   # it stopped asking: its demand went away
        for gone in list(self.departing.values()):
            if not gone.failed and gone.overdue(now):
                self._quarantine(gone, f"no unmap acknowledgement within {t.ack_timeout:g} s")
        for rid, rec in list(self.reclaims.items()):
            if now > rec.deadline:
                del self.reclaims[rid]
                log.warning("engine %s: no answer to a reclaim of %d slab(s): treated as refused",
                            rec.engine_id, len(rec.slabs))
                rec.grow.reclaims.discard(rid)
        self._expire_orphans()
        self._progress_grows()
        self._release_stale()
        return self._take()

    def shutdown(self) -> list[fx.Effect]:
        """The daemon stops: nothing is unmapped (engines keep serving from what
        they hold and adopt it again from the next daemon); pages are only let go."""
        out: list[fx.Effect] = [fx.ReleasePages(name, tuple(pool.free))
                                for name, pool in self.pools.items() if pool.free]
        kept = [(o.pages, o.page_devices) for o in self.orphans]   # the cache kept dies with the daemon
        for engine in (*self.engines.values(), *self.departing.values()):
            kept += [(slab.pages, slab.page_devices) for slab in engine.slabs.values()]
        for pages, devices in kept:
            for device in set(devices):
                out.append(fx.ReleasePages(device, tuple(pg for pg, d in zip(pages, devices) if d == device)))
        return out

    # ================================================================ engines
    def _engine(self, engine_id: str) -> EngineRecord:
        engine = self.engines.get(engine_id)
        if engine is None:
            raise Rejected(p.Reason.UNKNOWN_ENGINE, f"engine {engine_id!r} is not registered")
        return engine

    def _own_engine(self, identity: bytes, engine_id: str) -> EngineRecord:
        """The engine ``engine_id``, if ``identity`` is the connection that registered it."""
        engine = self._engine(engine_id)
        if identity != engine.identity:
            raise Rejected(p.Reason.NOT_OWNER, f"engine {engine_id!r} was registered by another connection")
        return engine

    def _on_heartbeat(self, identity: bytes, m: p.Heartbeat) -> None:
        engine = self._own_engine(identity, m.engine_id)
        engine.last_seen = self._now
        if engine.unresponsive:
            engine.unresponsive = False
            log.info("engine %s: heartbeats again", engine.engine_id)

    def _on_busy(self, identity: bytes, m: p.Busy) -> None:
        """A worker in a long model step holds these unmaps until it ends: their
        deadline moves on (a frozen worker sends nothing and still misses it)."""
        engine = self._record_of_worker(identity, m.engine_id, m.rank)
        if engine is None or engine.failed:
            raise Rejected(p.Reason.UNEXPECTED_ACK, f"engine {m.engine_id} worker {m.rank}: no unmap pending")
        deadline = self._now + self.timing.ack_timeout
        for slab_id in m.slabs:
            slab = engine.slabs.get(slab_id)
            if slab is not None and slab.phase is Phase.UNMAPPING and m.rank in slab.waiting:
                slab.busy_until[m.rank] = max(slab.busy_until.get(m.rank, 0.0), deadline)

    def worker_identity(self, engine_id: str, rank: int, token: bytes) -> bytes | None:
        """The control identity of worker ``rank`` of the registration (live or
        departing) whose secret is ``token``: whom an ack on a page channel
        that showed that secret speaks for. None: no such worker registered."""
        for engine in (self.engines.get(engine_id), *self.departed(engine_id)):
            if engine is not None and engine.token == token and rank in engine.workers:
                return engine.workers[rank]
        return None

    def _record_of_worker(self, identity: bytes, engine_id: str, rank: int) -> EngineRecord | None:
        """The registration (live or departing) whose worker ``rank`` registered on ``identity``."""
        for engine in (self.engines.get(engine_id), *self.departed(engine_id)):
            if engine is not None and engine.workers.get(rank) == identity:
                return engine
        return None

    def _on_unregister(self, identity: bytes, m: p.Unregister) -> p.Msg:
        self._drop(self._own_engine(identity, m.engine_id), "unregistered")
        return p.Ok()

    def _on_set_limit(self, identity: bytes, m: p.SetLimit) -> p.Msg:
        self._operator("setting an engine's limits")
        engine = self._engine(m.engine_id)
        if m.min_bytes < 0 or m.max_bytes < 0 or (m.max_bytes and m.min_bytes > m.max_bytes):
            raise Rejected(p.Reason.LIMIT, f"need 0 <= min <= max, got min {m.min_bytes} max {m.max_bytes}")
        if m.min_bytes > self.pools[engine.device].budget_pages * self.page_size:
            raise Rejected(p.Reason.LIMIT, f"min {m.min_bytes} exceeds the device budget")
        engine.min_bytes, engine.max_bytes = m.min_bytes, m.max_bytes
        log.info("engine %s: limits set to min %d max %d bytes", engine.engine_id, m.min_bytes, m.max_bytes)
        return p.Ok()

    def _on_status(self, identity: bytes, m: p.Status) -> p.Msg:
        return p.StatusReply(status=self.status())

    # ================================================================ journal
    def _on_journal(self, identity: bytes, m: p.Journal) -> p.Msg | None:
        if m.engine_id not in self.engines:
            for gone in self.departed(m.engine_id):
                if gone.identity == identity and not gone.failed:
                    journal_intake.accept_departed(gone, m)
                    return p.Ok() if m.sync else None
        engine = self._own_engine(identity, m.engine_id)
        journal_intake.accept(engine, m, self._now)
        if self.events:
            events = journal_events(m.ops, engine.block_tokens, engine.key_group_suffix, self.medium)
            if events:
                self._out.append(fx.Publish(kv_events_topic(engine.engine_id, engine.namespace), tuple(events)))
        return p.Ok() if m.sync else None

    # ====================================================== return / reclaim
    def _on_return(self, identity: bytes, m: p.Return) -> p.Msg | None:
        engine = self._own_engine(identity, m.engine_id)
        for slab_id in m.slabs:
            slab = engine.slabs.get(slab_id)
            if slab is None or slab.phase is not Phase.HELD:
                raise Rejected(p.Reason.NOT_HELD, f"engine {m.engine_id} does not hold slab {slab_id}")
        if len(set(m.slabs)) != len(m.slabs):
            raise Rejected(p.Reason.NOT_HELD, f"engine {m.engine_id} returned a slab twice in one message")
        # The reply waits until every worker unmapped: then the memory is really back.
        if not m.slabs:
            return p.Ok()
        self.returns[(identity, m.req_id)] = ReturnRequest(identity, m.req_id, set(m.slabs))
        log.info("engine %s: returned %d slab(s)", engine.engine_id, len(m.slabs))
        for slab_id in m.slabs:
            engine.returns += 1
            engine.slabs[slab_id].return_req = (identity, m.req_id)
            self._start_unmap(engine, engine.slabs[slab_id])
        return None

    def _reclaim_for(self, req: GrowRequest, requester: EngineRecord, short: int) -> None:
        # Not twice, and not a slab mapped for a grow still in progress: its
        # engine does not hold it yet and would refuse.
        exclude = frozenset({(r.engine_id, s) for r in self.reclaims.values() for s in r.slabs}
                            | {(r.engine_id, s) for r in self.grows.values() for s in r.slabs})
        victims = pick_victims(list(self.engines.values()), requester, short, self._now, self.rules, exclude)
        by_engine: dict[str, list[int]] = {}
        for engine, slab_id in victims:
            by_engine.setdefault(engine.engine_id, []).append(slab_id)
        for engine_id, slabs in by_engine.items():
            rid = self._command(self.engines[engine_id].identity, p.Reclaim(slabs=slabs))
            self.reclaims[rid] = ReclaimRequest(engine_id, slabs, req, self._now + self.timing.reclaim_timeout)
            req.reclaims.add(rid)
            log.info("engine %s: asked to give up %d slab(s) for engine %s", engine_id, len(slabs),
                     requester.engine_id)

    def _on_reclaim_done(self, identity: bytes, m: p.ReclaimDone) -> None:
        self._own_engine(identity, m.engine_id)
        rec = self.reclaims.get(m.req_id)
        if rec is None or rec.engine_id != m.engine_id:
            raise Rejected(p.Reason.UNEXPECTED_ACK, f"engine {m.engine_id}: no reclaim {m.req_id} pending")
        if not set(m.given) <= set(rec.slabs) or not set(m.refused) <= set(rec.slabs):
            raise Rejected(p.Reason.BAD_REQUEST, f"engine {m.engine_id} answered for slabs it was not asked for")
        engine = self._engine(m.engine_id)
        del self.reclaims[m.req_id]
        requester = self.engines.get(rec.grow.engine_id)
        for slab_id in m.given:
            slab = engine.slabs.get(slab_id)
            if slab is not None and slab.phase is Phase.HELD:
                engine.reclaims += 1
                rec.grow.incoming.add((engine.engine_id, slab_id))
                self._moved(engine, rec.grow.engine_id)
                cached = m.cached.get(slab_id)
                if cached and requester is not None and self._may_hand_on(engine, requester, cached):
                    slab.handoff, slab.handoff_to = tuple(cached), rec.grow.seq
                self._start_unmap(engine, slab)
        if m.refused:
            log.info("engine %s: refused %d slab(s) (in use again)", m.engine_id, len(m.refused))
        rec.grow.reclaims.discard(m.req_id)
        self._progress_grows()

    def _moved(self, source: EngineRecord, to_id: str) -> None:
        """A slab of ``source`` goes to engine ``to_id``: counted, and thrash if it
        is a move back (``source`` got memory from ``to_id`` moments ago)."""
        self.moves[source.device] += 1
        if self._now - source.received_from.get(to_id, -1e18) < p.THRASH_WINDOW:
            self.thrash[source.device] += 1
            log.warning("engine %s: memory moved back to engine %s within %g s (thrash)", source.engine_id,
                        to_id, p.THRASH_WINDOW)
        target = self.engines.get(to_id)
        if target is not None:
            target.received_from[source.engine_id] = self._now

    def _start_unmap(self, engine: EngineRecord, slab: SlabRecord) -> None:
        engine.begin_unmap(slab, {rank for rank in range(engine.num_workers)
                          if rank in engine.workers and self.channels.alive(engine, rank)},
                         self._now + self.timing.ack_timeout)
        engine.mirror.release(slab.slab_id)
        slab.asked = set(slab.waiting)
        for rank in sorted(slab.waiting):
            self._command(engine.workers[rank],
                          p.UnmapSlab(slab=slab.slab_id, offsets=engine.worker_offsets(slab.slab_id, rank)),
                          channel=(engine.engine_id, rank, engine.token))
        if not slab.waiting:
            self._unmapped(engine, slab)

    def _on_unmapped(self, identity: bytes, m: p.Unmapped) -> None:
        """A worker let go of a slab. For a failed engine too, if the worker was
        asked to unmap it: a late ack releases that rank's hold on the
        quarantined pages (they come back once no rank holds them)."""
        engine = self._record_of_worker(identity, m.engine_id, m.rank)
        if engine is None and (m.engine_id in self.engines or self.departed(m.engine_id)):
            raise Rejected(p.Reason.NOT_OWNER, f"worker {m.rank} of {m.engine_id} registered on another connection")
        slab = engine.slabs.get(m.slab) if engine else None
        if engine is None or slab is None or slab.phase is not Phase.UNMAPPING or m.rank not in slab.waiting \
                or (engine.failed and m.rank not in slab.asked):
            raise Rejected(p.Reason.UNEXPECTED_ACK,
                           f"engine {m.engine_id} worker {m.rank}: no unmap of slab {m.slab} pending")
        if engine.failed:
            log.info("engine %s: worker %d unmapped quarantined slab %d late", m.engine_id, m.rank, m.slab)
        slab.waiting.discard(m.rank)
        if not slab.waiting:
            self._unmapped(engine, slab)

    def _unmapped(self, engine: EngineRecord, slab: SlabRecord) -> None:
        """Every worker let go of the slab: its pages are free in the daemon."""
        engine.remove_slab(slab)
        engine.active.pop(slab.slab_id, None)
        ret = None if slab.return_req is None else self.returns.get(slab.return_req)
        if ret is not None:
            ret.unmapping.discard(slab.slab_id)
            if not ret.unmapping:
                del self.returns[(ret.identity, ret.req_id)]
                self._out.append(fx.Send(ret.identity, p.Ok(req_id=ret.req_id)))
        owner = owner_tag(engine)
        req = self.grows.get(slab.handoff_to)
        taker = self.engines.get(req.engine_id) if req is not None else None
        # Checked again: either side may have left the namespace meanwhile
        # (``_on_diverge``); then the pages are not handed on at all.
        if req is not None and taker is not None and slab.pages and not engine.failed \
                and self._may_hand_on(engine, taker, list(slab.handoff)):
            owner = owner_tag(taker)   # handed on: free under the taker's tag until its grow maps them
            req.handoffs.append(Handoff(list(slab.pages), list(slab.page_devices), slab.handoff))
        if not self._keep_orphan(engine, slab):
            for page_id, device in zip(slab.pages, slab.page_devices):
                self.pools[device].put_back([page_id], owner)
        self.pools[engine.device].adopted -= slab.adopted_pages
        if self.departing.get(engine.serial) is engine and not engine.slabs:
            del self.departing[engine.serial]
            log.info("engine %s: all memory back in the pool", engine.engine_id)
        self._progress_grows()

    # ============================================================ engine death
    def _forget(self, engine: EngineRecord, why: str) -> None:
        """Take ``engine`` off the books: its grows are answered and its reclaims end now."""
        del self.engines[engine.engine_id]
        for req in [r for r in self.grows.values() if r.engine_id == engine.engine_id]:
            del self.grows[req.seq]
            self._out.append(fx.Send(req.identity, p.Error(req_id=req.req_id, reason=p.Reason.ENGINE_GONE.value,
                                                           message=f"engine {engine.engine_id}: {why}")))
        for rid in [rid for rid, rec in self.reclaims.items() if rec.engine_id == engine.engine_id]:
            self.reclaims.pop(rid).grow.reclaims.discard(rid)
        if self.events:  # its prefix cache is gone with it
            self._out.append(fx.Publish(kv_events_topic(engine.engine_id, engine.namespace),
                                        (AllBlocksCleared(),)))
        self.departing[engine.serial] = engine

    def _drop(self, engine: EngineRecord, why: str) -> None:
        """The engine left (or died): every slab is unmapped by the workers still there."""
        if self.engines.get(engine.engine_id) is not engine:
            return
        kept = self._mark_orphans(engine)
        log.log(logging.INFO if why == "unregistered" else logging.WARNING,
                "engine %s %s: returning its %d slab(s)%s", engine.engine_id,
                why if why == "unregistered" else f"gone ({why})", len(engine.slabs),
                f", {kept} with valid cache kept for namespace {engine.namespace}" if kept else "")
        self._forget(engine, why)
        for slab in list(engine.slabs.values()):
            if slab.phase is not Phase.UNMAPPING:
                self._start_unmap(engine, slab)
        self._settle_departed(engine)
        self._progress_grows()

    def _fail(self, engine: EngineRecord, why: str) -> None:
        """The engine missed a deadline: quarantine its pages, close its peers."""
        if self.engines.get(engine.engine_id) is not engine:
            return
        self._forget(engine, why)
        self._quarantine(engine, why)
        # Told, so it stops short of more grows and its operator sees why it
        # must restart; its pages stay quarantined while its processes live.
        self._out.append(fx.Send(engine.identity, p.Failed(reason=why)))
        self._progress_grows()

    def _quarantine(self, engine: EngineRecord, why: str) -> None:
        """Its pages leave circulation until none of its processes is left to map them."""
        engine.failed = True
        log.error("engine %s failed (%s): %d slab(s) quarantined until its processes are gone",
                  engine.engine_id, why, len(engine.slabs))
        alive = self.channels.alive_ranks(engine)
        for slab in engine.slabs.values():
            # Waits for its processes to go (or a late ack of an unmap it was
            # asked for), never for a deadline; ranks that acked are done.
            waiting = slab.waiting & alive if slab.phase is Phase.UNMAPPING else set(alive)
            engine.begin_unmap(slab, waiting, float("inf"))
        self._settle_departed(engine)

    def _settle_departed(self, engine: EngineRecord) -> None:
        """Slabs of a departed engine wait only for workers that still exist
        (a failed engine's: every worker alive when it failed, until it is
        gone or acknowledged an unmap it was asked for)."""
        alive = self.channels.alive_ranks(engine)
        for slab in list(engine.slabs.values()):
            slab.waiting &= alive
            if not slab.waiting:
                self._unmapped(engine, slab)
        if not engine.slabs and self.departing.get(engine.serial) is engine:
            del self.departing[engine.serial]

    def _release_stale(self) -> None:
        """Idle work: free pages of owners no longer registered go back to the
        driver (or the kernel), a batch per tick."""
        live = {owner_tag(e) for e in self.engines.values()}
        for device, pool in self.pools.items():
            stale = pool.take_orphaned(live, 64)
            if stale:
                self._out.append(fx.ReleasePages(device, tuple(stale)))

    # ================================================================ output
    def _command(self, identity: bytes, msg: p.Msg, channel: tuple[str, int, bytes] | None = None) -> int:
        """An unsolicited message to a client, with a request id of the daemon's
        (``channel``: on that worker's page channel, ``fx.Send``)."""
        msg.req_id = self._new_req_id()
        self._out.append(fx.Send(identity, msg, channel))
        return msg.req_id

    def _new_req_id(self) -> int:
        self._next_req += 1
        return self._next_req

    def _take(self) -> list[fx.Effect]:
        out, self._out = self._out, []
        return out

    # Message type -> its handler. ``Any``: each handler takes its own message
    # type, which ``handle`` picked it by.
    _HANDLERS: ClassVar[dict[type[p.Msg], Callable[[Allocator, bytes, Any], p.Msg | None]]] = {
        p.RegisterEngine: Registration._on_register_engine, p.RegisterWorker: Registration._on_register_worker,
        p.Grow: Growth._on_grow, p.Return: _on_return, p.Journal: _on_journal,
        p.Heartbeat: _on_heartbeat, p.Unregister: _on_unregister, p.Busy: _on_busy,
        p.ReclaimDone: _on_reclaim_done, p.Mapped: Growth._on_mapped,
        p.Unmapped: _on_unmapped, p.Status: _on_status, p.SetLimit: _on_set_limit,
        p.Invalidate: CacheScope._on_invalidate, p.Diverge: CacheScope._on_diverge,
    }
