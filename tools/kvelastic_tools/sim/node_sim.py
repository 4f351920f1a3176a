"""The node simulation's event loop (``NodeSim``): engines, workers, the
transport and the daemon's loop on a fake clock, and the figures each run
keeps. ``node.py`` says what the simulation does and runs it; ``node_report.py``
turns finished runs into the report.

It lies between the two: the engines (``node_engine.py``) see it only
through ``node_engine.NodeLoop``, and the report reads it, so neither is
imported back (no import circle in the sim).
"""

from __future__ import annotations

import collections
import gc
import heapq
import math
import random
import time
from typing import Any

from kvelastic import protocol as p
from kvelastic.daemon import effects as fx
from kvelastic.daemon.allocator import Allocator
from kvelastic.daemon.requests import Timing
from kvelastic.daemon.state import Phase
from kvelastic.errors import InvariantViolation
from kvelastic_tools.sim.node_engine import STEP, NodeEngine
from kvelastic_tools.sim.traces import PAGE, Trace

BUDGET_PAGES = 40_960                 # 80 GiB of 2 MiB pages
DAEMON_TICK = 0.1                     # kvelastic.daemon.server.TICK_INTERVAL
STATUS_EVERY = 10                     # the loop's status snapshot: timed on one tick in this many
SAMPLE = 1.0                          # metrics every simulated second
CHECK_EVERY = 5.0                     # Allocator.check() and the node's own checks
GROW_SLACK = 0.7                      # transport both ways plus a daemon tick


# The allocator's cost is this thread's CPU time: what one core spends on it,
# whatever else the machine runs meanwhile (wall time on a shared machine is not).
_cpu = time.thread_time


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
        self._allocator = Allocator({"0": budget_pages}, PAGE, timing=timing, events=False,
                                    token_source=lambda: self.rng.randbytes(16)) if elastic else None
        share = budget_pages // len(trace.specs)
        self.engines = [NodeEngine(self, i, spec, 0 if elastic else share // (spec.model.pages_per_worker
                                                                             * spec.model.workers))
                        for i, spec in enumerate(trace.specs)]
        seconds = int(math.ceil(trace.day_seconds)) + 1
        # The allocator's inputs and the wall-clock time spent inside it.
        self.calls: collections.Counter = collections.Counter()
        self.call_time: collections.defaultdict[str, float] = collections.defaultdict(float)
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

    @property
    def allocator(self) -> Allocator:
        """The daemon's allocator: an elastic run's; the static split has none."""
        if self._allocator is None:
            raise RuntimeError("a static-split simulation has no allocator")
        return self._allocator

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
            elif isinstance(e, fx.SendPages):     # descriptors reach the workers: the map command follows
                if e.then is not None:
                    self.perform([e.then])
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

    def grow_answered(self, engine: NodeEngine, msg: p.Granted | p.Error, sent: float, demand: bool,
                      asked: int) -> None:
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
            except InvariantViolation as exc:
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
            except InvariantViolation as exc:
                self.violation(f"books: {exc}")

    def _step_loop(self, engine: NodeEngine) -> None:
        engine.step()
        self.at(self.now + STEP, self._step_loop, engine)
