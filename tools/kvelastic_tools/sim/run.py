"""One seeded run of the simulated node, with faults, checking the invariants after every step.

    python -m kvelastic_tools.sim SEED [STEPS]     # replays one seed and prints what it found
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import logging
import random
import sys

import msgspec

from kvelastic import protocol as p
from kvelastic.daemon.requests import Timing
from kvelastic.daemon.state import Phase
from kvelastic.errors import InvariantViolation
from kvelastic_tools.sim import checks, ghosts, hostile, keeper
from kvelastic_tools.sim.guard import SimAbort
from kvelastic_tools.sim.tier import short_leases, small_staging
from kvelastic_tools.sim.world import SimEngine, World

HEARTBEAT = p.HEARTBEAT_INTERVAL
TICK = 0.1
# The slack on "every grow is answered within its deadline": the request's and
# the answer's transport delays plus one tick.
GROW_SLACK = 0.3 + 0.3 + TICK


@dataclasses.dataclass
class SimResult:
    seed: int
    steps: int
    faults: collections.Counter
    violations: list[str]
    handed_blocks: int = 0       # cached blocks handed on with slabs by a live replica of the namespace
    orphan_blocks: int = 0       # cached blocks adopted from departed engines' kept cache (warm starts)
    kept_blocks: int = 0         # cached blocks of departed engines kept for their namespace
    restored_blocks: int = 0     # of those adopted, blocks of kept slabs a new daemon took back (keeper.py)
    # The daemon's books at the end (its status report and free pages, hashed):
    # the same seed gives the same books, whatever is refactored (``digest.py``).
    books: str = ""

    @property
    def replay(self) -> str:
        return f"python -m kvelastic_tools.sim {self.seed} {self.steps}"


# Departed engines' cache is kept this long (the default is minutes): within a
# run, kept slabs are adopted, lost with the daemon, yielded to demand, expire.
ORPHAN_TTL = 5.0
SIM_TIMING = Timing(orphan_ttl=ORPHAN_TTL)
NAMESPACE_CHANGE = 0.3     # an engine that left comes back serving the other namespace
# The fault table (a draw r per step): normal work below LONG_STEP; a running
# step outlives the ack deadline below HOSTILE, a hostile client acts below
# 0.80; from 0.80 up an engine departs below DEPART, the daemon restarts below
# RESTART, then the rest (see run_seed).
LONG_STEP, HOSTILE = 0.78, 0.79
PAGES_EVERY = 4
DEPART, RESTART = 0.835, 0.84
# Of daemon restarts: killed part-way through its next inputs' effects below
# KILL_LATER, killed between inputs below KILL_NOW, a graceful stop above.
KILL_LATER, KILL_NOW = 0.3, 0.6


def run_seed(seed: int, steps: int = 300, faults: bool = True, timing: Timing = SIM_TIMING,
             evictions: bool = True) -> SimResult:
    """``evictions``: False for engines that ignore ``Registered.tier`` and
    ``ClearIndex`` (as before demotion source B: the seeds found then replay)."""
    w = World(seed, timing=timing, evictions=evictions)
    injected: collections.Counter = collections.Counter()
    try:
        with short_leases(), small_staging():
            run_steps(w, steps, faults, injected)
            if not w.violations:
                settle(w)
    except SimAbort:
        pass                                   # a call was interrupted half-way (its violation is recorded)
    finally:
        w.guard.close()
    keeper.harvest(w)
    injected.update(w.counts)
    return SimResult(seed, steps, injected, w.violations, w.handed_blocks, w.orphan_blocks, w.kept_blocks,
                     w.restored_blocks, books_digest(w))


def books_digest(w: World) -> str:
    allocator = w.allocator
    free = sorted((device, sorted(pool.free)) for device, pool in allocator.pools.items())
    return hashlib.sha256(msgspec.msgpack.encode([allocator.status(), free])).hexdigest()[:16]


def tick(w: World) -> None:
    if w.stopped:                              # a daemon killed part-way through this step
        return
    w.perform(w.call(w.allocator.tick, w.now))
    if w.tier is not None:
        w.tier.last_tick = w.now
    checks.acks(w)


def tend(w: World) -> None:
    """Each step: ghosts and hostile engines do what is due; steps holding unmaps say Busy."""
    if w.ghosts:
        ghosts.tend(w)
    if w.hostiles:
        hostile.tend(w)
    for engine in w.engines:
        if engine.step is not None and engine.alive:
            engine.keep_busy(w.now)


def run_steps(w: World, steps: int, faults: bool, injected: collections.Counter) -> None:
    rng = w.rng
    for engine in w.engines:
        engine.start()
    last_beat = last_tick = 0.0
    down = w.restart_at                        # engine gone (crashed, or exited) -> when it comes back
    doomed: dict[str, float] = {}              # engine whose worker died -> its own crash
    for i in range(steps):
        if i % 16 == 0:
            w.guard.mark()
        w.now += rng.expovariate(1 / 0.02)
        w.deliver()
        if w.tier is not None:                 # the tier's writer writes, the loop takes what it wrote
            w.tier.pump()
        tend(w)
        if w.now - last_beat >= HEARTBEAT:
            last_beat = w.now
            for engine in w.engines:
                if engine.alive:
                    w.client_send(engine.identity, p.Heartbeat(engine_id=engine.name))
        if w.now - last_tick >= TICK:
            last_tick = w.now
            tick(w)
        for name, at in list(down.items()):
            if w.now >= at:                    # the same name comes back: a warm start, or another model
                del down[name]
                engine = next(e for e in w.engines if e.name == name)
                if rng.random() < NAMESPACE_CHANGE:
                    engine.checkpoint = "ns1" if engine.checkpoint == "ns0" else "ns0"
                    injected["namespace_change"] += 1
                engine.start()
        for name, at in list(doomed.items()):    # a dead worker's engine follows it
            if w.now >= at:
                del doomed[name]
                engine = next(e for e in w.engines if e.name == name)
                engine.crash()
                down[name] = w.now + rng.uniform(0.1, 2.0)
        if w.tier is not None and faults:      # lookups, kills mid-lease, invalidations: on the tier's own draws
            w.tier.step()
        engine = rng.choice(w.engines)
        r = rng.random()
        if not faults or r < LONG_STEP:
            if engine.alive:
                engine.advance_step(rng)
                engine.expire_leave(w.now)
                engine.work(rng, w.now)
        elif r < HOSTILE:                      # a model step outlives the ack deadline (unmaps wait for it)
            running = [e for e in w.engines if e.alive and not e.dying and e.step is not None and e.step.running
                       and not e.step.until]
            if running:
                step = rng.choice(running).step
                assert step is not None
                step.until = w.now + rng.uniform(1.1, 2.0) * p.ACK_TIMEOUT
                injected["long_step"] += 1
        elif r < 0.80:
            hostile.act(w, rng)
        elif r < DEPART:                       # (each fault's share is its own: none falls through)
            if engine.alive and not engine.dying and not engine.leaving:
                depart(w, engine, rng, injected, doomed)
        elif r < RESTART:                      # SIGTERM, kill -9 now, or kill -9 part-way through what comes
            x = rng.random()
            if x < KILL_LATER:
                injected["daemon_crash_armed"] += 1
                w.crash_armed = True
            else:
                injected["daemon_crash" if x < KILL_NOW else "daemon_restart"] += 1
                corrupt = engine if engine.alive and rng.random() < 0.3 else None
                injected["bad_adoption"] += corrupt is not None
                w.restart_daemon(corrupt, kill=x < KILL_NOW)
        elif r < 0.88:
            if engine.alive and engine.workers:
                injected["stuck_worker"] += 1
                rng.choice(engine.workers).stuck_until = w.now + rng.choice([0.2, 1.0, 8.0, 30.0])
        elif r < 0.90:
            injected["creation_failure"] += 1
            w.device.fail_creation = not w.device.fail_creation
        elif r < 0.91:
            if engine.alive:
                injected["bad_journal"] += 1
                engine.send_bad_journal(rng)
        elif r < 0.95:
            injected["late_grant"] += 1        # the client gives up on its grows at once
            for req in list(engine.pending):
                engine.pending[req] = (w.now - 10.0, engine.pending[req][1])
            engine.expire_grows(w.now)
        else:
            injected["slow_network"] += 1      # a burst of long delays
            w.now += rng.uniform(0.05, 0.3)
        check(w)
        if w.violations:
            break


def depart(w: World, engine: SimEngine, rng: random.Random, injected: collections.Counter,
           doomed: dict[str, float]) -> None:
    """An engine leaves, at any point of a step: one of its workers is killed
    (the engine follows it), it is killed, it is killed while its workers
    hang on (ghosts: they exit later, while it registers again under the
    same id), or it exits gracefully (the step in flight ends first). It
    comes back later under the same name."""
    x = rng.random()
    step = engine.step
    sealing = step is not None and not step.running     # a graceful exit waits for a seal: a kill instead
    if step is not None and (x < 0.8 or sealing):
        injected["crash_sealing" if sealing else "crash_mid_step"] += 1
    if engine.workers and x < 0.3:
        injected["worker_crash"] += 1
        engine.kill_worker(rng.choice(engine.workers))
        doomed[engine.name] = w.now + rng.uniform(0.05, 0.5)
    elif 0.65 <= x < 0.8 and any(wk.identity in w.wires for wk in engine.workers):
        injected["hung_workers"] += 1
        frozen = rng.random() < 0.5
        step_for = rng.uniform(0.2, 2.0) * p.ACK_TIMEOUT
        exit_after = (rng.uniform(0.5, 3.0) * p.ACK_TIMEOUT if frozen
                      else step_for + rng.uniform(0.1, 1.0) * p.ACK_TIMEOUT)
        engine.abandon_workers(frozen, step_for, exit_after)
        w.restart_at[engine.name] = w.now + rng.uniform(0.1, 2.0)
    elif x < 0.8 or sealing:
        injected["engine_crash"] += 1
        engine.crash()
        w.restart_at[engine.name] = w.now + rng.uniform(0.1, 2.0)
    else:
        injected["unregister"] += 1
        engine.finish_step()
        engine.leave()


def check(w: World) -> None:
    """The invariants, after every step (the books' own when an input or a
    mapping may have changed them; the simulator's own view of every page,
    ``checks.pages``, at most every PAGES_EVERY steps: what it finds lasts)."""
    w.checked += 1
    if w.crashed:                              # killed part-way through an input: its successor starts
        w.restart_daemon(kill=True)
    if w.dirty:
        w.dirty, w.pages_due = False, True
        try:
            w.allocator.check()
        except InvariantViolation as exc:
            w.violation(f"books: {exc}")
        keeper.check_lent(w, w.allocator)   # slabs held with pages are what their workers map
    if w.pages_due and w.checked % PAGES_EVERY == 0:
        w.pages_due = False
        checks.pages(w)    # every page in one place; what a worker maps is its registration's (live blocks' too)
    if w.tier is not None:
        w.tier.check()                         # the tier's invariants (``tier.py``)
    alloc = w.allocator
    for engine in w.engines:
        if not engine.alive or engine.dying:
            continue
        occupancies = engine.pool.occupancies()
        for slab_id, (live, _cached, _free) in occupancies.items():
            for worker in engine.workers:
                if live and slab_id not in worker.mapped:
                    w.violation(f"engine {engine.name}: slab {slab_id} has live blocks but worker "
                                f"{worker.rank} does not map it")
        quiet = [w.wires.get(engine.identity)] + [w.wires.get(wk.identity) for wk in engine.workers]
        record = alloc.engines.get(engine.name)
        if record is None or record.failed or any(x is None or x.to_daemon or x.to_client for x in quiet) \
                or engine.pool.journal.ops or engine.pool.journal.dirty:
            continue
        pending = {sid for req in alloc.grows.values() if req.engine_id == engine.name for sid in req.slabs}
        held = {sid for sid, slab in record.slabs.items() if slab.phase is Phase.HELD} - pending
        if held != set(engine.pool.slab_ids()):
            w.violation(f"engine {engine.name}: the daemon books slabs {sorted(held)}, its pool holds "
                        f"{sorted(engine.pool.slab_ids())}")
        elif {k: v for k, v in record.mirror.slabs.items() if k not in pending} != occupancies:
            w.violation(f"engine {engine.name}: mirror {record.mirror.slabs} != pool {occupancies}")
        elif record.mirror.index_pairs() != set(engine.pool.cached_keys()):
            w.violation(f"engine {engine.name}: the daemon's mirror of its prefix index differs from the pool's")
    timeout = p.GROW_TIMEOUT + GROW_SLACK       # the contract, whatever the allocator was configured with
    for (identity, req), sent in w.grow_sent.items():
        if identity in w.wires and w.now - sent > timeout:
            w.violation(f"grow {req} of {identity!r} unanswered after {w.now - sent:.2f} s")
            break


def settle(w: World) -> None:
    """End of the run: first some quiet seconds (longer than any deadline: what
    waits must be answered, with the invariants checked all along), then every
    engine exits; then nothing may be held or leak."""
    w.crash_armed = False
    for i in range(int((p.GROW_TIMEOUT + GROW_SLACK) / 0.05) + 20):
        w.now += 0.05
        if i % 16 == 0:
            w.guard.mark()
        tend(w)
        for engine in w.engines:
            if engine.alive:                   # steps in flight end; journals and heartbeats go on
                engine.advance_step(w.rng)
                engine.expire_leave(w.now)
                if engine.registered and not engine.dying and not engine.leaving:
                    engine.flush_journal()
                if i % 10 == 0:
                    w.client_send(engine.identity, p.Heartbeat(engine_id=engine.name))
        w.deliver()
        if w.tier is not None:
            w.tier.pump()
        tick(w)
        check(w)
        if w.violations:
            return
    hostile.tend(w, every=True)
    for engine in w.engines:
        if engine.alive:
            engine.crash()
    for ghost in list(w.ghosts.values()):       # the last hung workers exit too
        ghosts.leave(w, ghost)
    for i in range(200):
        w.now += 0.05
        if i % 16 == 0:
            w.guard.mark()
        for engine in w.engines:
            for worker in engine.workers:
                worker.stuck_until = 0.0
        w.deliver()
        if w.tier is not None:
            w.tier.pump()
        w.perform(w.call(w.allocator.tick, w.now))
    checks.pages(w)
    if w.tier is not None:
        w.tier.check()
        w.tier.settled()
    status = w.allocator.status()
    departing = w.allocator.departing.values()
    if status.memory.held or departing or w.allocator.engines:
        w.violation(f"after every engine left: held {status.memory.held} bytes, engines "
                    f"{sorted(w.allocator.engines)}, departing {sorted(r.engine_id for r in departing)}")
    kept = set(w.allocator.orphans.pages_on("0"))    # departed engines' cache, for their namespace
    leaked = w.device.pages - set(w.allocator.pools["0"].free) - kept
    if leaked:
        w.violation(f"pages alive that the daemon does not know: {sorted(leaked)[:5]}")
    for departed in w.allocator.departing.values():
        if any(s.phase is not Phase.UNMAPPING for s in departed.slabs.values()):
            w.violation(f"departed engine {departed.engine_id} holds slabs not on their way out")


def main(argv: list[str]) -> int:
    logging.disable(logging.CRITICAL)    # the daemon's operator log is noise here
    seed = int(argv[0])
    steps = int(argv[1]) if len(argv) > 1 else 300
    result = run_seed(seed, steps)
    print(f"seed {seed}: {result.steps} steps, faults {dict(result.faults)}; cached blocks adopted: "
          f"{result.handed_blocks} handed on by replicas, {result.orphan_blocks} from departed engines' "
          f"kept cache ({result.kept_blocks} kept; {result.restored_blocks} of them through a daemon restart)")
    for v in result.violations:
        print("  VIOLATION", v)
    return 1 if result.violations else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
