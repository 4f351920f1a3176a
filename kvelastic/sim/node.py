"""A node-sized, trace-driven simulation: eight engines on one 80 GiB device.

The real ``Allocator`` decides; each engine has a real ``SlabPool`` and the
client's real ``ReservePolicy``; engines, workers and the transport are
simulated on a fake clock, driven by a day-long request trace
(``kvelastic.sim.traces``). Everything is seeded: a seed replays exactly.

Each engine behaves as the vLLM plugin does (docs/architecture.md, Grow):
- a scheduler step every ``STEP`` seconds: running requests first (a decode
  that crosses a block boundary needs one block; when none can be had the
  newest running request is preempted and recomputed later), then waiting
  requests in arrival order (prefix-cache hits first, then new blocks);
- a capacity check that needs more *free* blocks than the pool has sends a
  demand ``Grow`` and blocks the scheduler until the answer or
  ``DEMAND_TIMEOUT`` (``EngineClient.ensure`` with ``keep_cache``); after a
  refusal it does not ask again for ``REFUSAL_BACKOFF``; then free + cached
  blocks are what it can use (allocation evicts LRU cached blocks);
- the I/O thread's tick: heartbeats, reserve refills and returns as
  ``ReservePolicy`` says, the journal every ``JOURNAL_INTERVAL``; a
  ``Reclaim`` is answered at once with ``take_slab_back`` of each slab
  (refusing those with live blocks); every ``Granted`` is applied;
- workers acknowledge ``MapSlab`` after the map time and ``UnmapSlab`` at
  the end of their current step.

The same trace runs again with the memory split statically (each engine a
fixed equal share, no daemon, no moves): the baseline. The oracle knows the
future: the trace's live demand with unlimited memory, capped at the budget.

What it measures (``run_node`` returns one JSON-able dict): the allocator's
decisions (every input: messages, ticks, peers, pages created) and the CPU
time this thread spent inside them, against the node's busiest second; the
loop's status snapshot apart; utilisation (live, held, cached) against the
oracle and the static split; demand grows served and refused; handoff
latency (a demand grow that set off a reclaim, from the engine's send to its
answer); slab moves and thrash from ``Allocator.moves``/``thrash``; waits and
preemptions; what idle engines keep; invariant violations (``Allocator.check``
every ``CHECK_EVERY`` s, plus the engines' own view of the books).
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import gc
import heapq
import logging
import math
import os
import random
import time
from collections import deque
from typing import Any

from kvelastic import protocol as p
from kvelastic.client.reserve import ReservePolicy
from kvelastic.core.pool import SlabPool
from kvelastic.daemon import effects as fx
from kvelastic.daemon.allocator import Allocator, Timing
from kvelastic.daemon.state import Phase
from kvelastic.errors import PoolError
from kvelastic.sim import traces
from kvelastic.sim.traces import BLOCK_TOKENS, GIB, PAGE, Request, Trace

BUDGET_PAGES = 40_960                 # 80 GiB of 2 MiB pages
STEP = 0.05                           # a scheduling step (and the client's I/O tick)
JOURNAL_INTERVAL = 0.05               # EngineClient.JOURNAL_INTERVAL
DEMAND_TIMEOUT = 2.0                  # kvelastic_vllm.block_pool.DEMAND_TIMEOUT
REFUSAL_BACKOFF = 0.2                 # kvelastic_vllm.block_pool.REFUSAL_BACKOFF
RESERVE_REFUSED_PAUSE = 0.5           # EngineClient: no reserve refill for this long after a refusal
MAX_BATCHED_TOKENS = 2048             # vLLM's max_num_batched_tokens: sets the reserve watermark
PREFILL_TOKENS_PER_STEP = 8192        # prompts admitted per step, in tokens
MAX_RUNNING = 256                     # vLLM's max_num_seqs
DAEMON_TICK = 0.1                     # kvelastic.daemon.server.TICK_INTERVAL
STATUS_EVERY = 10                     # the loop's status snapshot: timed on one tick in this many
SAMPLE = 1.0                          # metrics every simulated second
CHECK_EVERY = 5.0                     # Allocator.check() and the node's own checks
MAP_SECONDS_PER_PAGE = 40e-6          # cuMemMap + cuMemSetAccess of one 2 MiB page
GROW_SLACK = 0.7                      # transport both ways plus a daemon tick
IDLE_SETTLE = 2.0                     # after idle_grace: the client's tick returns, the workers unmap


# The allocator's cost is this thread's CPU time: what one core spends on it,
# whatever else the machine runs meanwhile (wall time on a shared machine is not).
_cpu = time.thread_time


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclasses.dataclass
class Running:
    """A request's state in its engine."""

    r: Request
    keys: list[bytes]                  # prefix-cache key of each full block, prompt and output
    tokens: int                        # tokens whose KV must be held at admission (prompt, or recompute)
    left: int                          # output tokens still to generate
    blocks: list = dataclasses.field(default_factory=list)
    cached_upto: int = 0               # blocks[:cached_upto] have their keys
    decode_start: float = 0.0          # in the engine's virtual time
    admitted: float = -1.0             # first admission (real time)
    waited: bool = False               # could not be admitted at once for lack of memory
    preemptions: int = 0
    seq: int = 0


