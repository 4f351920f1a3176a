"""The engine's journal on its way to the daemon's mirror (``JournalShipper``).

The pool writes a journal of its cache ops (``core/journal.py``); this ships
it on the lifeline and decides what goes with it: the slabs' occupancy, the
pool's counters, the last tier ticket heard and the invalidation scope. When
it goes is the client's call (every ``interval`` from the I/O thread's tick,
before a step that must be sealed, before slabs go back); how is here.

Every method runs with the engine's ``lock`` held: taking the journal and
writing it is one step, so journals arrive in the order they were taken,
ahead of any later message on the control socket (the daemon reads an
engine's lifeline before its messages).
"""

from __future__ import annotations

import logging
import math
import time

from kvelastic import protocol as p
from kvelastic.client.answers import JOURNAL_MAX_OPS, journal_frames, wire_key
from kvelastic.client.connection import Connection, expect
from kvelastic.client.reserve import ReservePolicy
from kvelastic.core.pool import SlabPool

log = logging.getLogger("kvelastic.client")

# The journal goes out in batches this far apart: big enough that shipping it
# costs the engine little, small enough for reclaim decisions and KV events.
JOURNAL_INTERVAL = 0.05
# Journals demote the next blocks to be evicted for this long after a seal:
# an engine that evicts under pressure seals about once in this time, one
# that does not keeps all its cache valid for the daemon.
DEMOTE_FOR = 10.0
# ``flush(sync=True)`` waits at most this for the daemon's Ok.
SYNC_TIMEOUT = 1.0
# After the daemon refused a journal, the whole index goes again, at most
# once in this many seconds (``refused``).
RESYNC_INTERVAL = 1.0


