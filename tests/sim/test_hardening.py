"""The simulator's hostile scenarios: an engine id registered again
while its last registration still departs (its workers hang on: ghosts), model
steps longer than the ack deadline that hold an unmap (the workers say
``Busy``), and hostile clients (huge or odd geometry, journals, grows and acks
naming what they do not hold). The first test shows each scenario really
happens on the CI seeds; the second re-injects the bugs they exist to catch
and shows each is found, by the check written for it.
"""

import re

import msgspec
import pytest

from kvelastic import protocol as p
from kvelastic.daemon.allocator import Allocator
from kvelastic.daemon.registration import Registration
from kvelastic.daemon.unmapping import Unmapping
from kvelastic_tools.sim.engine import BUSY
from kvelastic_tools.sim.guard import SimAbort
from kvelastic_tools.sim.run import SIM_TIMING, run_seed
from kvelastic_tools.sim.world import World

CI_SEEDS = 300
COVERAGE_SEEDS = 100
STEPS = 300


def test_each_hostile_scenario_happens():
    seen: dict[str, int] = {}
    for seed in range(COVERAGE_SEEDS):
        for name, n in run_seed(seed, STEPS).faults.items():
            seen[name] = seen.get(name, 0) + n
    # An engine id registered again while its last registration's workers still
    # run (frozen, or in a step that outlives their engine), and that new
    # registration departing too while the old one waits.
    assert seen.get("hung_workers", 0) > 10
    assert seen.get("ghost_frozen", 0) > 0 and seen.get("ghost_stepping", 0) > 0
    assert seen.get("id_reuse", 0) > 10
    assert seen.get("id_reuse_departed", 0) > 5
    # Model steps longer than the ack deadline, some holding an unmap past it.
    assert seen.get("long_step", 0) > 20
    assert seen.get("long_step_held_unmap", 0) > 0
    if BUSY is not None:                 # the workers of such steps said so (ghosts' too)
        assert seen.get("busy_long_step", 0) > 0 and seen.get("busy_ghost", 0) > 0
    # Hostile registrations (some accepted, most refused with a typed error)
    # and hostile journals on a registered engine's own connection.
    assert seen.get("hostile_registration", 0) > 50
    assert seen.get("hostile_accepted", 0) > 5
    assert seen.get("hostile_refused", 0) > 100
    assert seen.get("hostile_journal", 0) > 20


def test_a_runaway_call_is_reported_not_waited_for():
    """While a hostile engine is about, a call past the CPU limit is
    interrupted (a walk over 2**40 block ids would never end) and the run
    ends there, with the violation."""
    w = World(0)

    def spin():
        while True:
            pass
    w.guard.watch = True
    try:
        with pytest.raises(SimAbort):
            w.call(spin)
    finally:
        w.guard.close()
    assert len(w.violations) == 1 and "interrupted after" in w.violations[0]


# --------------------------------------------------------- re-injected faults
class ByEngineId(dict):
    """``Allocator.departing`` as it was: one record per engine id, a second
    departure of an id overwrites the first (whatever the dict's keys are)."""

    def __setitem__(self, key, record):
        for other in [k for k, r in self.items() if r.engine_id == record.engine_id and r is not record]:
            del self[other]
        super().__setitem__(key, record)


def overwrite_departing(monkeypatch):
    """Fault 14: a departing registration is overwritten by the next departure
    of its engine id (registered again meanwhile): its pages leave the books."""
    original = Allocator.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.books.departing = ByEngineId()
    monkeypatch.setattr(Allocator, "__init__", init)


def deadline_runs_during_step(monkeypatch):
    """Fault 15: the daemon ignores Busy: the ack deadline passes while a long
    step holds the unmap and says so, and the engine is failed."""
    if BUSY is None or not hasattr(Unmapping, "on_busy"):
        pytest.fail("the protocol or the allocator has no Busy yet: no deadline extension to take away")
    monkeypatch.setattr(Unmapping, "on_busy", lambda self, identity, m: None)


def no_geometry_cap(monkeypatch):
    """Fault 16: a registration's blocks need not fit in its slab (any
    blocks_per_slab x block_bytes is taken, whatever cap the daemon has)."""
    original = Registration.on_register_engine

    def register(self, identity, m):
        slab_bytes = m.pages_per_worker * max(1, m.num_workers) * m.page_size
        if m.blocks_per_slab * m.block_bytes <= slab_bytes or m.held:
            return original(self, identity, m)
        reply = original(self, identity, msgspec.structs.replace(m, blocks_per_slab=1, block_bytes=1))
        record = self.books.engines.get(m.engine_id)
        if isinstance(reply, p.Registered) and record is not None and record.identity == identity:
            record.blocks_per_slab, record.block_bytes = m.blocks_per_slab, m.block_bytes
            record.mirror.blocks_per_slab = m.blocks_per_slab
        return reply
    monkeypatch.setattr(Registration, "on_register_engine", register)


# Fault -> (its injection, what the check that must find it says).
HARDENING = {
    14: (overwrite_departing, r"a page is lost|pages: not each in exactly one place|adopted pages do not match"
                              r"|pages alive that the daemon does not know"),
    15: (deadline_runs_during_step, r"a long step held its unmaps and said Busy"),
    16: (no_geometry_cap, r"accepted out of bounds|interrupted after|s of CPU"),
}


@pytest.mark.parametrize("fault", sorted(HARDENING))
def test_the_simulator_catches_each_reinjected_hardening_fault(fault, monkeypatch):
    inject, expected = HARDENING[fault]
    inject(monkeypatch)
    others = []
    for seed in range(CI_SEEDS):
        result = run_seed(seed, STEPS, timing=SIM_TIMING)
        found = [v for v in result.violations if re.search(expected, v)]
        if found:
            print(f"fault {fault}: caught by seed {seed} ({seed + 1} seed(s)): {found[0]}")
            return
        others += result.violations[:1]
    pytest.fail(f"fault {fault} was not caught in {CI_SEEDS} seeds (other violations: {others[:3]})")