class NodeEngine:
    """One serving engine: scheduler, block pool, client I/O thread and workers."""

    def __init__(self, sim: NodeSim, index: int, spec: traces.EngineSpec, static_slabs: int = 0) -> None:
        self.sim = sim
        self.index = index
        self.spec = spec
        self.name = spec.name
        m = spec.model
        self.model = m
        self.bps = m.blocks_per_slab
        self.pool = SlabPool(self.bps, block_size=BLOCK_TOKENS, block_bytes=m.block_bytes)
        self.static = static_slabs > 0
        for slab_id in range(static_slabs):
            self.pool.add_slab(slab_id)
        self.pool.take_journal()
        self.reserve = ReservePolicy(math.ceil(MAX_BATCHED_TOKENS / BLOCK_TOKENS) + self.bps)
        self.identity = f"E:{self.name}".encode()
        self.worker_ids = [f"W:{self.name}:{r}".encode() for r in range(m.workers)]
        self.mapped: list[set[int]] = [set() for _ in range(m.workers)]
        self.token = b""
        self.max_slabs = static_slabs
        self.registered = False
        self.next_req = 0
        # scheduler
        self.waiting: deque[Running] = deque()
        self.running: dict[int, Running] = {}          # rid -> state, in admission order
        self.decode: list[tuple[float, int, int]] = []  # (virtual time, seq, rid)
        self._seq = 0
        self.stalled = 0.0                               # real seconds the scheduler spent blocked
        self.blocked: dict[str, Any] | None = None       # the demand the scheduler waits on
        self.refused_at = -1e9
        # client I/O thread
        self.reserve_req = 0                             # a reserve grow in flight (its req_id)
        self.refused_until = 0.0
        self.last_flush = 0.0
        self.last_beat = -1.0
        self.block_ops = 0                               # the pool's activity counter when last looked at
        self.grows: dict[int, tuple[float, bool, int]] = {}   # req_id -> (sent at, demand, slabs) until answered
        # counters
        self.stats = collections.Counter()
        self.queue_delays: list[float] = []
        self.finished = 0
        self.last_busy = 0.0                             # last step with a request to serve
        self.stopped = False

    # ------------------------------------------------------------ time
    def vnow(self) -> float:
        """The engine's virtual time: real time minus the time its scheduler was blocked."""
        now = self.sim.now
        stalled = self.stalled + (now - self.blocked["since"] if self.blocked else 0.0)
        return now - stalled

    # ------------------------------------------------------------ daemon link
    def start(self) -> None:
        sim = self.sim
        sim.identities[self.identity] = (self, -1)
        sim.call("peer_opened", sim.allocator.peer_opened, self.name, -1, sim.now)
        self.send(p.RegisterEngine(version=p.PROTOCOL_VERSION, engine_id=self.name, pid=1000 + self.index,
                                   namespace=f"{self.model.name}-{self.name}", page_size=PAGE,
                                   pages_per_worker=self.model.pages_per_worker, num_workers=self.model.workers,
                                   blocks_per_slab=self.bps, block_bytes=self.model.block_bytes,
                                   block_tokens=BLOCK_TOKENS))

    def send(self, msg: p.Msg) -> int:
        self.next_req += 1
        msg.req_id = self.next_req
        self.sim.to_daemon(self.identity, msg)
        return self.next_req

    def grow(self, slabs: int, demand: bool) -> int:
        req = self.send(p.Grow(engine_id=self.name, slabs=slabs, demand=demand))
        self.grows[req] = (self.sim.now, demand, slabs)
        self.stats["demand_grows" if demand else "reserve_grows"] += 1
        return req

    def on_message(self, msg: p.Msg) -> None:
        sim = self.sim
        if isinstance(msg, p.Registered):
            self.registered, self.max_slabs, self.token = True, msg.max_slabs, msg.token
            self.reserve.idle_grace = msg.idle_grace
            for rank, wid in enumerate(self.worker_ids):
                sim.identities[wid] = (self, rank)
                sim.call("peer_opened", sim.allocator.peer_opened, self.name, rank, sim.now, self.token)
                sim.to_daemon(wid, p.RegisterWorker(version=p.PROTOCOL_VERSION, engine_id=self.name, rank=rank,
                                                    pid=2000 + rank, token=self.token))
            return
        if isinstance(msg, (p.Granted, p.Error)) and msg.req_id in self.grows:
            sent, demand, asked = self.grows.pop(msg.req_id)
            sim.grow_answered(self, msg, sent, demand, asked)
        if isinstance(msg, p.Granted):
            for slab_id in msg.slabs:
                try:
                    self.pool.add_slab(slab_id)
                except PoolError as exc:
                    sim.violation(f"engine {self.name}: granted slab {slab_id} not usable: {exc}")
                    continue
                for rank, mapped in enumerate(self.mapped):
                    if slab_id not in mapped:
                        sim.violation(f"engine {self.name}: slab {slab_id} granted before worker {rank} mapped it")
            if msg.req_id == self.reserve_req:
                self.reserve_req = 0
                if not msg.slabs:
                    self.refused_until = sim.now + RESERVE_REFUSED_PAUSE
                self._reserve_answered()
            elif self.blocked is not None and msg.req_id == self.blocked.get("req"):
                self._unblock()
        elif isinstance(msg, p.Error):
            if msg.req_id == self.reserve_req:
                self.reserve_req = 0
                self._reserve_answered()
            elif self.blocked is not None and msg.req_id == self.blocked.get("req"):
                self._unblock()
        elif isinstance(msg, p.Reclaim):
            given, refused = [], []
            for slab_id in msg.slabs:
                try:
                    self.pool.take_slab_back(slab_id, reason="reclaim")
                    given.append(slab_id)
                except PoolError:
                    refused.append(slab_id)
            self.stats["reclaimed_slabs"] += len(given)
            self.stats["refused_slabs"] += len(refused)
            self.flush_journal()
            sim.to_daemon(self.identity, p.ReclaimDone(req_id=msg.req_id, engine_id=self.name, given=given,
                                                       refused=refused))

    def on_worker_message(self, rank: int, msg: p.Msg) -> None:
        sim = self.sim
        wid = self.worker_ids[rank]
        if isinstance(msg, p.MapSlab):
            self.mapped[rank].add(msg.slab)
            ack = p.Mapped(req_id=msg.req_id, engine_id=self.name, rank=rank, slab=msg.slab)
            sim.at(sim.now + len(msg.pages) * MAP_SECONDS_PER_PAGE, sim.to_daemon, wid, ack)
        elif isinstance(msg, p.UnmapSlab):
            # At the end of the worker's current step (a safe point).
            sim.at(sim.now + sim.rng.uniform(0.0, STEP), self._unmap, rank, msg)

    def _unmap(self, rank: int, msg: p.UnmapSlab) -> None:
        occ = self.pool.occupancy(msg.slab)
        if occ is not None and occ[0]:
            self.sim.violation(f"engine {self.name}: slab {msg.slab} unmapped under {occ[0]} live block(s)")
        self.mapped[rank].discard(msg.slab)
        self.sim.to_daemon(self.worker_ids[rank], p.Unmapped(req_id=msg.req_id, engine_id=self.name, rank=rank,
                                                             slab=msg.slab))

    def flush_journal(self) -> None:
        """EngineClient._flush_journal: the ops, occupancy and the pool's counters."""
        batch = self.pool.take_journal()
        if not batch:
            return
        self.last_flush = self.sim.now
        if self.static:
            return
        stats = self.pool.stats
        counters = {"lookups": stats.lookups, "lookup_blocks": stats.lookup_blocks, "hit_blocks": stats.hit_blocks,
                    "query_tokens": stats.query_tokens, "hit_tokens": stats.hit_tokens,
                    "token_mismatches": stats.token_mismatches, "block_ops": stats.block_ops}
        counters.update({f"evictions_{k}": v for k, v in stats.evictions.items()})
        ops = p.journal_ops(batch.ops)
        for start in range(0, max(len(ops), 1), 20_000):
            last = start + 20_000 >= len(ops)
            self.sim.to_daemon(self.identity, p.Journal(engine_id=self.name, ops=ops[start:start + 20_000],
                                                        occupancy=batch.occupancy if last else {},
                                                        stats=counters if last else {}))

    def io_tick(self) -> None:
        """EngineClient._tick: heartbeat, reserve refill, returns, journal."""
        sim, now, pool = self.sim, self.sim.now, self.pool
        if now - self.last_beat >= p.HEARTBEAT_INTERVAL:
            self.last_beat = now
            sim.to_daemon(self.identity, p.Heartbeat(engine_id=self.name))
        if pool.stats.block_ops != self.block_ops:     # blocks allocated, touched or freed: active
            self.block_ops = pool.stats.block_ops
            self.reserve.touch(now)
        want = self.reserve.refill(pool, now, self.max_slabs)
        if want and not self.reserve_req and now >= self.refused_until:
            self.reserve_req = self.grow(want, demand=False)
        returned = self.reserve.to_return(pool, now)
        for slab_id in returned:
            pool.take_slab_back(slab_id, reason="return")
        self.reserve.forget(returned)
        if returned or now - self.last_flush >= JOURNAL_INTERVAL:
            self.flush_journal()
        if returned:
            self.stats["returned_slabs"] += len(returned)
            self.send(p.Return(engine_id=self.name, slabs=returned))

    # ------------------------------------------------------------ demand (ensure)
    def ensure(self, need: int) -> bool | None:
        """EngineClient.ensure(need, keep_cache=True): True/False now, or None:
        the scheduler blocks until the daemon answers (or DEMAND_TIMEOUT)."""
        pool = self.pool
        self.reserve.touch(self.sim.now)         # a demand is activity
        if need - pool.num_free <= 0:
            return True
        deadline = self.sim.now + DEMAND_TIMEOUT
        if self.reserve_req:                     # a reserve grow on its way: wait for it first
            self._block(need, deadline, req=None)
            return None
        want = min(math.ceil((need - pool.num_free) / self.bps), self.max_slabs - pool.num_slabs)
        if want <= 0:
            return False
        self.flush_journal()                     # the daemon judges the demand by its mirror
        self._block(need, deadline, req=self.grow(want, demand=True))
        return None

    def _block(self, need: int, deadline: float, req: int | None) -> None:
        self.blocked = {"need": need, "req": req, "since": self.sim.now, "deadline": deadline}
        self.sim.at(deadline, self._deadline, deadline)

    def _reserve_answered(self) -> None:
        b = self.blocked
        if b is None or b["req"] is not None:
            return
        need = b["need"]
        if need - self.pool.num_free <= 0 or self.stopped:
            self._unblock()
            return
        want = min(math.ceil((need - self.pool.num_free) / self.bps), self.max_slabs - self.pool.num_slabs)
        if want <= 0:
            self._unblock()
            return
        self.flush_journal()
        b["req"] = self.grow(want, demand=True)

    def _deadline(self, deadline: float) -> None:
        if self.blocked is not None and self.blocked["deadline"] == deadline:
            self.stats["demand_timeouts"] += 1
            self._unblock()

    def _unblock(self) -> None:
        b, self.blocked = self.blocked, None
        self.stalled += self.sim.now - b["since"]
        if b["need"] - self.pool.num_free > 0:
            self.refused_at = self.sim.now           # ensure() returned False: back off
        self.schedule()                              # the step goes on where it stopped

    def capacity(self, need: int) -> int | None:
        """ElasticBlockPool.get_num_free_blocks after expect(need); None: blocked."""
        pool = self.pool
        if need > pool.num_free and not self.static and pool.num_slabs < self.max_slabs \
                and self.sim.now - self.refused_at > REFUSAL_BACKOFF:
            if self.ensure(need) is None:
                return None
        return pool.num_free + pool.num_cached

    # ------------------------------------------------------------ scheduler
    def arrive(self, r: Request) -> None:
        if r.group >= 0:
            keys = [b"P%d:%d:%d" % (self.index, r.group, i) for i in range(r.prefix_blocks)]
        else:
            keys = []
        total = (r.prompt + r.output) // BLOCK_TOKENS
        keys += [b"U%d:%d" % (r.rid, i) for i in range(len(keys), total)]
        self.waiting.append(Running(r, keys, r.prompt, r.output))
        self.stats["arrived"] += 1

    def step(self) -> None:
        """A scheduling step and the client's tick, every STEP seconds."""
        if self.stopped:                             # the run is over: only heartbeats
            if self.registered and self.sim.now - self.last_beat >= p.HEARTBEAT_INTERVAL:
                self.last_beat = self.sim.now
                self.sim.to_daemon(self.identity, p.Heartbeat(engine_id=self.name))
            return
        if self.running or self.waiting or self.blocked is not None:
            self.last_busy = self.sim.now
        if self.blocked is None:
            self.schedule()
        if not self.static:
            if self.registered:
                self.io_tick()
        elif self.pool.journal.ops or self.pool.journal.dirty:
            self.pool.take_journal()

    def schedule(self) -> None:
        if self.blocked is not None or self.stopped:
            return
        pool = self.pool
        vnow = self.vnow()
        touched = False
        # 1. running requests: decode block boundaries and finishes
        while self.decode and self.decode[0][0] <= vnow:
            _t, _s, rid = self.decode[0]
            req = self.running.get(rid)
            if req is None:                          # preempted since: a stale entry
                heapq.heappop(self.decode)
                continue
            if req.left <= 0 or len(req.blocks) * BLOCK_TOKENS >= req.tokens + req.left:
                heapq.heappop(self.decode)
                self._finish(req)
                touched = True
                continue
            got = self._decode_block(req)
            if got is None:
                return                               # blocked: the entry stays due
            heapq.heappop(self.decode)
            touched = True
            if got:
                self._next_event(req)
        # 2. waiting requests, in order
        budget = PREFILL_TOKENS_PER_STEP
        while self.waiting and budget > 0 and len(self.running) < MAX_RUNNING:
            req = self.waiting[0]
            admitted = self._admit(req)
            if admitted is None:
                return
            if not admitted:
                if not req.waited:
                    req.waited = True
                    self.stats["waited"] += 1
                self.stats["wait_steps"] += 1
                break
            self.waiting.popleft()
            budget -= req.tokens
            touched = True
        if touched and pool.num_free < self.reserve.low_watermark and not self.static and self.registered:
            self.io_tick()                           # get_new_blocks wakes the I/O thread

    def _decode_block(self, req: Running) -> bool | None:
        """The next block of a running request: True when it got it, False when
        the request itself was preempted, None when the scheduler blocked."""
        pool = self.pool
        while True:
            cap = self.capacity(1)
            if cap is None:
                return None
            if cap >= 1:
                break
            victim = next(reversed(self.running.values()))   # the newest running request
            self._preempt(victim)
            if victim is req:
                return False
        # The block before the new one is full now: it joins the prefix cache.
        k = len(req.blocks)
        if req.cached_upto < k <= len(req.keys):
            pool.cache(req.blocks[req.cached_upto:k], req.keys[req.cached_upto:k])
            req.cached_upto = k
        req.blocks += pool.allocate(1)
        return True

    def _admit(self, req: Running) -> bool | None:
        pool = self.pool
        full = req.tokens // BLOCK_TOKENS
        nblocks = math.ceil(req.tokens / BLOCK_TOKENS)
        hits = pool.lookup(req.keys[:full])
        cached_hits = sum(1 for b in hits if b.ref_cnt == 0)
        need = nblocks - len(hits) + cached_hits
        cap = self.capacity(need)
        if cap is None:
            return None
        if need > cap:
            return False
        pool.touch(hits)
        blocks = hits + pool.allocate(nblocks - len(hits))
        if full > len(hits):
            pool.cache(blocks[len(hits):full], req.keys[len(hits):full])
        req.blocks = blocks
        req.cached_upto = full
        now = self.sim.now
        if req.admitted < 0:
            req.admitted = now
            self.queue_delays.append(now - req.r.arrival)
        self.stats["hit_blocks"] += len(hits)
        self.stats["prompt_blocks"] += nblocks
        self._seq += 1
        req.seq = self._seq
        self.running[req.r.rid] = req
        req.decode_start = self.vnow() + traces.prefill_seconds((req.tokens - len(hits) * BLOCK_TOKENS))
        self._next_event(req)
        return True

    def _next_event(self, req: Running) -> None:
        """When the request next needs a block, or finishes (virtual time)."""
        k = len(req.blocks)
        end = req.tokens + req.left
        tps = self.spec.decode_tps
        if k * BLOCK_TOKENS < end:
            at = req.decode_start + max(0, k * BLOCK_TOKENS - req.tokens) / tps
        else:
            at = req.decode_start + req.left / tps
        self._seq += 1
        heapq.heappush(self.decode, (at, self._seq, req.r.rid))

    def _generated(self, req: Running) -> int:
        return max(0, min(req.left, int((self.vnow() - req.decode_start) * self.spec.decode_tps)))

    def _finish(self, req: Running) -> None:
        pool = self.pool
        k = min(len(req.blocks), len(req.keys))
        if req.cached_upto < k:
            pool.cache(req.blocks[req.cached_upto:k], req.keys[req.cached_upto:k])
        pool.free(reversed(req.blocks))
        del self.running[req.r.rid]
        self.finished += 1
        self.sim.finished_at.append(self.sim.now)

    def _preempt(self, req: Running) -> None:
        """vLLM's recompute preemption: the request's blocks go (its full ones
        stay cached), it waits at the head of the queue with what it generated."""
        pool = self.pool
        generated = self._generated(req)
        k = min(len(req.blocks), len(req.keys), (req.tokens + generated) // BLOCK_TOKENS)
        if req.cached_upto < k:
            pool.cache(req.blocks[req.cached_upto:k], req.keys[req.cached_upto:k])
        pool.free(reversed(req.blocks))
        req.blocks = []
        req.cached_upto = 0
        req.tokens += generated
        req.left -= generated
        req.preemptions += 1
        del self.running[req.r.rid]
        self.waiting.appendleft(req)
        self.stats["preemptions"] += 1

    # ------------------------------------------------------------ metrics
    def live_bytes(self) -> int:
        return self.pool.num_live * self.model.bytes_per_block

    def cached_bytes(self) -> int:
        return self.pool.num_cached * self.model.bytes_per_block


class NodeSim:
    """The event loop: engines, workers, transport and the daemon's loop, on a fake clock."""

    def __init__(self, trace: Trace, seed: int, elastic: bool = True, budget_pages: int = BUDGET_PAGES,
                 timing: Timing = Timing()) -> None:
        self.trace = trace
        self.rng = random.Random(seed)
        self.seed = seed
        self.elastic = elastic
        self.budget_pages = budget_pages
        self.budget_bytes = budget_pages * PAGE
        self.now = 0.0
        self._heap: list = []
        self._seq = 0
        self.violations: list[str] = []
        self.identities: dict[bytes, tuple[NodeEngine, int]] = {}
        self._up_due: dict[bytes, float] = {}
        self._down_due: dict[bytes, float] = {}
        self.allocator = Allocator({"0": budget_pages}, PAGE, timing=timing, events=False,
                                   token_source=lambda: self.rng.randbytes(16)) if elastic else None
        share = budget_pages // len(trace.specs)
        self.engines = [NodeEngine(self, i, spec, 0 if elastic else share // (spec.model.pages_per_worker
                                                                             * spec.model.workers))
                        for i, spec in enumerate(trace.specs)]
        seconds = int(math.ceil(trace.day_seconds)) + 1
        # The allocator's inputs and the wall-clock time spent inside it.
        self.calls: collections.Counter = collections.Counter()
        self.call_time: collections.Counter = collections.Counter()
        self.per_second = [0] * seconds
        self.busy_per_second = [0.0] * seconds
        self.slowest = (0.0, "", 0.0)
        self.alloc_seconds = 0.0
        self.status_times: list[float] = []
        self.status_per_second = [0.0] * seconds
        self._ticks = 0
        # Grows, reclaims, handoffs.
        self.reclaim_for: set[tuple[str, int]] = set()      # demand grows that set off a reclaim
        self.handoffs: list[float] = []                     # their latency, sent -> answer at the engine
        self.handoffs_empty = 0
        self.demand_latency: list[float] = []
        self.grow_outcomes: collections.Counter = collections.Counter()
        self.rejected: collections.Counter = collections.Counter()
        self.released_pages = 0
        self.created_pages = 0
        self.finished_at: list[float] = []
        self.thrash_events: list[tuple[float, str, str, int]] = []   # (t, from, to, slabs)
        self.demand_slabs_granted = 0
        self.created_per_second = [0] * seconds
        self.samples: list[dict[str, Any]] = []
        self.settled_at = math.inf                           # the engines stopped (end of day and drain)

    # ------------------------------------------------------------ events
    def at(self, t: float, fn, *args) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, fn, args))

    def run_until(self, end: float) -> None:
        heap = self._heap
        while heap and heap[0][0] <= end:
            t, _s, fn, args = heapq.heappop(heap)
            self.now = t
            fn(*args)
        self.now = end

    # ------------------------------------------------------------ transport
    def delay(self) -> float:
        """One way over ZMQ ipc: ~50 us, sometimes a few ms."""
        r = self.rng.random()
        return 50e-6 + (self.rng.expovariate(1 / 100e-6) if r < 0.98 else self.rng.uniform(1e-3, 5e-3))

    def to_daemon(self, identity: bytes, msg: p.Msg) -> None:
        due = max(self.now + self.delay(), self._up_due.get(identity, 0.0))
        self._up_due[identity] = due
        self.at(due, self._daemon_receives, identity, msg)

    def to_client(self, identity: bytes, msg: p.Msg) -> None:
        due = max(self.now + self.delay(), self._down_due.get(identity, 0.0))
        self._down_due[identity] = due
        self.at(due, self._client_receives, identity, msg)

    def _daemon_receives(self, identity: bytes, msg: p.Msg) -> None:
        if isinstance(msg, p.ReclaimDone):           # a move back (thrash) is counted while handling one
            rec = self.allocator.reclaims.get(msg.req_id)
            before = self.allocator.thrash["0"]
            self.call("ReclaimDone", self.allocator.handle, identity, msg, self.now)
            if self.allocator.thrash["0"] > before and rec is not None:
                self.thrash_events.append((round(self.now, 3), msg.engine_id, rec.grow.engine_id,
                                           self.allocator.thrash["0"] - before))
            return
        self.call(type(msg).__name__, self.allocator.handle, identity, msg, self.now)

    def _client_receives(self, identity: bytes, msg: p.Msg) -> None:
        engine, rank = self.identities[identity]
        if rank < 0:
            engine.on_message(msg)
        else:
            engine.on_worker_message(rank, msg)

    # ------------------------------------------------------------ the daemon's loop
    def call(self, kind: str, fn, *args) -> Any:
        """One allocator input (a decision), timed; its effects performed."""
        start = _cpu()
        out = fn(*args)
        spent = _cpu() - start
        self.alloc_seconds += spent
        self.calls[kind] += 1
        self.call_time[kind] += spent
        s = min(int(self.now), len(self.per_second) - 1)
        self.per_second[s] += 1
        self.busy_per_second[s] += spent
        if spent > self.slowest[0]:
            self.slowest = (spent, kind, self.now)
        self.perform(out)
        return out

    def snapshot(self) -> None:
        """The loop's status snapshot (``Allocator.status()``), timed apart from
        the decisions. The loop takes one every tick; sampled here once every
        ``STATUS_EVERY`` ticks (its cost at the loop's rate is extrapolated)."""
        start = _cpu()
        self.allocator.status()
        spent = _cpu() - start
        self.status_times.append(spent)
        s = min(int(self.now), len(self.per_second) - 1)
        self.status_per_second[s] = max(self.status_per_second[s], spent)

    def perform(self, effects: list[fx.Effect]) -> None:
        for e in effects:
            if isinstance(e, fx.Send):
                msg = e.msg
                if isinstance(msg, p.Reclaim):
                    rec = self.allocator.reclaims.get(msg.req_id)
                    if rec is not None and rec.grow.demand:
                        self.reclaim_for.add((rec.grow.engine_id, rec.grow.req_id))
                self.to_client(e.to, msg)
            elif isinstance(e, fx.CreatePages):
                ids = self.allocator.new_page_ids(e.count)
                self.created_pages += e.count
                self.created_per_second[min(int(self.now), len(self.created_per_second) - 1)] += e.count
                self.call("pages_created", self.allocator.pages_created, e.device, e.count, ids, self.now)
            elif isinstance(e, fx.ReleasePages):
                self.released_pages += len(e.pages)
            elif isinstance(e, fx.Rejected):
                self.rejected[e.reason.value] += 1

    def daemon_tick(self) -> None:
        self.call("tick", self.allocator.tick, self.now)
        self._ticks += 1
        if self._ticks % STATUS_EVERY == 0:
            self.snapshot()
        self.at(self.now + DAEMON_TICK, self.daemon_tick)

    def grow_answered(self, engine: NodeEngine, msg: p.Msg, sent: float, demand: bool, asked: int) -> None:
        if not demand:
            self.grow_outcomes["reserve_" + ("granted" if isinstance(msg, p.Granted) and msg.slabs
                                             else "refused")] += 1
            return
        latency = self.now - sent
        self.demand_latency.append(latency)
        if isinstance(msg, p.Error):
            self.grow_outcomes[f"demand_error_{msg.reason}"] += 1
        else:
            self.grow_outcomes["demand_granted_full" if len(msg.slabs) >= asked else
                               "demand_granted_partly" if msg.slabs else "demand_refused"] += 1
            self.demand_slabs_granted += len(msg.slabs)
        if (engine.name, msg.req_id) in self.reclaim_for:
            self.reclaim_for.discard((engine.name, msg.req_id))
            if isinstance(msg, p.Granted) and msg.slabs:
                self.handoffs.append(latency)
            else:
                self.handoffs_empty += 1

    # ------------------------------------------------------------ checks and samples
    def violation(self, what: str) -> None:
        if len(self.violations) < 100:
            self.violations.append(f"seed {self.seed} t={self.now:.3f}: {what}")

    def check(self) -> None:
        gc.collect()                 # here, not inside a timed allocator call (run() turns automatic GC off)
        if self.elastic:
            try:
                self.allocator.check()
            except AssertionError as exc:
                self.violation(f"books: {exc}")
            limit = p.GROW_TIMEOUT + GROW_SLACK
            for engine in self.engines:
                record = self.allocator.engines.get(engine.name)
                if record is None:
                    if engine.registered:
                        self.violation(f"engine {engine.name} is not on the daemon's books")
                    continue
                held = {sid for sid, s in record.slabs.items() if s.phase is Phase.HELD}
                extra = set(engine.pool.slab_ids()) - held
                if extra:
                    self.violation(f"engine {engine.name} uses slabs {sorted(extra)[:5]} the daemon does not "
                                   f"book as held by it")
                for req, (sent, demand, _n) in engine.grows.items():
                    if self.now - sent > limit:
                        self.violation(f"engine {engine.name}: {'demand' if demand else 'reserve'} grow {req} "
                                       f"unanswered after {self.now - sent:.2f} s")
        self.at(self.now + CHECK_EVERY, self.check)

    def sample(self) -> None:
        row: dict[str, Any] = {"t": self.now, "held": [], "live": [], "cached": [], "empty_slabs": [],
                               "held_slabs": [], "pool_slabs": [], "quiet_for": []}   # held_slabs: not unmapping
        for engine in self.engines:
            if self.elastic:
                record = self.allocator.engines.get(engine.name)
                slabs = len(record.slabs) if record is not None else 0
                owned = record.owned_slabs() if record is not None else 0   # not on their way back
            else:
                slabs = owned = engine.pool.num_slabs
            row["held"].append(slabs * engine.model.slab_bytes)
            row["held_slabs"].append(owned)
            row["pool_slabs"].append(engine.pool.num_slabs)
            row["live"].append(engine.live_bytes())
            row["cached"].append(engine.cached_bytes())
            row["empty_slabs"].append(len(engine.pool.idle_slabs()))
            row["quiet_for"].append(self.now - engine.last_busy)
        if self.elastic:
            pool = self.allocator.pools["0"]
            row["free_pages"] = len(pool.free)
            row["created_pages"] = pool.created
        self.samples.append(row)
        self.at(self.now + SAMPLE, self.sample)

    # ------------------------------------------------------------ run
    def run(self, drain: float) -> None:
        """The day, ``drain`` seconds more, then the quiet in which every grow is answered.
        The sim process holds every engine's pool (millions of objects): the
        collector runs between events, never inside a timed allocator call."""
        enabled = gc.isenabled()
        gc.disable()
        try:
            self.start()
            self.run_until(self.trace.day_seconds + drain)
            self.settle()
        finally:
            if enabled:
                gc.enable()

    def start(self) -> None:
        """Schedule the engines, the trace's arrivals and the daemon's loop."""
        trace = self.trace
        for i, engine in enumerate(self.engines):
            if self.elastic:
                self.at(0.001 * (i + 1), engine.start)
            self.at(0.05 + STEP * i / len(self.engines), self._step_loop, engine)
        for r in trace.requests:
            self.at(r.arrival, self.engines[r.engine].arrive, r)
        if self.elastic:
            self.at(DAEMON_TICK, self.daemon_tick)
        self.at(CHECK_EVERY, self.check)
        self.at(0.0, self.sample)

    def settle(self) -> None:
        """After the trace: the engines stop scheduling; every grow must be answered."""
        self.settled_at = self.now
        for engine in self.engines:
            engine.stopped = True
        if self.elastic:
            self.run_until(self.now + p.GROW_TIMEOUT + 2 * GROW_SLACK)
            for engine in self.engines:
                for req, (sent, demand, _n) in engine.grows.items():
                    self.violation(f"engine {engine.name}: {'demand' if demand else 'reserve'} grow {req} "
                                   f"sent at t={sent:.3f} never answered")
            try:
                self.allocator.check()
            except AssertionError as exc:
                self.violation(f"books: {exc}")

    def _step_loop(self, engine: NodeEngine) -> None:
        engine.step()
        self.at(self.now + STEP, self._step_loop, engine)


