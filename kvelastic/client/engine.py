"""The engine side of the daemon link: keeps a ``SlabPool`` supplied with slabs.

The engine's scheduler thread drives the pool; the I/O thread (``Connection``)
applies grants, answers reclaims, flushes the journal, returns idle slabs and
sends heartbeats. ``lock`` guards the pool between the two: the scheduler
holds it around each pool operation (uncontended: ~100 ns).

Two kinds of grow: a *reserve* refill (the I/O thread, when free blocks fall
under ``low_watermark`` while the engine is active: ahead of need, from the
daemon's free memory only) and *demand* (``ensure``: the scheduler needs N
blocks for a request now; the daemon may reclaim from other engines for it,
and the caller waits, bounded). When to refill and which empty slabs go back
is ``ReservePolicy``'s call (``reserve.py``): an idle engine's reserve decays
to nothing.

The journal's shipping (what goes with it, the index sent again after a
reconnect or a refusal) is ``JournalShipper``'s (``shipping.py``); when it
goes is decided here.

Grants have one path (``_grants``, drained by ``apply_grants``): adding a
slab is safe at any point of a scheduling step, so a slab that arrived is
usable in the step it arrived in. Everything else the daemon asks for
(reclaim, clear index) is deferred work (``_run_or_defer``): it runs under
``lock``, between steps, because it may take cached blocks the scheduler has
looked up but not yet touched.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import secrets
import threading
import time
from collections.abc import Callable

import msgspec

from kvelastic import protocol as p
from kvelastic.client.answers import give_up, hand_back, private_namespace
from kvelastic.client.connection import Connection, DaemonError, DaemonUnavailable, expect
from kvelastic.client.demand import DemandAnswer
from kvelastic.client.reserve import ReservePolicy
from kvelastic.client.shipping import JournalShipper
from kvelastic.core.pool import SlabPool
from kvelastic.errors import PoolError

log = logging.getLogger("kvelastic.client")

# The scheduler's poll ships the journal only once it is this many intervals
# old: the I/O thread did not find the lock free (``poll``).
POLL_SHIPS_AFTER = 4
# Messages that hand slabs back to the daemon: the journal goes ahead of them
# (``EngineClient._journal_first``).
HANDS_BACK = (p.Return, p.ReclaimDone)


class EngineClient:
    def __init__(self, pool: SlabPool, *, socket_path: str, engine_id: str, namespace: str,
                 page_size: int, pages_per_worker: int, num_workers: int, block_bytes: int,
                 min_bytes: int = 0, max_bytes: int = 0, low_watermark: int | None = None,
                 keep_idle_slabs: int = 1, shrink_grace: float = 5.0, tick_interval: float = 0.01,
                 key_group_suffix: bool = False, device: str = "", private: bool = False,
                 pages_per_region: int = 1) -> None:
        self.pool = pool
        self.engine_id = engine_id
        # A private engine is alone in a namespace of its own (``diverge``).
        self.private = private
        self.namespace = private_namespace(namespace) if private else namespace
        # What every registration says; each adds its pid, held slabs and secret.
        self.registration = p.RegisterEngine(
            version=p.PROTOCOL_VERSION, engine_id=engine_id, pid=os.getpid(), namespace=self.namespace, private=private,
            page_size=page_size, pages_per_worker=pages_per_worker, pages_per_region=pages_per_region,
            num_workers=num_workers, blocks_per_slab=pool.blocks_per_slab, block_bytes=block_bytes, min_bytes=min_bytes,
            max_bytes=max_bytes, block_tokens=pool.block_size, key_group_suffix=key_group_suffix, device=device)
        self.reserve = ReservePolicy(pool.blocks_per_slab if low_watermark is None else low_watermark,
                                     keep_idle_slabs=keep_idle_slabs, shrink_grace=shrink_grace,
                                     active_at=time.monotonic())
        self.lock = threading.RLock()
        self.max_slabs = 0
        self.budget_bytes = 0
        # This engine's secret, its own choice: shown in its lifeline's hello
        # and its registrations, given to its workers; nobody else can keep
        # the engine alive, act as its workers or take its id over.
        self.token = secrets.token_bytes(32)
        self.failed = ""                   # the daemon failed this engine (why): it must restart
        # Called on the I/O thread's tick with ``lock`` held (the vLLM plugin
        # publishes the cache events a reclaim or an expiry queued: an idle
        # engine has no step that would).
        self.on_tick: Callable[[], None] | None = None
        self.hash_seed = ""                # its namespace's block-hash root, likewise
        self._registrations = 0            # handshakes so far (a scope is its connection's)
        self.refused_until = 0.0           # after a refused grow, no prefetch for a while
        self._grow_in_flight = False       # a reserve grow awaits its answer
        self._grow_answered = threading.Event()
        self._demand: DemandAnswer | None = None   # the last demand grow, answered or still to be
        self._grants: collections.deque[p.Msg] = collections.deque()
        self._block_ops = 0                # the pool's activity counter when last looked at
        self._deferred: collections.deque[Callable[[], None]] = collections.deque()   # see _run_or_defer
        self._last_heartbeat = 0.0
        self._now = 0.0
        self._closing = False
        self.conn = Connection(socket_path, engine_id, -1, handshake=self._register,
                               on_command=self._on_command, on_tick=self._tick,
                               tick_interval=tick_interval, name=f"kvelastic-engine-{engine_id}")
        self.conn.token = self.token
        self.conn.before_send = self._journal_first
        self.conn.on_error = self._on_refused
        self.shipper = JournalShipper(pool, self.conn, engine_id, reserve=self.reserve,
                                      bytes_keys=key_group_suffix)

    @property
    def low_watermark(self) -> int:
        return self.reserve.low_watermark

    @low_watermark.setter
    def low_watermark(self, blocks: int) -> None:
        self.reserve.low_watermark = blocks

    @property
    def journal_interval(self) -> float:
        return self.shipper.interval

    @journal_interval.setter
    def journal_interval(self, seconds: float) -> None:
        self.shipper.interval = seconds

    def flush_journal(self, sync: bool = False) -> None:
        """Ship the journal now (any thread); ``sync``: and wait until the
        daemon applied it. Tests and benchmarks that need the mirror current."""
        with self.lock:
            self.shipper.flush(sync=sync)

    # ------------------------------------------------------------ lifecycle
    def start(self, timeout: float = 10.0) -> EngineClient:
        self.conn.start(timeout)
        return self

    def close(self, unregister: bool = True) -> None:
        if unregister and self.conn.connected.is_set() and self.lock.acquire(timeout=1.0):
            try:  # the last steps' completions first: the cache the daemon keeps counts on them
                self.pool.restore_demoted()   # and all of it may be kept: nothing will be rewritten now
                self.shipper.flush(demote=False)
            finally:
                self.lock.release()
        self._closing = True  # no journal after the daemon forgot us
        if unregister and self.conn.connected.is_set():
            try:
                self.conn.call(p.Unregister(engine_id=self.engine_id), timeout=2.0)
            except (DaemonError, DaemonUnavailable):
                pass
        self.conn.close()

    def _register(self, conn: Connection) -> None:
        """Handshake (I/O thread): register, adopting whatever the pool holds."""
        if not self.lock.acquire(timeout=1.0):  # the scheduler is mid-request: retry soon
            raise DaemonUnavailable("engine busy; registration retried")
        try:
            # Grants that came before the link broke are the pool's: a daemon
            # that restarted hears of them here, or it would refuse every
            # journal that names them (their AddSlab first).
            self.apply_grants()
            held = self.pool.slab_ids()
            occupancy = self.pool.occupancies()
        finally:
            self.lock.release()
        reply = expect(conn.call(msgspec.structs.replace(self.registration, pid=os.getpid(), held=held,
                                                         occupancy=occupancy, token=self.token), timeout=5.0),
                       p.Registered)
        self.max_slabs, self.budget_bytes = reply.max_slabs, reply.budget_bytes
        self.reserve.idle_grace = reply.idle_grace   # the daemon's clock for "idle"
        # Kept for good: a re-registration (also with a restarted daemon) shows
        # it, and so do this engine's workers (``WorkerClient(token=...)``).
        self.token = self.conn.token = reply.token   # its own (a daemon before 7b chose one)
        # The namespace's root for block hashes; the vLLM plugin seeds vLLM's
        # NONE_HASH with it (the first registration's: hashes never change
        # under a running engine).
        self.hash_seed = self.hash_seed or reply.hash_seed
        self.shipper.registered(scope=reply.scope, tier=reply.tier, orphan_ttl=reply.orphan_ttl)
        self._registrations += 1
        if self.private:   # a reconnect keeps the daemon's record, which a lost Diverge never reached
            expect(conn.call(self._diverge_message("re-registered"), timeout=5.0), p.Ok)
        self._grow_in_flight = False
        self._grow_answered.set()
        if held:  # a restarted daemon has an empty mirror: send the whole index
            self._run_or_defer(self.shipper.resend_index)
            log.info("engine %s: re-registered with %d slab(s) held", self.engine_id, len(held))

    # ---------------------------------------------------- scheduler thread
    def diverge(self, reason: str) -> None:
        """This engine's weights may have changed in memory (``reason``: how):
        from now on it is alone in a fresh namespace, so what it caches never
        reaches an engine of the checkpoint (handed on, or kept after it
        exits) and it adopts nothing of theirs. Once is enough: a private
        namespace is never shared. Raises ``DaemonError`` if the daemon
        refuses; an unreachable daemon hears it at the re-registration."""
        with self.lock:
            if self.private:
                return
            self.private = True
            self.namespace = private_namespace(self.namespace)
            self.registration = msgspec.structs.replace(self.registration, namespace=self.namespace, private=True)
        log.warning("engine %s: %s: its weights may have changed, so its prefix cache is its own from now on "
                    "(namespace %s)", self.engine_id, reason, self.namespace)
        try:
            expect(self.conn.call(self._diverge_message(reason), timeout=5.0), p.Ok)
        except DaemonUnavailable:
            pass   # the next registration says it (``_register``)

    def _diverge_message(self, reason: str) -> p.Diverge:
        return p.Diverge(engine_id=self.engine_id, namespace=self.namespace, reason=reason[:64])

    def ensure(self, blocks: int, timeout: float = 5.0, *, keep_cache: bool = False,
               wait: float | None = None) -> bool:
        """Demand: make ``blocks`` allocatable, asking the daemon for the
        missing slabs (it may reclaim them from other engines) and waiting at
        most ``timeout``; with ``wait``, at most that long for the daemon's
        answer, which otherwise comes as a late grant (``demand.py``: the
        scheduler goes on meanwhile), and no second demand is sent before it
        (a caller then waits for that one). With ``keep_cache`` cached blocks do not count, so
        allocating them evicts nothing while the daemon can supply memory.
        A reserve grow already on its way is waited for, not asked twice.
        Blocks adopted with a slab this demand brought (handed on by an engine
        of the namespace) count as supplied: evicting them costs no more than
        fresh pages would have, and until then they may hit.
        False: the daemon could not supply them (device full, engine at its cap)."""
        pool = self.pool
        deadline = time.monotonic() + timeout
        self.reserve.touch(time.monotonic())
        adopted_before = pool.stats.adopted_blocks

        def missing() -> int:
            self.apply_grants()
            brought = min(pool.stats.adopted_blocks - adopted_before, pool.num_cached)
            return blocks - pool.num_free - (brought if keep_cache else pool.num_cached)

        wait = timeout if wait is None else min(wait, timeout)
        with self.lock:
            if missing() <= 0:
                return True
        if self._demand is not None and not self._demand.settled.is_set():
            self._demand.settled.wait(wait)          # an earlier demand's answer is still to come
            with self.lock:
                return missing() <= 0
        if self._grow_in_flight:
            self._grow_answered.wait(wait)
        with self.lock:
            short = missing()
            if short <= 0:
                return True
            want = min(math.ceil(short / pool.blocks_per_slab), self.max_slabs - pool.num_slabs)
            # The daemon judges the demand by its mirror (is the cache ours to
            # evict first?): bring it up to date ahead of the grow.
            self.shipper.flush()
        if want <= 0:
            return False  # the engine's whole virtual range is held
        self._demand = answer = DemandAnswer(self._late_demand)
        self.conn.call_async(p.Grow(engine_id=self.engine_id, slabs=want, demand=True), answer.on_reply)
        reply = answer.take(max(0.0, min(wait, deadline - time.monotonic())))
        if reply is None:
            return False  # still coming: its slabs join the pool as a late grant
        if isinstance(reply, p.Error):
            log.warning("engine %s: grow of %d slab(s) failed: %s", self.engine_id, want, reply.message)
            return False
        with self.lock:
            self._apply_grant(reply)
            return missing() <= 0

    def can_grow(self) -> bool:
        """False once the engine holds its whole virtual range (its cap)."""
        return self.pool.num_slabs < self.max_slabs

    def apply_grants(self) -> None:
        """Add the slabs granted so far to the pool (any thread; safe mid-step)."""
        if self._grants:
            with self.lock:
                while self._grants:
                    self._apply_grant(self._grants.popleft())

    def poll(self) -> None:
        """From the thread that drives the pool, between its operations: apply
        what the daemon sent, and ship the journal if the I/O thread has not
        found the lock free for ``POLL_SHIPS_AFTER`` journal intervals (a
        scheduler that runs back to back). The I/O thread ships it otherwise,
        between steps: while a model step runs, not on the scheduler's path."""
        shipper = self.shipper
        if self._grants or self._deferred or \
                time.monotonic() - shipper.last_flush >= POLL_SHIPS_AFTER * shipper.interval:
            with self.lock:
                self.apply_grants()
                self._run_deferred()
                now = time.monotonic()
                if now - shipper.last_flush >= POLL_SHIPS_AFTER * shipper.interval and \
                        (self.pool.journal.ops or self.pool.journal.dirty):
                    shipper.ship(now)

    def seal_step(self) -> None:
        """The scheduler is about to run a model step (scheduler thread, after
        scheduling it). A step may write into blocks whose keys were dropped
        while scheduling it; if this engine died in that step, a daemon that
        never heard of the drop would keep those blocks as valid cache. So
        when the daemon keeps departed engines' cache and a key was dropped,
        the journal goes now, on the lifeline. No round trip: once written it
        lies in the daemon's socket, where a ``kill -9`` cannot take it back,
        and the daemon reads an engine's lifeline to its end before it decides
        anything about the engine (its death, a worker's, its next message).

        Most steps need none, even with a full cache that evicts every step:
        for ``DEMOTE_FOR`` after a seal, each journal shipped demotes the next
        blocks to be evicted (``JournalShipper.flush``), which evictions then reuse
        with nothing to seal."""
        if self.shipper.needs_seal() and self.conn.connected.is_set():
            with self.lock:
                self.shipper.seal()

    def wake(self) -> None:
        """Tell the I/O thread to look at the watermarks now (cheap)."""
        self.conn.wake()

    def top_up(self) -> None:
        """The pool is below its reserve: wake the I/O thread to refill it,
        unless a refill is in flight or was just refused (then a wake would
        only cost the scheduler's CPU a thread switch, step after step)."""
        if not self._grow_in_flight and time.monotonic() >= self.refused_until:
            self.conn.wake()

    # --------------------------------------------------------- I/O thread
    def _run_or_defer(self, work: Callable[[], None]) -> None:
        """Run ``work`` under ``lock`` now if the lock is free, else leave it
        to whoever holds the lock next (the scheduler's ``poll``, or a later
        tick). The I/O thread never waits for ``lock``: the scheduler may hold
        it while it waits for a reply only the I/O thread can deliver. Either
        way the work runs whole under the lock, so it is atomic for the
        scheduler (no step sees half a reclaim), and in the order it came."""
        self._deferred.append(work)
        if self.lock.acquire(blocking=False):
            try:
                self._run_deferred()
            finally:
                self.lock.release()

    def _run_deferred(self) -> None:
        """With ``lock`` held."""
        while self._deferred:
            self._deferred.popleft()()

    def _apply_grant(self, reply: p.Msg) -> None:
        if not isinstance(reply, p.Granted):
            return
        for slab_id in reply.slabs:
            try:
                self.pool.add_slab(slab_id)
            except PoolError as exc:
                log.error("engine %s: granted slab %d not usable: %s", self.engine_id, slab_id, exc)
                continue
            # A private engine adopts nothing: a grant sent before its Diverge
            # reached the daemon may still carry its checkpoint's blocks.
            handed = None if self.private else reply.cached.get(slab_id)
            if handed:
                try:
                    n = self.pool.adopt(slab_id, [(c.offset, c.key, c.label) for c in handed])
                except PoolError as exc:
                    log.warning("engine %s: handed-on blocks of slab %d not adopted: %s",
                                self.engine_id, slab_id, exc)
                else:
                    log.info("engine %s: adopted %d cached block(s) with slab %d", self.engine_id, n, slab_id)
        if not reply.slabs:
            self.refused_until = self._now + 0.5

    def _late_demand(self, reply: p.Msg) -> None:
        """I/O thread: a demand answered after its caller went on."""
        if isinstance(reply, p.Granted):
            self._grants.append(reply)
            self.wake()

    def _on_grow_reply(self, reply: p.Msg) -> None:
        """I/O thread: a reserve grow was answered. The grant is applied at
        once if the pool is free, else by the scheduler's next capacity check."""
        self._grants.append(reply)
        self._grow_in_flight = False
        self._grow_answered.set()
        if self.lock.acquire(blocking=False):
            try:
                self.apply_grants()
            finally:
                self.lock.release()

    def _on_command(self, msg: p.Msg) -> None:
        if isinstance(msg, p.Granted):
            # A grant whose request was given up (timed out here, or answered
            # at the daemon's deadline before the slab was mapped): still ours.
            self._grants.append(msg)
            self.wake()
        elif isinstance(msg, p.Reclaim):
            self._run_or_defer(lambda: self._reclaim(msg))
        elif isinstance(msg, p.Drain):
            self._run_or_defer(lambda: self._drain(msg))
        elif isinstance(msg, p.ClearIndex):
            registration = self._registrations
            self._run_or_defer(lambda: self._clear_index(msg.scope, registration))
        elif isinstance(msg, p.TierCopied):
            self.shipper.heard_tier_copied(msg.ticket)
            self.wake()
        elif isinstance(msg, p.Failed):
            self.failed = msg.reason
            self._closing = True    # the daemon forgot it: no more journals, heartbeats or grows
            log.error("engine %s: the daemon failed this engine (%s); its memory stays quarantined until its "
                      "processes exit: restart it", self.engine_id, msg.reason)

    def _journal_first(self, msg: p.Msg) -> None:
        """Before a message that hands slabs back (``Return``, ``ReclaimDone``),
        whoever sends it: ship the journal. The daemon takes a journal only
        while every slab it names is still this engine's, and refuses one
        whole (its keys with it); it reads the lifeline before the control
        socket's next message, so a journal written now is applied first. A
        ``Return`` sent after the pool let its slabs go, with their last ops
        (a grant's ``AddSlab``, a key dropped in a slab the engine keeps)
        still in the journal, would otherwise have that journal refused once
        the slabs are unmapped, and the daemon's mirror would go on naming a
        block the engine may rewrite. This client's own returns and reclaims
        flush first already (``lock`` held: nothing left to ship); the I/O
        thread never waits for ``lock`` (``_run_or_defer``)."""
        if not isinstance(msg, HANDS_BACK) or self._closing:
            return
        if not self.lock.acquire(blocking=not self.conn._on_io_thread()):
            return
        try:
            self.shipper.flush()
        finally:
            self.lock.release()

    def _on_refused(self, msg: p.Error) -> None:
        """I/O thread: the daemon refused a notification; a refused journal
        has the whole index go again on the next tick."""
        if msg.reason == p.Reason.BAD_JOURNAL.value:
            self.shipper.refused()

    def _reclaim(self, msg: p.Reclaim) -> None:
        answer = give_up(self.pool, self.engine_id, msg)
        self.shipper.flush()
        self.conn.send(answer)

    def _drain(self, msg: p.Drain) -> None:
        """Another engine's demand went unmet while this one holds more than
        its fair share: the slabs named take no new block and go back as
        they empty (``_shrink``), until ``msg.seconds`` from now."""
        slabs = self.reserve.drain(self.pool, msg.slabs, time.monotonic(), min(msg.seconds, 4 * p.DRAIN_SECONDS))
        if slabs:
            log.info("engine %s: draining %d slab(s) for another engine's demand", self.engine_id, len(slabs))

    def _clear_index(self, scope: int = 0, registration: int | None = None) -> None:
        """Drop the whole prefix cache; the next journal carries the CLEAR and
        ``scope``, unless the clear was deferred across a reconnect: a
        restarted daemon counts scopes anew, and an old one past its count
        would make journals look current for an invalidation not applied."""
        dropped = self.pool.clear_index()
        if registration in (None, self._registrations):
            self.shipper.cleared(scope)
        log.info("engine %s: prefix cache invalidated by the daemon (%d cached blocks dropped)",
                 self.engine_id, dropped)

    def _tick(self, now: float) -> None:
        self._now = now
        if self._closing:
            return
        if now - self._last_heartbeat >= p.HEARTBEAT_INTERVAL:
            self._last_heartbeat = now
            self.conn.send(p.Heartbeat(engine_id=self.engine_id))
        if not self.lock.acquire(blocking=False):
            return  # the scheduler is busy with the pool: next tick, or its poll()
        try:
            self.apply_grants()
            self._run_deferred()
            pool = self.pool
            if pool.stats.block_ops != self._block_ops:
                self._block_ops = pool.stats.block_ops
                self.reserve.touch(now)
            want = self.reserve.refill(pool, now, self.max_slabs)
            if want and (self._grow_in_flight or now < self.refused_until):
                want = 0
            if pool.ttl or pool.max_cached_blocks is not None:
                pool.expire()
            self.shipper.resync_if_due(now)
            returned = self._shrink(now)
            # The journal goes first: the daemon judges a grow (is this engine
            # idle?) on the activity the journal carries. With the lock free,
            # no step is being scheduled: this costs the scheduler nothing.
            if returned or want or self.shipper.due(now):
                self.shipper.ship(now)
            if returned:
                self.conn.send(returned)
            if want:
                self._grow_answered.clear()   # before the flag: ensure() must never see a stale answer
                self._grow_in_flight = True
                self.conn.call_async(p.Grow(engine_id=self.engine_id, slabs=want), self._on_grow_reply)
            if self.on_tick is not None:
                self.on_tick()
        finally:
            self.lock.release()

    def _shrink(self, now: float) -> p.Return | None:
        """Slabs to give back (taken back here: the journal that says so goes before the ``Return``)."""
        slabs = self.reserve.to_return(self.pool, now)
        self.reserve.forget(slabs)
        return hand_back(self.pool, self.engine_id, slabs) if slabs else None