class JournalShipper:
    def __init__(self, pool: SlabPool, conn: Connection, engine_id: str, *, reserve: ReservePolicy,
                 bytes_keys: bool) -> None:
        self.pool = pool
        self.conn = conn
        self.engine_id = engine_id
        self.reserve = reserve               # its low watermark is how far a journal demotes
        self.bytes_keys = bytes_keys         # vLLM's keys are bytes already: no conversion
        self.interval = JOURNAL_INTERVAL
        self.last_flush = 0.0                # when the tick or the scheduler's poll last shipped
        # What the last registration's answer said (``registered``).
        self.tier = False                    # the daemon's tier takes this engine's evictions (source B)
        self.orphan_ttl = 0.0                # the daemon keeps this engine's cache after it leaves
        self.scope = 0                       # the last ``ClearIndex.scope`` applied (journals carry it)
        self._tier_ack = 0                   # the last ``TierCopied`` ticket heard (I/O thread)
        self._tier_ack_sent = 0              # the last one a journal carried back
        self._sealed_at = -math.inf          # the last seal written (demotion follows it: ``flush``)
        self._resync_due = False             # a journal was refused: the index goes again
        self._resynced_at = -math.inf

    def registered(self, *, scope: int, tier: bool, orphan_ttl: float) -> None:
        """A handshake was answered. A ticket or a scope is of the daemon that
        sent it: a restarted one counts from the start again (and a
        reconnect's lost tickets are lost)."""
        self._tier_ack = self._tier_ack_sent = 0
        self.scope = scope
        self.tier = tier
        self.orphan_ttl = orphan_ttl

    def heard_tier_copied(self, ticket: int) -> None:
        """Carried back by the next journal taken after this was heard (the
        tick ships one for it even with no ops: ``due``)."""
        self._tier_ack = max(self._tier_ack, ticket)

    def cleared(self, scope: int) -> None:
        self.scope = max(self.scope, scope)

    def due(self, now: float) -> bool:
        """The tick's own rule: an interval went by, or a ticket waits to go back."""
        return now - self.last_flush >= self.interval or self._tier_ack != self._tier_ack_sent

    def ship(self, now: float) -> None:
        """A flush on the schedule (the tick's, or the scheduler's poll):
        the interval counts from here."""
        self.last_flush = now
        self.flush()

    def needs_seal(self) -> bool:
        """A step about to run may write into blocks whose keys were dropped
        while it was scheduled; where the daemon keeps a departed engine's
        cache, it must hear of those drops first (``EngineClient.seal_step``)."""
        return bool(self.orphan_ttl) and bool(self.pool.journal.removed)

    def seal(self) -> None:
        self._sealed_at = time.monotonic()
        self.flush(seal=True)

    def refused(self) -> None:
        """The daemon refused a journal: it was dropped whole, so the mirror
        may lack what it said (a dropped key above all: the cache kept after
        this engine leaves would name a block it may have rewritten). The
        whole index goes again (``resync_if_due``), as after a reconnect."""
        self._resync_due = True

    def resync_if_due(self, now: float) -> None:
        if self._resync_due and now - self._resynced_at >= RESYNC_INTERVAL:
            self._resync_due = False
            self._resynced_at = now
            log.warning("engine %s: the daemon refused a journal: its whole index goes again", self.engine_id)
            self.resend_index()

    def resend_index(self) -> None:
        """The whole index, for a mirror that may lack part of it: a restarted
        daemon's (empty), or the same daemon's on a new connection (drops
        that were on their way may be missing: it starts over). Then the step
        state: a key of a step still running must not count as written."""
        self.pool.take_journal()
        self.pool.forget_demotions()   # every key goes again
        ops: list[p.JournalOp] = [p.ClearKeys(), *p.journal_ops(self.pool.journal.resync())]
        ops += [p.StoreKey(key=wire_key(k), block=b) for k, b in self.pool.cached_keys()]
        ops += [p.LabelBlock(block=b, label=label) for b, label in self.pool.labelled_keys()]
        occupancy = self.pool.occupancies()
        for start in range(0, max(len(ops), 1), JOURNAL_MAX_OPS):   # the daemon takes journals in parts
            last = start + JOURNAL_MAX_OPS >= len(ops)
            # On the lifeline like every journal (the I/O thread in its
            # handshake, or whoever frees the lock after it).
            if not self.conn.write_lifeline(p.encode(p.Journal(
                    engine_id=self.engine_id, ops=ops[start:start + JOURNAL_MAX_OPS],
                    occupancy=occupancy if last else {}, scope=self.scope)), handshake=True):
                return     # the lifeline broke: the next registration sends the index again

    def flush(self, sync: bool = False, seal: bool = False, demote: bool = True) -> None:
        """Ship the journal on the lifeline. Not registered, it is dropped:
        the next registration sends the whole index. ``sync``: then wait
        until the daemon applied it (its Ok to an empty journal on the
        control socket covers every frame before it). ``seal``: the ops
        alone, on the scheduler's path before a step; the slabs' occupancy
        and the counters wait for the next flush, at most ``interval`` later
        (the daemon needs them for its reclaim and idleness decisions, not
        for what a dead engine's cache holds).

        Where the daemon keeps departed engines' cache, and a step had to be
        sealed in the last ``DEMOTE_FOR`` (evictions under pressure), the
        journal first demotes (``SlabPool.demote``) the least recently used
        cached blocks until free and demoted blocks make the low watermark (a
        step's worth and a slab): the next to be evicted, so the steps until
        the next journal evict them with no seal, at the price of at most
        that many blocks left out of what the daemon keeps of a crashed engine.
        Where the node's tier takes running engines' evictions (``tier``),
        every journal demotes so, whatever the TTL and before any pressure
        (the first evictions are of the oldest blocks, a prefix's own): the
        daemon copies each demoted block into the tier while it is still
        cached (docs/tier.md, "Source B"), and this journal carries back the
        last ``TierCopied`` ticket heard (on its last frame: every drop made
        before the ticket was heard is in it or an earlier journal)."""
        if demote and (self.tier or self.orphan_ttl and time.monotonic() - self._sealed_at < DEMOTE_FOR):
            self.pool.demote(self.reserve.low_watermark)
        ack, scope = self._tier_ack, self.scope
        batch = self.pool.take_journal(occupancy=not seal)
        if batch or ack != self._tier_ack_sent:
            counters = {} if seal else self.pool.stats.counters()
            for msg in journal_frames(self.engine_id, batch, counters, bytes_keys=self.bytes_keys, tier_ack=ack,
                                      scope=scope):
                if not self.conn.write_lifeline(p.encode(msg)):
                    # Not registered, or the lifeline broke: the next
                    # registration resends the index. The daemon may not have
                    # heard of a demotion in this batch: none counts.
                    self.pool.forget_demotions()
                    return
            self._tier_ack_sent = ack
        if sync:
            expect(self.conn.call(p.Journal(engine_id=self.engine_id, ops=[], occupancy={}, sync=True),
                                  SYNC_TIMEOUT), p.Ok)