# ================================================================ the report
def _time_mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def summarize(sim: NodeSim, oracle: list[float], day_samples: int) -> dict[str, Any]:
    """Figures of one run over the day's samples (``oracle``: bytes per second)."""
    budget = sim.budget_bytes
    rows = sim.samples[:day_samples]
    live = [sum(r["live"]) for r in rows]
    held = [sum(r["held"]) for r in rows]
    cached = [sum(r["cached"]) for r in rows]
    n = min(len(rows), len(oracle))
    achieved = sum(live[:n]) / budget / max(1, n)
    best = sum(min(o, budget) for o in oracle[:n]) / budget / max(1, n)
    requests = sum(e.stats["arrived"] for e in sim.engines)
    delays = [d for e in sim.engines for d in e.queue_delays]
    day_end = sim.trace.day_seconds
    out = {
        "requests": requests,
        "served_in_day": bisect.bisect_right(sorted(sim.finished_at), day_end),
        "served": sum(e.finished for e in sim.engines),
        "waited": sum(e.stats["waited"] for e in sim.engines),
        "preemptions": sum(e.stats["preemptions"] for e in sim.engines),
        "queue_delay_s": {"mean": round(_time_mean(delays), 3), "p50": round(_percentile(delays, 0.5), 3),
                          "p99": round(_percentile(delays, 0.99), 3), "max": round(max(delays, default=0.0), 3)},
        "scheduler_stall_s": round(sum(e.stalled for e in sim.engines), 2),
        "utilisation_live": round(achieved, 4),
        "utilisation_held": round(_time_mean(held) / budget, 4),
        "utilisation_cached": round(_time_mean(cached) / budget, 4),
        "oracle_utilisation": round(best, 4),
        "ratio_live_vs_oracle": round(achieved / best, 4) if best else 0.0,
        "prefix_hit_rate": round(sum(e.stats["hit_blocks"] for e in sim.engines)
                                 / max(1, sum(e.stats["prompt_blocks"] for e in sim.engines)), 4),
    }
    return out


