"""The simulator's engines: a real ``SlabPool`` with the client's rules
played on the world's fake clock and transports (``world.py``): grows and
reserve, journals, reclaims and returns, numbered model steps sealed as
``EngineClient.seal_step`` seals them, and writes into the fake device's
pages, torn until their step ends. Faults reach them through ``run.py``.

Demotion source B, where the daemon says its tier takes their evictions
(``Registered.tier``): every journal demotes the next blocks to be evicted,
carries back the last ``TierCopied`` ticket heard (read before the journal
is taken; reset at each registration) and goes for a new one even with no
ops; they apply ``ClearIndex`` (at once, or deferred to their next unit of
work, when a flush of the scheduler's may go first:
``EngineClient._run_or_defer``) and their journals carry the last scope
applied (``Journal.scope``). Their journals are read before their death, or
a worker's, is heard (the lifeline).

The world makes and drives the engines; they see it through ``EngineWorld``
(a ``Protocol`` that ``World`` fits), so this module does not import ``world.py``.
The records it shares with the world and the ghosts are in ``records.py``.
"""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Any, Protocol

from kvelastic import protocol as p
from kvelastic.client.answers import give_up, hand_back, wire_key
from kvelastic.core.block import BlockRecord
from kvelastic.core.pool import SlabPool
from kvelastic.vmm.base import DEFAULT_PAGE_SIZE as PAGE
from kvelastic_tools.sim.ports import WorkerWorld
from kvelastic_tools.sim.records import BLOCKS_PER_SLAB, BUSY, KV, Device, SimWorker, Step

CLIENT_GROW_TIMEOUT = 2.0          # an engine gives up waiting for a grow after this
# The seal as an acknowledged journal (protocol 2's rule: the real client now
# writes it on its lifeline and does not wait, see ``EngineClient.seal_step``;
# the simulated transports have no lifeline, so a seal here waits for the Ok,
# at most SYNC_TIMEOUT, and after a failure skips seals for SYNC_BACKOFF).
SYNC_TIMEOUT = 1.0
SYNC_BACKOFF = 5.0
UNREGISTER_TIMEOUT = 2.0           # an exiting engine waits this long for its Unregister's answer
FAILED: Any = getattr(p, "Failed", None)   # the daemon tells an engine it failed it: it restarts
TIER_COPIED: Any = getattr(p, "TierCopied", None)   # source B: the daemon copied the blocks demoted so far
PROMPTS = 12                       # prompt families per namespace: requests share prefixes
MAX_REQUEST_BLOCKS = 8
DIVERGE = 0.002                    # per unit of work: the engine's weights change in memory
# ``EngineClient.diverge`` waits this long for the daemon's Ok before the
# weights change (the scheduler schedules nothing meanwhile); a lost
# connection ends the wait at once (the next registration says it).
DIVERGE_TIMEOUT = 5.0
# Demotion source B (``JournalShipper.flush``): where the daemon's tier
# takes running engines' evictions (``Registered.tier``), every journal first
# demotes the next DEMOTE_LEAD blocks to be evicted (the client's
# ``low_watermark``: a slab's worth).
DEMOTE_LEAD = BLOCKS_PER_SLAB
# A ``ClearIndex`` heard while the scheduler holds the client's lock waits
# (``EngineClient._run_or_defer``) for the next poll or tick; meanwhile the
# scheduler's own flushes (``ensure``, ``seal_step``) may ship journals, with
# the last ``TierCopied`` ticket heard. Of ClearIndex heard: so deferred; of
# those, a flush of the scheduler's comes first where a ticket is to be acked.
CLEAR_DEFERRED = 0.3
FLUSH_BEFORE_CLEAR = 0.5
# Per unit of work of an engine that demotes: its I/O thread ships the journal
# (every ``journal_interval`` in the client): journals follow each other while
# an earlier one is still on its way, as the ack rule must expect.
JOURNAL_TICK = 0.6
# Of a request's ends, those while a step runs over its blocks (vLLM's async
# scheduling: the next step was scheduled before the request was known to be
# done): its slabs are not settled until that step ends (``SlabPool.settled``).
FREE_IN_STEP = 0.0   # 0: none (the seeds keep their trajectories); tests/sim/test_settled.py sets it


@dataclasses.dataclass(eq=False)
class Request:
    """A running request: its blocks in order, the first ``keyed`` of them full
    and keyed (key ``i`` names the KV of prompt ``prompt`` up to block ``i``)."""

    prompt: int
    blocks: list[BlockRecord]
    keyed: int


