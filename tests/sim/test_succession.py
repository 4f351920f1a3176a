"""Daemon restarts with a keeper in the simulator (``kvelastic_tools.sim.keeper``):
the daemon stops gracefully, is killed between inputs, or is killed part-way
through an input's effects; its successor adopts the kept cache its state
file names and its keeper holds (the real ``saved`` functions and
``Allocator.adopt_kept``), sometimes from a torn file or a lost keeper. The
adopted slabs' blocks must reach engines of their namespace only, holding
their keys' KV, never while a worker maps their pages. Running engines'
slabs are saved as lent records and adopted with their pages on
an exact claim; every slab a registration holds with pages must be what its
workers map for it, and a held record's pages mapped by no other registration.

The second re-injects faults of the loop's writes and shows the simulator
catches each: the state file written only after an input's effects, not
before pages are sent (the write-ahead: a successor adopts a kept slab a
worker maps, or holds a lent record naming a page another registration
maps), or only at a graceful stop (a
killed daemon's successor adopts a kept slab it had lent: a worker maps its
pages), or lost at a graceful stop (the successor adopts nothing), or the
lent slabs written only with the kept cache, never ahead of pages sent for a
slab the file names otherwise (a held record names a page another
registration maps: a claim would adopt it twice)."""

import pytest

from kvelastic_tools.sim import keeper
from kvelastic_tools.sim.run import run_seed

SEEDS = 150
STEPS = 300


def test_kept_cache_survives_daemon_crashes_with_no_violation():
    faults: dict[str, int] = {}
    restored = 0
    failures = []
    for seed in range(SEEDS):
        result = run_seed(seed, STEPS)
        for kind, n in result.faults.items():
            faults[kind] = faults.get(kind, 0) + n
        restored += result.restored_blocks
        if result.violations:
            failures.append(f"{result.violations[0]}  (replay: {result.replay})")
    assert not failures, f"{len(failures)} seed(s) failed:\n" + "\n".join(failures[:5])
    for kind in ("daemon_restart", "daemon_crash", "daemon_crash_mid_input", "state_torn", "keeper_lost"):
        assert faults.get(kind, 0) > 0, f"no {kind} in {SEEDS} seeds"
    assert faults.get("daemon_restart_kept", 0) > 0      # new daemons adopted kept slabs ...
    assert restored > 0                                  # ... and engines adopted their blocks (checked)
    assert faults.get("lent_adopted", 0) > 0             # running engines' slabs adopted with their pages
    assert faults.get("lent_unmatched_no_record", 0) > 0 and faults.get("lent_let_go", 0) > 0


def saved_only_after_effects(monkeypatch):
    """The loop writes its state file once an input's effects are done, not
    before it sends pages: a daemon killed in between leaves a file naming a
    kept slab it just lent."""
    monkeypatch.setattr(keeper.Keeper, "save_ahead", lambda self, w: None)


def saved_only_at_stop(monkeypatch):
    """The state file is written at a graceful stop only."""
    monkeypatch.setattr(keeper.Keeper, "save_ahead", lambda self, w: None)
    monkeypatch.setattr(keeper.Keeper, "save_after", lambda self, w: None)


def file_dropped_at_stop(monkeypatch):
    """A graceful stop writes the file, then loses it (as a loop whose last
    write, once the keeper is detached, removes the file for a lost keeper)."""
    save_at_stop = keeper.Keeper.save_at_stop

    def drop(self, w):
        save_at_stop(self, w)
        self.saved = None
    monkeypatch.setattr(keeper.Keeper, "save_at_stop", drop)


def lent_saved_late(monkeypatch):
    """Lent slabs written only when the kept cache moves (or every 5 s), and
    never ahead of pages sent for a slab whose id or pages the file names
    otherwise: a file that names a page under a slab it has left."""
    from kvelastic.daemon import saved

    monkeypatch.setattr(saved.Saving, "conflict", lambda self, books: False)
    monkeypatch.setattr(saved.Saving, "__init__", lambda self, coalesce=5.0: _init(self, coalesce))


def _init(self, coalesce):
    from kvelastic.daemon import saved

    self.coalesce, self.kept_version, self.lent, self.written_at = coalesce, -1, None, float("-inf")
    self.slabs, self.pages, self._lent = {}, {}, []
    assert isinstance(self, saved.Saving)


@pytest.mark.parametrize(("fault", "found"), [(saved_only_after_effects, ("a worker maps its page",
                                                                          "of another registration")),
                                              (saved_only_at_stop, ("a worker maps its page",
                                                                    "of another registration")),
                                              (file_dropped_at_stop, "a graceful stop left"),
                                              (lent_saved_late, "of another registration")])
def test_the_simulator_catches_a_state_file_not_written_as_the_loop_must(fault, found, monkeypatch):
    fault(monkeypatch)
    for seed in range(300):
        result = run_seed(seed, STEPS)
        if result.violations:
            print(f"{fault.__name__}: caught by seed {seed}: {result.violations[0]}")
            assert any(f in result.violations[0] for f in ((found,) if isinstance(found, str) else found)), \
                result.violations
            return
    pytest.fail(f"{fault.__name__} was not caught in 300 seeds")