def idle_report(sim: NodeSim) -> dict[str, Any]:
    """Each engine with quiet stretches (no request for ``IDLE_SETTLE`` seconds
    or more): what it held then. Its reserve must be gone (no empty slab, the
    daemon books nothing beyond its slabs with cached or live blocks); its
    cache may yield to other engines' demand."""
    settle = sim.allocator.rules.idle_grace + IDLE_SETTLE
    out: dict[str, Any] = {}
    for e, engine in enumerate(sim.engines):
        rows = [r for r in sim.samples if r["quiet_for"][e] >= settle and r["t"] <= sim.trace.day_seconds]
        if not rows:
            continue
        stretches: list[list[dict]] = []
        for r in rows:
            if stretches and r["t"] - stretches[-1][-1]["t"] <= SAMPLE + 1e-9:
                stretches[-1].append(r)
            else:
                stretches.append([r])
        longest = max(stretches, key=len)
        before = [r for r in sim.samples if r["t"] < longest[0]["t"] and r["quiet_for"][e] < SAMPLE]
        out[engine.name] = {
            "quiet_samples": len(rows),
            "held_gib_at_last_request": round(before[-1]["held"][e] / GIB, 3) if before else 0.0,
            "longest_quiet_s": [round(longest[0]["t"], 1), round(longest[-1]["t"], 1)],
            "held_gib_longest_start": round(longest[0]["held"][e] / GIB, 3),
            "held_gib_longest_end": round(longest[-1]["held"][e] / GIB, 3),
            "held_gib_longest_min": round(min(r["held"][e] for r in longest) / GIB, 3),
            "max_empty_slabs": max(r["empty_slabs"][e] for r in rows),
            "max_slabs_beyond_cached_live": max(r["held_slabs"][e] - (r["pool_slabs"][e] - r["empty_slabs"][e])
                                                for r in rows),
        }
    return out