class EngineWorld(WorkerWorld, Protocol):
    """What an engine uses of the world beyond what every client process does
    (``ports.WorkerWorld``): its randomness, the fake device its steps write,
    its peers' lifelines, the checks of what it is granted and rewrites, and
    where its workers go when it dies without them (``ghosts.py``)."""

    @property
    def rng(self) -> random.Random: ...

    @property
    def device(self) -> Device: ...

    @property
    def restart_at(self) -> dict[str, float]: ...

    @property
    def evictions(self) -> bool:
        """Engines honour ``Registered.tier`` (demotion source B) and ``ClearIndex``."""
        ...

    def connect(self, identity: bytes) -> None: ...

    def open_peer(self, engine: SimEngine, rank: int, token: bytes = b"") -> None: ...

    def close_peer(self, engine: SimEngine, rank: int, token: bytes = b"") -> None: ...

    def violation(self, what: str) -> None: ...

    def check_slab_mapped(self, engine: SimEngine, slab_id: int) -> None: ...

    def check_adoption(self, engine: SimEngine, slab_id: int, cached: list[p.CachedBlock]) -> None: ...

    def check_rewrite(self, engine: SimEngine, step: Step) -> None: ...

    def drain_lifeline(self, identity: bytes) -> None: ...

    def haunt(self, engine_id: str, w: SimWorker, frozen: bool, step_until: float, exit_at: float) -> None: ...


