"""Deterministic simulation of a node (kvelastic_tools.sim): the real allocator and
real engine pools under faults, every invariant checked after every step.
Engines number their model steps and seal them as the client does; they die
at any point of a step and come back under the same name (a warm start that
adopts what the daemon kept), or in the other namespace. Every adoption (a
replica's hand-off, or kept cache) is checked against the simulated device.

The second test re-injects the daemon faults the simulator exists to catch
and shows each is found within the seeds CI runs. (Faults of the I/O loop
itself — a slow greeting, a crash on a hung worker's socket, a flood that
stalls a pass — are outside the allocator: tests/daemon/test_reliability.py
covers them with real processes.)
"""


import pytest

from kvelastic import protocol as p
from kvelastic.core.journal import JournalBatch, Mirror
from kvelastic.daemon.allocator import Allocator
from kvelastic.daemon.growth import Growth
from kvelastic.daemon.handoff import CacheHandoff
from kvelastic.daemon.invalidation import CacheScope
from kvelastic.daemon.orphans import OrphanCache
from kvelastic.daemon.registration import Registration
from kvelastic.daemon.requests import Timing
from kvelastic.daemon.state import Phase
from kvelastic.daemon.unmapping import Unmapping
from kvelastic_tools.sim import engine as engine_mod
from kvelastic_tools.sim.run import SIM_TIMING, run_seed

CI_SEEDS = 300
STEPS = 300


def test_every_invariant_holds_on_the_ci_seeds():
    failures = []
    faults = handed = orphaned = diverged = 0
    for seed in range(CI_SEEDS):
        result = run_seed(seed, STEPS)
        faults += sum(result.faults.values())
        diverged += result.faults.get("diverged", 0)
        handed += result.handed_blocks
        orphaned += result.orphan_blocks
        if result.violations:
            failures.append(f"{result.violations[0]}  (replay: {result.replay})")
    assert not failures, f"{len(failures)} seed(s) failed:\n" + "\n".join(failures[:5])
    assert faults > CI_SEEDS * 10        # the runs really were hostile
    assert handed > 0                    # cached slabs were handed on within a namespace
    assert orphaned > CI_SEEDS // 10     # and departed engines' cache was adopted (warm starts)
    assert diverged > CI_SEEDS // 10     # engines' weights changed in memory (RL updates)


# --------------------------------------------------------- re-injected faults
def unmap_on_shutdown(monkeypatch):
    """Fault 1: stopping the daemon unmaps every engine's slabs."""
    def shutdown(self):
        for engine in list(self.engines.values()):
            self._drop(engine, "daemon stopping")
        return self.books.take()
    monkeypatch.setattr(Allocator, "shutdown", shutdown)


def forget_dead_workers(monkeypatch):
    """Fault 4: slabs already unmapping when their engine dies wait for dead workers forever."""
    monkeypatch.setattr(Unmapping, "settle_departed", lambda self, engine: None)


def no_deadlines(monkeypatch):
    """Fault 5: no deadline on acknowledgements or grows, and every grow that
    lacks memory waits while any slab anywhere is still unmapping."""
    original = Growth._advance

    def advance(self, req):
        books = self.books
        short = req.wanted - len(req.slabs) - len(req.mapping)
        unmapping = any(s.phase is Phase.UNMAPPING
                        for e in (*books.engines.values(), *books.departing.values()) for s in e.slabs.values())
        if short > 0 and unmapping and req.engine_id in books.engines:
            return False
        return original(self, req)
    monkeypatch.setattr(Growth, "_advance", advance)
    return Timing(ack_timeout=1e9, grow_timeout=1e9, orphan_ttl=SIM_TIMING.orphan_ttl)


def trust_adoption(monkeypatch):
    """Fault 6: a re-registration's held slabs are adopted unchecked."""
    monkeypatch.setattr(Registration, "_check_adoption", lambda self, m, pool, slab_pages, max_slabs: list(m.held))


def drop_late_grants(monkeypatch):
    """Fault 7: a grant whose request the client gave up on is dropped."""
    original = engine_mod.SimEngine.on_message

    def on_message(self, msg):
        if isinstance(msg, engine_mod.p.Granted) and msg.req_id not in self.pending:
            return
        original(self, msg)
    monkeypatch.setattr(engine_mod.SimEngine, "on_message", on_message)


def half_apply_journals(monkeypatch):
    """Fault 9: a journal's ops are applied one by one until a bad one is found."""
    original = Allocator._on_journal

    def on_journal(self, identity, m):
        engine = self.books.engines.get(m.engine_id)
        if engine is not None:
            for op in m.ops:
                if getattr(op, "block", 0) // engine.blocks_per_slab not in engine.slabs:
                    break
                engine.mirror.apply(JournalBatch([op.core()], {}))
        return original(self, identity, m)
    monkeypatch.setattr(Allocator, "_on_journal", on_journal)


def hand_on_across_namespaces(monkeypatch):
    """Fault 10: a cached slab is handed on with its KV whatever the taker's namespace."""
    monkeypatch.setattr(CacheHandoff, "may_hand_on", staticmethod(lambda giver, taker, cached: True))


def every_key_valid(monkeypatch):
    """Fault 11: the mirror counts every stored key as written, also one of a
    step still running (or never finished: its engine died in it)."""
    def valid_in(self, slab_id, blocks_per_slab):
        first = slab_id * blocks_per_slab
        return [(block - first, self.key_of[block]) for block in range(first, first + blocks_per_slab)
                if block in self.key_of]
    monkeypatch.setattr(Mirror, "valid_in", valid_in)


def no_seal(monkeypatch):
    """Fault 12: engines run steps without having the daemon acknowledge the
    keys they dropped (no sync journal before a step that rewrites them)."""
    monkeypatch.setattr(engine_mod.SimEngine, "needs_seal", lambda self: False)


def orphans_across_namespaces(monkeypatch):
    """Fault 13: a departed engine's kept cache goes to any engine of its slab shape."""
    def take(self, namespace, shape, n):
        taken = [o for o in self.slabs if o.shape == shape][:max(0, n)]
        self._drop(taken)
        return taken
    monkeypatch.setattr(OrphanCache, "count", lambda self, namespace, shape: sum(o.shape == shape for o in self))
    monkeypatch.setattr(OrphanCache, "take", take)


def ignore_diverge(monkeypatch):
    """Fault 17: an engine whose weights changed in memory stays in its
    checkpoint's namespace: its new KV is handed on and kept as the checkpoint's."""
    monkeypatch.setattr(CacheScope, "on_diverge", lambda self, identity, m: p.Ok())


REINJECTED = {1: unmap_on_shutdown, 4: forget_dead_workers, 5: no_deadlines, 6: trust_adoption,
              7: drop_late_grants, 9: half_apply_journals, 10: hand_on_across_namespaces,
              11: every_key_valid, 12: no_seal, 13: orphans_across_namespaces, 17: ignore_diverge}


@pytest.mark.parametrize("fault", sorted(REINJECTED))
def test_the_simulator_catches_each_reinjected_fault(fault, monkeypatch):
    timing = REINJECTED[fault](monkeypatch) or SIM_TIMING
    for seed in range(CI_SEEDS):
        result = run_seed(seed, STEPS, timing=timing)
        if result.violations:
            print(f"fault {fault}: caught by seed {seed} ({seed + 1} seed(s)): {result.violations[0]}")
            return
    pytest.fail(f"fault {fault} was not caught in {CI_SEEDS} seeds")