def plot(path: str, sim: NodeSim, oracle: list[float], static: NodeSim) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trace = sim.trace
    rows = [r for r in sim.samples if r["t"] <= sim.settled_at]
    hours = [trace.hour(r["t"]) for r in rows]
    fig, ax = plt.subplots(figsize=(13, 6.5))
    stacks = [[r["held"][i] / GIB for r in rows] for i in range(len(sim.engines))]
    ax.stackplot(hours, *stacks, labels=[f"{e.name} ({e.model.name})" for e in sim.engines], alpha=0.75)
    n = min(len(rows), len(oracle))
    ax.plot(hours[:n], [min(o, sim.budget_bytes) / GIB for o in oracle[:n]], color="black", lw=1.4,
            label="oracle: min(live demand, budget)")
    ax.plot(hours, [sum(r["live"]) / GIB for r in rows], color="white", lw=0.9, ls="--",
            label="elastic: held by live blocks")
    static_rows = [r for r in static.samples if r["t"] <= static.settled_at]
    ax.plot([trace.hour(r["t"]) for r in static_rows], [sum(r["live"]) / GIB for r in static_rows],
            color="red", lw=0.9, ls=":", label="static split: held by live blocks")
    ax.axhline(sim.budget_bytes / GIB, color="grey", lw=0.8)
    for spans in trace.idle_windows().values():
        for start, end in spans:
            ax.axvspan(trace.hour(start), trace.hour(end), color="grey", alpha=0.1)
    ax.set_xlim(hours[0], hours[-1])
    ticks = [h for h in range(int(hours[0]), int(hours[-1]) + 1) if h % 3 == 0]
    ax.set_xticks(ticks, [f"{h % 24:02d}:00" for h in ticks])
    ax.set_xlabel(f"time of day (24 h compressed into {trace.day_seconds:g} simulated seconds, "
                  f"{86400 / trace.day_seconds:g}x; then the drain)")
    ax.set_ylabel("GiB held (daemon's books)")
    ax.set_title(f"kvelastic node simulation: 8 engines, {sim.budget_bytes / GIB:g} GiB in 2 MiB pages "
                 f"(seed {sim.seed}); shaded: office engine idle")
    ax.legend(loc="upper left", fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_node(seed: int = 1, day_seconds: float = 480.0, drain: float = 30.0, plot_path: str | None = None,
             scale: float = 1.0) -> dict[str, Any]:
    """One day on the node, elastic and then static, and the report.
    ``scale`` < 1: a fraction of the node (budget and every engine's load)."""
    logging.disable(logging.CRITICAL)          # the daemon's operator log is noise here
    try:
        trace = traces.generate(seed, day_seconds, load=scale)
        budget = int(BUDGET_PAGES * scale)
        day = int(day_seconds)
        per_engine = traces.demand(trace, day)
        oracle = [sum(row[s] for row in per_engine) for s in range(day)]
        wall = time.perf_counter()
        sim = NodeSim(trace, seed, elastic=True, budget_pages=budget)
        sim.run(drain)
        elastic_wall = time.perf_counter() - wall
        wall = time.perf_counter()
        static = NodeSim(trace, seed, elastic=False, budget_pages=budget)
        static.run(drain)
        static_wall = time.perf_counter() - wall
    finally:
        logging.disable(logging.NOTSET)
    return report(sim, static, oracle, per_engine, elastic_wall, static_wall, plot_path)


def report(sim: NodeSim, static: NodeSim, oracle: list[float], per_engine: list[list[float]],
           elastic_wall: float, static_wall: float, plot_path: str | None) -> dict[str, Any]:
    trace = sim.trace
    day = int(trace.day_seconds)
    alloc = sim.allocator
    elastic = summarize(sim, oracle, day)
    baseline = summarize(static, oracle, day)
    calls = sum(sim.calls.values())
    sustained = calls / sim.alloc_seconds if sim.alloc_seconds else 0.0
    peak = max(sim.per_second[:day])
    status_mean = _time_mean(sim.status_times)
    # The loop's load in each simulated second: the decisions made in it plus
    # a status snapshot every tick (its cost sampled in that second, or the mean).
    loop_load = [sim.busy_per_second[s] + (sim.status_per_second[s] or status_mean) / DAEMON_TICK
                 for s in range(day)]
    busiest = max(loop_load)
    busiest_at = loop_load.index(busiest)
    moves = alloc.moves["0"]
    requests = elastic["requests"]
    status = alloc.status()
    idle = idle_report(sim)
    handoffs = sim.handoffs
    kinds = {k: {"calls": v, "us_per_call": round(1e6 * sim.call_time[k] / v, 1)}
             for k, v in sorted(sim.calls.items())}
    result: dict[str, Any] = {
        "benchmark": "sim", "scale": "node", "seed": sim.seed,
        "node": {"engines": len(sim.engines), "budget_gib": sim.budget_bytes / GIB, "page_mib": PAGE >> 20,
                 "budget_pages": sim.budget_pages, "fraction_of_node": sim.budget_pages / BUDGET_PAGES,
                 "engines_detail": [{"name": e.name, "model": e.model.name, "workers": e.model.workers,
                                     "pages_per_worker": e.model.pages_per_worker,
                                     "slab_mib": e.model.slab_bytes >> 20, "blocks_per_slab": e.bps,
                                     "peak_rate_per_s": round(trace.peak_rates[e.index], 2),
                                     "peak_hour": e.spec.peak_hour} for e in sim.engines]},
        "trace": {"day_hours": 24, "starts_at_hour": trace.start_hour, "simulated_seconds": trace.day_seconds,
                  "compression": round(86400 / trace.day_seconds, 1),
                  "note": "the diurnal curve is compressed; request, protocol and grace timings are real",
                  "requests": len(trace.requests), "bursts": len(trace.bursts),
                  "drain_seconds": round(sim.now - trace.day_seconds, 1)},
        "allocator": {
            "decisions": calls, "seconds_inside": round(sim.alloc_seconds, 3),
            "decisions_per_s_sustained": round(sustained),
            "node_peak_decisions_per_s": peak,
            "headroom": round(sustained / peak, 2) if peak else 0.0,
            "busiest_second_decision_load": round(max(sim.busy_per_second[:day]), 4),
            "status_snapshot_ms": {"mean": round(status_mean * 1e3, 3),
                                   "max": round(max(sim.status_times, default=0.0) * 1e3, 3),
                                   "samples": len(sim.status_times)},
            "status_load_at_tick_rate": round(status_mean / DAEMON_TICK, 4),
            "busiest_second_loop_load": round(busiest, 4), "busiest_second_at_s": busiest_at,
            "headroom_busiest_second": round(1.0 / busiest, 2) if busiest else 0.0,
            "slowest_call_ms": round(sim.slowest[0] * 1e3, 3), "slowest_call_kind": sim.slowest[1],
            "slowest_call_at_s": round(sim.slowest[2], 2),
            "by_kind": kinds,
            "note": ("decisions: every Allocator input (messages, ticks, peers, pages created), timed on this "
                     "machine's one core; loop load: decisions plus the loop's status() snapshot each "
                     f"{DAEMON_TICK:g} s tick (sampled 1 in {STATUS_EVERY}); check() is not counted"),
        },
        "elastic": elastic,
        "static": baseline,
        "ratio_served_in_day_elastic_vs_static": round(elastic["served_in_day"] / max(1, baseline["served_in_day"]), 4),
        "ratio_waited_elastic_vs_static": round(elastic["waited"] / max(1, baseline["waited"]), 4),
        "ratio_preemptions_elastic_vs_static": round(elastic["preemptions"] / max(1, baseline["preemptions"]), 4),
        "ratio_utilisation_live_elastic_vs_static": round(elastic["utilisation_live"]
                                                          / max(1e-9, baseline["utilisation_live"]), 4),
        "ratio_queue_delay_p99_elastic_vs_static": round(elastic["queue_delay_s"]["p99"]
                                                         / max(1e-9, baseline["queue_delay_s"]["p99"]), 4),
        "demand": {
            "grows": sum(e.stats["demand_grows"] for e in sim.engines),
            "outcomes": dict(sorted(sim.grow_outcomes.items())),
            "client_timeouts": sum(e.stats["demand_timeouts"] for e in sim.engines),
            "latency_s": {"p50": round(_percentile(sim.demand_latency, 0.5), 5),
                          "p99": round(_percentile(sim.demand_latency, 0.99), 5),
                          "max": round(max(sim.demand_latency, default=0.0), 5)},
            "needed_reclaim": len(handoffs) + sim.handoffs_empty,
            "handoff_latency_s": {"count": len(handoffs), "p50": round(_percentile(handoffs, 0.5), 5),
                                  "p99": round(_percentile(handoffs, 0.99), 5),
                                  "max": round(max(handoffs, default=0.0), 5)},
            "handoffs_answered_empty": sim.handoffs_empty,
            "unanswered": sum(len(e.grows) for e in sim.engines),
        },
        "reserve_grows": sum(e.stats["reserve_grows"] for e in sim.engines),
        "returned_slabs": sum(e.stats["returned_slabs"] for e in sim.engines),
        "reclaimed_slabs": sum(e.stats["reclaimed_slabs"] for e in sim.engines),
        "reclaim_refused_slabs": sum(e.stats["refused_slabs"] for e in sim.engines),
        "slab_moves": moves, "thrash": alloc.thrash["0"],
        "thrash_examples": [{"t": t, "from": a, "to": b, "slabs": n} for t, a, b, n in sim.thrash_events[:8]],
        "demand_slabs_granted": sim.demand_slabs_granted,
        "status_slab_moves": status.devices[0].slab_moves, "status_thrash": status.devices[0].thrash,
        "moves_per_1000_requests": round(1000 * moves / max(1, requests), 2),
        "pages_created": sim.created_pages, "pages_released": sim.released_pages,
        "peak_pages_created_per_s": max(sim.created_per_second[:day]),
        # Page creation runs in the daemon's loop (cuMemCreate, ~193 us per 2 MiB page on an A100,
        # DESIGN.md anchors): its load at the busiest second, not included in the decisions above.
        "est_create_load_busiest_second_at_193us": round(max(sim.created_per_second[:day]) * 193e-6, 3),
        "rejected": dict(sim.rejected),
        "idle_engine": idle,
        "invariant_violations": len(sim.violations) + len(static.violations),
        "violation_examples": (sim.violations + static.violations)[:5],
        "sim_wall_seconds": {"elastic": round(elastic_wall, 1), "static": round(static_wall, 1)},
    }
    if plot_path:
        plot(plot_path, sim, oracle, static)
        result["plot"] = os.path.abspath(plot_path)
    return result