class SimEngine:
    def __init__(self, world: EngineWorld, name: str, workers: int, demand_share: float) -> None:
        self.world = world
        self.name = name
        # Engine e0 names no slab settled (a client before ``ReclaimDone.settled``,
        # or a pool that numbers no steps): its unmaps all wait for a step's end.
        self.settles = name != "e0"
        # Two namespaces (engines alternate; one may come back in the other):
        # cached slabs change hands within one only. ``checkpoint`` is what a
        # new process loads (its keys are rooted there, as vLLM's block hashes
        # stay after a weight update); ``namespace`` the weights it serves
        # now: a diverged engine (weights changed in memory) serves its own.
        self.checkpoint = f"ns{int(name.lstrip('e') or 0) % 2}"
        self.namespace = self.checkpoint
        self.private = False
        self.namespaces = {self.namespace}     # every one this process has served (its pages may hold them)
        self.incarnation = 0
        self.pool = SlabPool(BLOCKS_PER_SLAB, block_size=16)
        self.workers = [SimWorker(r, b"") for r in range(workers)]
        self.live: list[Request] = []         # running requests
        self.pending: dict[int, tuple[float, bool]] = {}   # Grow req_id -> (sent at, demand)
        self.alive = False
        self.dying = False                     # a worker died: the engine follows it shortly (as vLLM does)
        self.registered = False
        self.step: Step | None = None          # a model step in flight: unmaps wait for its end
        self.demand_share = demand_share
        self.next_req = 0
        self.token = b""                       # its secret, chosen by each new process
        self.fresh = True                      # not registered yet: its workers wait for the secret
        self.identity = b""
        self.max_slabs = 0
        # The seal (as EngineClient.seal_step): the daemon keeps departed
        # engines' cache, so a dropped key is acknowledged before a step runs.
        self.orphan_ttl = 0.0
        self.removal_unacked = False
        self.sync_failed_at = -1e9
        self.leaving = 0                       # the Unregister it waits for (a graceful exit)
        self.diverging, self.diverge_sent = 0, 0.0   # the Diverge whose Ok the scheduler waits for
        self.leave_sent = 0.0
        # Source B (``EngineClient``): the daemon's tier takes its evictions; the
        # last ``TierCopied`` ticket heard, and the last a journal carried back;
        # a ``ClearIndex`` not applied yet (its scope), and the last applied
        # (``Journal.scope``: the daemon trusts its keys again once it has it).
        self.tier = False
        self.tier_ack = self.tier_ack_sent = 0
        self.clear_due = 0
        self.drain_until = 0.0                 # slabs drain for another engine's demand until then
        self.scope = 0
        self.clear_stale = False               # clear_due is of an earlier connection: its scope does not count

    @property
    def block_bytes(self) -> int:
        """A block's bytes across every worker (as ``RegisterEngine`` counts them)."""
        return PAGE * len(self.workers) // BLOCKS_PER_SLAB

    @property
    def stepping(self) -> bool:
        return self.step is not None

    # ------------------------------------------------------------- lifecycle
    def start(self, held: list[int] | None = None) -> None:
        self.incarnation += 1
        self.alive = True
        self.identity = f"E:{self.name}:{self.incarnation}".encode()
        if self.step is not None and self.step.sync_req:
            self.sync_answered(ok=False)     # the connection it waited on is gone: the call fails
        if not self.token:           # a new process chooses its secret and shows it in its lifeline's hello
            self.token = self.world.rng.randbytes(16)
            self.fresh = True
            self.namespace, self.private = self.checkpoint, False   # the checkpoint's weights again
            self.namespaces = {self.namespace}
        # The client's handshake waits for ``Registered`` before any journal, and
        # takes the ticket and scope from it: a new daemon counts from 0. Here
        # journals may follow the registration at once: they carry that.
        self.tier_ack = self.tier_ack_sent = self.scope = self.diverging = 0
        # A ``ClearIndex`` deferred under the last connection still runs (its
        # cache was invalidated), but its scope was the last daemon's: it
        # leaves the new daemon's alone (``_clear_index``'s registration).
        # With slabs held it runs before the index goes again (the client's
        # deferred work runs in order: its ``JournalShipper.resend_index`` after it).
        self.clear_stale = bool(self.clear_due)
        if self.clear_due and self.pool.slab_ids():
            self.clear_index()
            self.world.counts["clear_index_before_resend"] += 1
        self.world.connect(self.identity)
        self.world.open_peer(self, -1, self.token)
        self.send(p.RegisterEngine(version=p.PROTOCOL_VERSION, engine_id=self.name, pid=1000 + self.incarnation,
                                   namespace=self.namespace, page_size=PAGE, pages_per_worker=1,
                                   num_workers=len(self.workers),
                                   blocks_per_slab=BLOCKS_PER_SLAB, block_bytes=self.block_bytes,
                                   held=self.pool.slab_ids() if held is None else held,
                                   occupancy=self.pool.occupancies(), token=self.token, private=self.private))
        if self.private:             # as the client: a reconnect keeps a record that may not have heard it
            self.send(p.Diverge(engine_id=self.name, namespace=self.namespace, reason="re-registered"))
        if self.pool.slab_ids():     # as the real client: a new daemon gets the step state, then the whole index
            self.pool.take_journal()
            self.pool.forget_demotions()       # every key goes again
            ops = [p.ClearKeys(), *p.journal_ops(self.pool.journal.resync())]
            ops += [p.StoreKey(key=wire_key(key), block=block) for key, block in self.pool.cached_keys()]
            self.removal_unacked = False       # every drop so far is in what this sends
            self.world.client_send(self.identity, p.Journal(engine_id=self.name, ops=ops,
                                                            occupancy=self.pool.occupancies(), scope=self.scope))
        if not self.fresh:           # workers know the secret already (a reconnect); else they wait for it
            for w in self.workers:
                self.start_worker(w)

    def start_worker(self, w: SimWorker) -> None:
        w.identity = f"W:{self.name}:{w.rank}:{self.incarnation}:{self.world.rng.random():.6f}".encode()
        w.stuck_until, w.deferred, w.registered, w.busy_at = 0.0, [], False, -1e9
        w.channel.clear()                      # a new connection: what the old one carried is gone
        w.token = self.token
        self.world.connect(w.identity)
        self.world.open_peer(self, w.rank, w.token)
        self.world.client_send(w.identity, p.RegisterWorker(version=p.PROTOCOL_VERSION, engine_id=self.name,
                                                            rank=w.rank, pid=2000 + w.rank, mapped=sorted(w.mapped),
                                                            token=w.token))

    def kill_worker(self, w: SimWorker) -> None:
        """One worker dies (kill -9, OOM): its mappings vanish; the engine is
        doomed (a step in flight never ends: the others wait on the dead one)."""
        self.dying = True
        w.mapped.clear()                       # the process is gone, then its sockets close
        w.channel.clear()
        if self.tier and self.identity in self.world.wires:   # read to its end before a worker's death is heard
            self.world.drain_lifeline(self.identity)
        if w.identity in self.world.wires:
            self.world.close(w.identity)
            self.world.close_peer(self, w.rank, w.token)

    def disconnect(self) -> None:
        """Close every connection still open (a dead worker's already is).
        An engine that demotes (source B) counts on its lifeline: the daemon
        reads the journals written there to the end before it hears the
        engine died, or a worker of it (``EngineClient.seal_step``; here
        ``World.drain_lifeline``), so a demoted block it
        evicted and rewrote is never kept as valid cache; the rest in flight
        is lost."""
        if self.tier and self.identity in self.world.wires:
            self.world.drain_lifeline(self.identity)
        for identity, rank, token in [(self.identity, -1, self.token)] + [(w.identity, w.rank, w.token)
                                                                   for w in self.workers]:
            if identity in self.world.wires:
                self.world.close(identity)
                self.world.close_peer(self, rank, token)

    def crash(self) -> None:
        """kill -9 of the engine and its workers: every connection closes, mappings
        vanish, and what a step in flight was writing stays torn."""
        if self.registered and any(g.engine_id == self.name and g.worker.token != self.token
                                   for g in self.world.ghosts.values()):
            self.world.counts["id_reuse_departed"] += 1    # while an earlier registration still departs
        coming = getattr(self.world.wires.get(self.identity), "to_client", ())
        if self.clear_due or any(isinstance(e.msg, p.ClearIndex) for e in coming):
            self.world.counts["clear_index_lost"] += 1    # killed before it cleared its keys (deferred, or on its way)
        self.alive = self.registered = self.dying = False
        for w in self.workers:                 # the processes are gone, then their sockets close
            w.mapped.clear()
            w.channel.clear()
            w.deferred = []
        self.disconnect()
        self.token = b""                       # a new process registers afresh
        self.pool = SlabPool(BLOCKS_PER_SLAB, block_size=16)
        self.live.clear()
        self.pending.clear()
        self.step = None
        self.removal_unacked, self.sync_failed_at, self.leaving = False, -1e9, 0
        self.tier, self.tier_ack, self.tier_ack_sent = False, 0, 0     # a new process hears anew
        self.clear_due = self.scope = self.diverging = 0
        self.clear_stale = False

    def leave(self) -> None:
        """A graceful exit between steps (as ``EngineClient.close``): the last
        steps' completions first, then Unregister; the processes exit once it
        is answered (or after a while). Its requests end: their full blocks
        stay cached, for the daemon to keep."""
        for req in self.live:
            self.pool.free(req.blocks[::-1])
        self.live.clear()
        self.pool.restore_demoted()            # as the client: all it caches may be kept now
        self.flush_journal(demote=False, deferred=False)
        self.leaving = self.send(p.Unregister(engine_id=self.name))
        self.leave_sent = self.world.now

    def gone(self) -> None:
        """The exiting engine's processes are gone; it comes back later."""
        self.crash()
        self.world.restart_at[self.name] = self.world.now + self.world.rng.uniform(0.1, 2.0)

    def reconnect(self, held: list[int] | None = None) -> None:
        """The daemon went away: re-register with what the pool holds (adoption);
        ``held``: a corrupted list instead (a buggy or hostile client)."""
        self.registered = False
        self.pending.clear()
        self.start(held)

    def send_bad_journal(self, rng: random.Random) -> None:
        """A hostile journal: a plausible STORE for a block it holds, then one
        for a block of a slab it does not hold."""
        slabs = self.pool.slab_ids()
        if slabs:
            block = rng.choice(slabs) * BLOCKS_PER_SLAB
            ops: list[p.JournalOp] = [p.StoreKey(key=b"forged", block=block),
                                      p.StoreKey(key=b"forged", block=10**6)]
            self.world.client_send(self.identity, p.Journal(engine_id=self.name, ops=ops, occupancy={}))

    # ------------------------------------------------------------- messages
    def send(self, msg: p.Msg) -> int:
        self.next_req += 1
        msg.req_id = self.next_req
        self.world.client_send(self.identity, msg)
        return self.next_req

    def flush_journal(self, demote: bool = True, deferred: bool = True) -> None:
        """As ``JournalShipper.flush``: under pressure the next blocks
        to be evicted are demoted first (``demote_ahead``); the ack is read
        before the journal is taken, and a journal goes for a new ticket even
        with no ops. ``deferred``: what the I/O thread deferred runs first (a
        ``ClearIndex``: its tick and a reclaim run it; the scheduler's own
        flushes and ``close`` do not)."""
        if deferred and self.clear_due:
            self.clear_index()
        if demote:
            self.demote_ahead()
        ack = self.tier_ack
        batch = self.pool.take_journal()
        self.removal_unacked |= batch.removed
        if batch or ack != self.tier_ack_sent:
            self.world.client_send(self.identity, p.Journal(engine_id=self.name, ops=p.journal_ops(batch.ops),
                                                            occupancy=batch.occupancy,
                                                            stats={"block_ops": self.pool.stats.block_ops},
                                                            tier_ack=ack, scope=self.scope))
            self.tier_ack_sent = ack

    def demote_ahead(self) -> None:
        """Where the tier takes this engine's evictions, the least recently
        used cached blocks are demoted until free and demoted blocks make
        DEMOTE_LEAD: the daemon copies them while still cached."""
        if self.tier:
            self.pool.demote(DEMOTE_LEAD)

    def on_message(self, msg: p.Msg) -> None:
        step = self.step
        if step is not None and step.sync_req and msg.req_id == step.sync_req and isinstance(msg, (p.Ok, p.Error)):
            self.sync_answered(ok=isinstance(msg, p.Ok))
            return
        if self.leaving and msg.req_id == self.leaving and isinstance(msg, (p.Ok, p.Error)):
            self.gone()
            return
        if self.diverging and msg.req_id == self.diverging and isinstance(msg, (p.Ok, p.Error)):
            self.diverging = 0                 # the weights change now: its KV is its namespace's from here
            return
        if FAILED is not None and isinstance(msg, FAILED):
            self.world.counts["told_failed"] += 1
            self.gone()                        # it must restart: a new process, a new registration
            return
        if isinstance(msg, p.Registered):
            first, self.fresh = self.fresh, False
            if first and any(g.engine_id == self.name for g in self.world.ghosts.values()):
                self.world.counts["id_reuse"] += 1       # registered again while the last one's workers run
            self.registered, self.max_slabs, self.token = True, msg.max_slabs, msg.token
            self.orphan_ttl = msg.orphan_ttl
            self.tier = bool(getattr(msg, "tier", False)) and self.world.evictions   # (an older client: never)
            # As the client: a ticket or a scope is of the daemon that sent it.
            self.tier_ack = self.tier_ack_sent = 0
            self.scope = getattr(msg, "scope", 0)
            self.sync_failed_at = -1e9         # as the client: this daemon answers seals
            if first:                          # its workers get the secret now (vLLM: with the KV config)
                for w in self.workers:
                    self.start_worker(w)
            return
        if TIER_COPIED is not None and isinstance(msg, TIER_COPIED):
            # Carried back by the next journal (``work`` ships one for it).
            self.tier_ack = max(self.tier_ack, msg.ticket)
            self.world.counts["tier_copied_heard"] += 1
            return
        if isinstance(msg, p.ClearIndex):
            if self.world.evictions:       # (without source B the sim's engines ignore it: see ``tier.py``)
                scope = max(getattr(msg, "scope", 0), 1)
                if self.world.rng.random() < CLEAR_DEFERRED:
                    # The scheduler holds the lock: its next poll (after a stale one, which it then is not).
                    self.clear_due = scope if self.clear_stale else max(self.clear_due, scope)
                    self.clear_stale = False
                    self.world.counts["clear_index_deferred"] += 1
                else:
                    self.clear_index(scope)
            return
        if isinstance(msg, p.Error) and msg.reason == p.Reason.BAD_ADOPTION.value:
            if not self.dying:                   # refused: reconnect and register what it really holds
                self.disconnect()
                self.start()
            return
        if isinstance(msg, (p.Granted, p.Error)) and msg.req_id in self.pending:
            del self.pending[msg.req_id]
        if isinstance(msg, p.Granted):
            for slab_id in msg.slabs:
                if slab_id not in self.pool.slab_ids():
                    self.pool.add_slab(slab_id)
                    if not self.dying and not self.leaving:
                        self.world.check_slab_mapped(self, slab_id)
                        if msg.cached.get(slab_id) and self.private:
                            self.world.counts["adoption_skipped_private"] += 1   # granted before its Diverge
                        elif msg.cached.get(slab_id):
                            self.world.check_adoption(self, slab_id, msg.cached[slab_id])
                            self.pool.adopt(slab_id, [(c.offset, c.key) for c in msg.cached[slab_id]])
        elif isinstance(msg, p.Drain):
            # Until it lapses (the client's ``ReservePolicy``): drained slabs go back
            # as they empty, with the idle ones; a lapsed drain frees what is left.
            self.world.counts["drained_slabs"] += len(self.pool.drain(msg.slabs))
            self.drain_until = self.world.now + msg.seconds
        elif isinstance(msg, p.Reclaim):
            if self.clear_due:                 # deferred after the ClearIndex, it runs after it
                self.clear_index()
            answer = give_up(self.pool, self.name, msg)
            if not self.settles:
                answer.settled = []
            self.flush_journal()
            self.world.client_send(self.identity, answer)

    def on_worker_message(self, w: SimWorker, msg: p.Msg) -> None:
        if isinstance(msg, p.Registered):
            w.registered = True
            w.ack_timeout = getattr(msg, "ack_timeout", p.ACK_TIMEOUT)
        elif isinstance(msg, p.Error) and not w.registered:   # its engine is not registered yet: retry
            self.world.client_send(w.identity, p.RegisterWorker(version=p.PROTOCOL_VERSION, engine_id=self.name,
                                                                rank=w.rank, pid=2000 + w.rank,
                                                                mapped=sorted(w.mapped)))
        elif isinstance(msg, p.MapSlab):
            pages = [page for page, _offset in msg.pages]
            if any(page not in w.channel for page in pages):
                self.world.violation(f"engine {self.name}: MapSlab names pages that never came on the channel")
            for page in pages:
                if page in w.channel:
                    w.channel.remove(page)
            for page in pages:
                wrote = self.world.device.content.get(page)
                if wrote is not None and wrote[1] not in self.namespaces:
                    self.world.violation(f"engine {self.name} ({self.namespace}) mapped page {page} holding "
                                         f"{wrote[0]}'s data (namespace {wrote[1]})")
            w.mapped[msg.slab] = pages
            self.world.dirty = True
            self.world.client_send(w.identity, p.Mapped(req_id=msg.req_id, engine_id=self.name, rank=w.rank,
                                                        slab=msg.slab))
        elif isinstance(msg, p.UnmapSlab):
            if self.stepping and msg.at_once:
                self.check_settled(w, msg.slab)
            if self.stepping and not msg.at_once:
                w.defer(msg, self.world.now)
            else:
                self.unmap(w, msg)

    def check_settled(self, w: SimWorker, slab_id: int) -> None:
        """A slab unmapped while a step is in flight: that step must write none of its pages."""
        step, pages = self.step, set(w.mapped.get(slab_id, ()))
        self.world.counts["unmapped_in_step"] += 1
        if step is not None and (any(where[0] in pages for where, _ in step.torn) or any(
                blk.block_id // BLOCKS_PER_SLAB == slab_id for blk, _ in step.writes)):
            self.world.violation(f"engine {self.name}: slab {slab_id} unmapped at once (settled) while step "
                                 f"{step.n} writes it")

    def unmap(self, w: SimWorker, msg: p.UnmapSlab) -> None:
        occupancy = self.pool.occupancy(msg.slab)     # None: a slab the pool does not hold
        if not self.dying and occupancy is not None and occupancy[0]:
            self.world.violation(f"engine {self.name}: slab {msg.slab} unmapped under a live block")
        w.mapped.pop(msg.slab, None)
        self.world.client_send(w.identity, p.Unmapped(req_id=msg.req_id, engine_id=self.name, rank=w.rank,
                                                      slab=msg.slab))

    # ------------------------------------------------------------- workload
    def work(self, rng: random.Random, now: float) -> None:
        """One thing the engine does: between steps the scheduler schedules
        one or ends requests; any time the I/O thread ships the journal or
        returns an idle slab."""
        if not self.registered or self.dying or self.leaving:
            return
        if self.clear_due:
            # The deferred ClearIndex runs at the scheduler's next poll; until
            # then its own flushes (``ensure``'s) may ship the last ticket heard.
            if self.tier_ack != self.tier_ack_sent and rng.random() < FLUSH_BEFORE_CLEAR:
                self.flush_journal(deferred=False)
                self.world.counts["tier_ack_before_clear"] += 1
            self.clear_index()
        op = rng.random()
        if self.drain_until and now >= self.drain_until:
            self.drain_until = 0.0
            self.pool.undrain()
        if self.diverging and now - self.diverge_sent > DIVERGE_TIMEOUT:
            self.diverging = 0                 # no answer in time: the call gives up, the weights change
        if self.step is None and not self.private and rng.random() < DIVERGE:
            self.diverge()
        elif self.diverging and op < 0.75:
            pass                               # the scheduler waits in ``diverge`` (the I/O thread goes on)
        elif self.step is None and op < 0.5:
            self.schedule_step(rng)
        elif op < 0.75 and self.live and (self.step is None or (FREE_IN_STEP and rng.random() < FREE_IN_STEP)):
            req = self.live.pop(rng.randrange(len(self.live)))
            self.pool.free(req.blocks[::-1])   # the tail first: it is evicted first
        elif 0.8 <= op < 0.9:
            idle = self.pool.drained_slabs() + self.pool.idle_slabs()
            if idle:
                back = hand_back(self.pool, self.name, [rng.choice(idle)])
                if not self.settles:
                    back.settled = []
                self.flush_journal()
                self.send(back)
        elif op >= 0.9:
            self.flush_journal()
        if self.tier_ack != self.tier_ack_sent or (self.tier and rng.random() < JOURNAL_TICK):
            self.flush_journal()                  # the I/O thread's tick (for a new ticket, at once)
        self.expire_grows(now)

    def clear_index(self, scope: int = 0) -> None:
        """``ClearIndex`` (``EngineClient._clear_index``): every key dropped;
        the next journal carries its scope, with the CLEAR."""
        self.scope = max(self.scope, scope, 0 if self.clear_stale else self.clear_due)
        self.clear_due, self.clear_stale = 0, False
        self.pool.clear_index()
        self.world.counts["clear_index"] += 1

    def key(self, prompt: int, i: int) -> bytes:
        return f"{self.checkpoint}:{prompt}:{i}".encode()

    def diverge(self) -> None:
        """Its weights change in memory (an RL update, then a prefix-cache
        reset): between steps, as vLLM runs utility calls. From now on it
        writes KV of weights nobody else has, in a namespace of its own."""
        self.private = True
        self.namespace = f"{self.checkpoint}~{self.name}.{self.incarnation}.{self.world.rng.randrange(1 << 30)}"
        self.namespaces.add(self.namespace)
        self.world.counts["diverged"] += 1
        self.diverging = self.send(p.Diverge(engine_id=self.name, namespace=self.namespace, reason="weights updated"))
        self.diverge_sent = self.world.now

    def schedule_step(self, rng: random.Random) -> None:
        """Schedule a model step: a new request (its prefix hits, the rest
        allocated, the full blocks keyed) or one more block of a running one.
        Allocating evicts cached blocks when free ones run out: the step then
        rewrites them. Short of blocks, it asks the daemon instead."""
        pool = self.pool
        growing = [r for r in self.live if len(r.blocks) < MAX_REQUEST_BLOCKS or r.keyed < len(r.blocks)]
        if growing and rng.random() < 0.4:
            req = rng.choice(growing)
            if req.keyed < len(req.blocks):            # its last block fills up: keyed now, written by the step
                n = pool.begin_step()
                blk, key = req.blocks[-1], self.key(req.prompt, req.keyed)
                pool.cache([blk], [key])
                req.keyed += 1
                writes: list[tuple[BlockRecord, bytes | None]] = [(blk, key)]
            else:
                if pool.num_available < 1:
                    self.grow(1, demand=rng.random() < self.demand_share)
                    return
                n = pool.begin_step()
                blk = pool.allocate(1)[0]
                req.blocks.append(blk)
                writes = [(blk, None)]
        else:
            prompt, length = rng.randrange(PROMPTS), rng.randint(1, 6)
            keys = [self.key(prompt, i) for i in range(length)]
            hits = pool.lookup(keys[:length - 1])      # the last block is computed, never hit (as vLLM)
            need = length - len(hits)
            short = need - (pool.num_available - sum(1 for blk in hits if not blk.ref_cnt))
            if short > 0:
                self.grow(math.ceil(short / BLOCKS_PER_SLAB), demand=rng.random() < self.demand_share)
                return
            n = pool.begin_step()
            pool.touch(hits)
            new = pool.allocate(need)
            full = need if rng.random() < 0.5 else need - 1
            if full:
                pool.cache(new[:full], keys[len(hits):len(hits) + full])
            self.live.append(Request(prompt, hits + new, len(hits) + full))
            writes = [(blk, keys[len(hits) + i] if i < full else None) for i, blk in enumerate(new)]
        self.step = Step(n, writes)
        if self.needs_seal():
            self.seal()
        else:
            self.run_step()

    def needs_seal(self) -> bool:
        """``EngineClient.seal_step``'s rule: the daemon keeps departed engines'
        cache and a dropped key is not acknowledged yet (not while there is no
        daemon, nor for a while after a sync failed)."""
        return bool(self.orphan_ttl) and (self.removal_unacked or self.pool.journal.removed) \
            and self.registered and self.world.now - self.sync_failed_at >= SYNC_BACKOFF

    def seal(self) -> None:
        """Ship the journal with ``sync``: the step runs once the daemon's Ok is back."""
        step = self.step
        if step is None:
            return
        self.demote_ahead()
        ack = self.tier_ack
        batch = self.pool.take_journal()
        self.removal_unacked |= batch.removed
        step.sync_req = self.send(p.Journal(engine_id=self.name, ops=p.journal_ops(batch.ops),
                                            occupancy=batch.occupancy,
                                            stats={"block_ops": self.pool.stats.block_ops}, sync=True,
                                            tier_ack=ack, scope=self.scope))
        self.tier_ack_sent = ack
        step.sync_sent = self.world.now

    def sync_answered(self, ok: bool) -> None:
        """The seal's answer: Ok (every journal before it applied), or a failure
        (an error, no answer in time, the connection lost): the step runs anyway."""
        if ok:
            self.removal_unacked = False
        else:
            self.sync_failed_at = self.world.now
        if self.step is not None:
            self.step.sync_req = 0
            self.run_step()

    def run_step(self) -> None:
        """The model writes the step's blocks into every worker's pages: torn
        until the step ends."""
        step = self.step
        if step is None:
            return
        step.running = True
        world = self.world
        world.check_rewrite(self, step)
        kv, content = world.device.kv, world.device.content
        for blk, key in step.writes:
            slab_id, offset = divmod(blk.block_id, BLOCKS_PER_SLAB)
            for w in self.workers:
                pages = w.mapped.get(slab_id)
                if pages is None:             # a dead worker's (its engine is dying) writes nothing
                    if not self.dying:
                        world.violation(f"engine {self.name}: block {blk.block_id} live on an unmapped slab")
                    continue
                for page in pages:
                    written = KV(self.namespace, self.name, key, step.n)
                    kv[(page, offset)] = written
                    content[page] = (self.name, self.namespace)
                    step.torn.append(((page, offset), written))

    def advance_step(self, rng: random.Random) -> None:
        """The step in flight: a seal that waited too long gives up; a running
        step ends (not on a dying engine: it waits on its dead worker)."""
        step = self.step
        if step is None:
            return
        if step.sync_req:
            if self.world.now - step.sync_sent > SYNC_TIMEOUT:
                self.sync_answered(ok=False)
        elif not self.dying and self.world.now >= step.until and rng.random() < 0.5:
            self.finish_step()

    def keep_busy(self, now: float) -> None:
        """While the step holds unmaps, each worker says so (``Busy``) at once
        and every quarter of the ack deadline after (``WorkerClient._tick``); a
        frozen worker says nothing. Counts the long steps that held an unmap
        past the ack deadline."""
        step = self.step
        if step is None:
            return
        for w in self.workers:
            if not w.deferred:
                continue
            if step.until and not step.overlapped and now - w.deferred_at > p.ACK_TIMEOUT:
                step.overlapped = True
                self.world.counts["long_step_held_unmap"] += 1
            if BUSY is not None and w.stuck_until <= now and now - w.busy_at >= w.ack_timeout / 4:
                w.busy_at = now
                self.world.send_busy(self.name, w)
                if step.until:
                    self.world.counts["busy_long_step"] += 1     # (short steps say it too, once)

    def finish_step(self) -> None:
        """The running step ends: its KV is whole, the pool hears it, and the
        unmaps deferred during it run (a safe point)."""
        step = self.step
        if step is None or not step.running:
            return
        kv = self.world.device.kv
        for where, written in step.torn:
            if kv.get(where) is written:
                written.complete = True
        self.step = None
        self.pool.end_step(step.n)
        for w in self.workers:
            deferred, w.deferred = w.deferred, []
            for msg in deferred:
                self.unmap(w, msg)

    def abandon_workers(self, frozen: bool, step_for: float, exit_after: float) -> None:
        """The engine's process is killed, but its workers hang on (a worker
        stuck in the driver, a step that outlives its engine): they keep
        their connections, page channels and mappings, as ghosts of this
        registration (``ghosts.py``), until they exit. The engine itself comes
        back under the same id with new workers: a new registration, a new
        secret, while the old one may still be departing."""
        now = self.world.now
        for w in self.workers:
            if w.identity in self.world.wires:
                self.world.haunt(self.name, w, frozen, now + step_for, now + exit_after)
        self.workers = [SimWorker(r, b"") for r in range(len(self.workers))]
        self.crash()

    def expire_leave(self, now: float) -> None:
        if self.leaving and now - self.leave_sent > UNREGISTER_TIMEOUT:
            self.gone()

    def grow(self, slabs: int, demand: bool) -> None:
        if len(self.pending) < 3 and self.pool.num_slabs + slabs <= max(self.max_slabs, 1):
            req = self.send(p.Grow(engine_id=self.name, slabs=min(slabs, 4), demand=demand))
            self.pending[req] = (self.world.now, demand)

    def expire_grows(self, now: float) -> None:
        """The client gives up waiting (a late answer is then applied as it comes)."""
        for req, (sent, _demand) in list(self.pending.items()):
            if now - sent > CLIENT_GROW_TIMEOUT:
                del self.pending[req]
