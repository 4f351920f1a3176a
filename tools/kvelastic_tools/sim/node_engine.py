"""One simulated engine of the node simulation (``node.py``): a real
``SlabPool`` and ``ReservePolicy`` behind the vLLM plugin's scheduling, demand
and reserve behaviour, with its workers. See ``node.py`` for the whole.

The event loop (``node_sim.NodeSim``) makes and drives the engines; they see
it through ``NodeLoop``, a ``Protocol`` it fits, so this module does not import it.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import math
import random
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from kvelastic import protocol as p
from kvelastic.client.answers import give_up
from kvelastic.client.reserve import ReservePolicy
from kvelastic.core.pool import SlabPool
from kvelastic.errors import PoolError
from kvelastic_tools.sim import traces
from kvelastic_tools.sim.traces import BLOCK_TOKENS, PAGE, Request

if TYPE_CHECKING:
    from kvelastic.daemon.allocator import Allocator

STEP = 0.05                           # a scheduling step (and the client's I/O tick)
JOURNAL_INTERVAL = 0.05               # kvelastic.client.shipping.JOURNAL_INTERVAL
DEMAND_TIMEOUT = 2.0                  # kvelastic_vllm.block_pool.DEMAND_TIMEOUT: a running request's
DEMAND_WAIT = 0.05                    # ...DEMAND_WAIT: an admission's, then a late grant
REFUSAL_BACKOFF = 0.2                 # kvelastic_vllm.block_pool.REFUSAL_BACKOFF
RESERVE_REFUSED_PAUSE = 0.5           # EngineClient: no reserve refill for this long after a refusal
MAX_BATCHED_TOKENS = 2048             # vLLM's max_num_batched_tokens: sets the reserve watermark
PREFILL_TOKENS_PER_STEP = 8192        # prompts admitted per step, in tokens
MAX_RUNNING = 256                     # vLLM's max_num_seqs
MAP_SECONDS_PER_PAGE = 40e-6          # cuMemMap + cuMemSetAccess of one 2 MiB page
IDLE_SETTLE = 2.0                     # after idle_grace: the client's tick returns, the workers unmap


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


class NodeLoop(Protocol):
    """What an engine uses of the event loop: the fake clock and its events,
    the transport to the daemon, the allocator (its peer calls are the loop's
    timed decisions), and where it reports answers, finishes and violations."""

    @property
    def now(self) -> float: ...

    @property
    def rng(self) -> random.Random: ...

    @property
    def allocator(self) -> Allocator: ...

    @property
    def identities(self) -> dict[bytes, tuple[NodeEngine, int]]: ...

    @property
    def finished_at(self) -> list[float]: ...

    def at(self, t: float, fn: Callable[..., object], *args: Any) -> None: ...

    def call(self, kind: str, fn: Callable[..., Any], *args: Any) -> Any: ...

    def to_daemon(self, identity: bytes, msg: p.Msg) -> None: ...

    def grow_answered(self, engine: NodeEngine, msg: p.Granted | p.Error, sent: float, demand: bool,
                      asked: int) -> None: ...

    def violation(self, what: str) -> None: ...


class NodeEngine:
    """One serving engine: scheduler, block pool, client I/O thread and workers."""

    def __init__(self, sim: NodeLoop, index: int, spec: traces.EngineSpec, static_slabs: int = 0) -> None:
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
        self.stats: collections.Counter[str] = collections.Counter()
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
        # As the real client does: its own secret, shown in its lifeline and its registration.
        self.token = sim.rng.randbytes(16)
        sim.call("peer_opened", sim.allocator.peer_opened, self.name, -1, sim.now, self.token)
        self.send(p.RegisterEngine(version=p.PROTOCOL_VERSION, engine_id=self.name, pid=1000 + self.index,
                                   namespace=f"{self.model.name}-{self.name}", page_size=PAGE,
                                   pages_per_worker=self.model.pages_per_worker, num_workers=self.model.workers,
                                   blocks_per_slab=self.bps, block_bytes=self.model.block_bytes,
                                   block_tokens=BLOCK_TOKENS, token=self.token))

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
        elif isinstance(msg, p.Drain):
            self.stats["drained_slabs"] += len(self.reserve.drain(self.pool, msg.slabs, sim.now, msg.seconds))
        elif isinstance(msg, p.Reclaim):
            answer = give_up(self.pool, self.name, msg)
            answer.cached = {}
            self.stats["reclaimed_slabs"] += len(answer.given)
            self.stats["refused_slabs"] += len(answer.refused)
            self.flush_journal()
            sim.to_daemon(self.identity, answer)

    def on_worker_message(self, rank: int, msg: p.Msg) -> None:
        sim = self.sim
        wid = self.worker_ids[rank]
        if isinstance(msg, p.MapSlab):
            self.mapped[rank].add(msg.slab)
            ack = p.Mapped(req_id=msg.req_id, engine_id=self.name, rank=rank, slab=msg.slab)
            sim.at(sim.now + len(msg.pages) * MAP_SECONDS_PER_PAGE, sim.to_daemon, wid, ack)
        elif isinstance(msg, p.UnmapSlab):
            # At the end of the worker's current step (a safe point), or now if settled.
            sim.at(sim.now + (0.0 if msg.at_once else sim.rng.uniform(0.0, STEP)), self._unmap, rank, msg)

    def _unmap(self, rank: int, msg: p.UnmapSlab) -> None:
        occ = self.pool.occupancy(msg.slab)
        if occ is not None and occ[0]:
            self.sim.violation(f"engine {self.name}: slab {msg.slab} unmapped under {occ[0]} live block(s)")
        self.mapped[rank].discard(msg.slab)
        self.sim.to_daemon(self.worker_ids[rank], p.Unmapped(req_id=msg.req_id, engine_id=self.name, rank=rank,
                                                             slab=msg.slab))

    def flush_journal(self) -> None:
        """JournalShipper.flush: the ops, occupancy and the pool's counters."""
        batch = self.pool.take_journal()
        if not batch:
            return
        self.last_flush = self.sim.now
        if self.static:
            return
        counters = self.pool.stats.counters()
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
    def ensure(self, need: int, admission: bool) -> bool | None:
        """EngineClient.ensure(need, keep_cache=True, wait=...): True/False
        now, or None: the scheduler blocks until the daemon answers, or for
        an admission DEMAND_WAIT passes (then the grant comes late, and no
        second demand goes before it is answered); a running request's
        waits up to DEMAND_TIMEOUT (rather than be preempted)."""
        pool = self.pool
        self.reserve.touch(self.sim.now)         # a demand is activity
        if need - pool.num_free <= 0:
            return True
        deadline = self.sim.now + (DEMAND_WAIT if admission else DEMAND_TIMEOUT)
        if self.reserve_req:                     # a reserve grow on its way: wait for it first
            self._block(need, deadline, req=None)
            return None
        late = next((req for req, (_sent, demand, _n) in self.grows.items() if demand), None)
        if late is not None:                     # an earlier demand's answer is still to come
            self._block(need, deadline, req=late)
            return None
        want = min(math.ceil((need - pool.num_free) / self.bps), self.max_slabs - pool.num_slabs)
        if want <= 0:
            return False
        self.flush_journal()                     # the daemon judges the demand by its mirror
        self._block(need, deadline, req=self.grow(want, demand=True))
        return None

    def _block(self, need: int, deadline: float, req: int | None) -> None:
        self.blocked = {"need": need, "req": req, "since": self.sim.now, "deadline": deadline,
                        "admission": deadline - self.sim.now <= DEMAND_WAIT}
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
            # An admission goes on (its grant comes late); a running request's timed out.
            self.stats["admission_waits_ended" if self.blocked["admission"] else "demand_timeouts"] += 1
            self._unblock()

    def _unblock(self) -> None:
        b, self.blocked = self.blocked, None
        if b is None:                                # not blocked: nothing to resume
            return
        self.stalled += self.sim.now - b["since"]
        if b["need"] - self.pool.num_free > 0:
            self.refused_at = self.sim.now           # ensure() returned False: back off
        self.schedule()                              # the step goes on where it stopped

    def capacity(self, need: int, admission: bool) -> int | None:
        """ElasticBlockPool.get_num_free_blocks after expect(need) (for a
        waiting request's ``admission``, else a running one's); None: blocked."""
        pool = self.pool
        if need > pool.num_free and not self.static and pool.num_slabs < self.max_slabs \
                and self.sim.now - self.refused_at > REFUSAL_BACKOFF:
            if self.ensure(need, admission) is None:
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
            cap = self.capacity(1, admission=False)
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
        cap = self.capacity(need, admission=True)
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
        req.decode_start = self.vnow() + traces.prefill_seconds(req.tokens - len(hits) * BLOCK_TOKENS)
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
