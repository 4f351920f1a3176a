"""Settled slabs in the simulator: a slab an engine gives up (a reclaim or a
return) while a step is in flight is unmapped at once when its pool calls it
settled (``SlabPool.settled``), and the step must write none of its pages.
Requests here also end while a step runs over their blocks (vLLM's async
scheduling): the slabs those blocks sit in are not settled until that step
ended, and a rule that forgot it is caught."""

from __future__ import annotations

import collections

from kvelastic.core.books import PoolBooks
from kvelastic_tools.sim import engine as sim_engine
from kvelastic_tools.sim.run import run_seed

SEEDS = 40
STEPS = 300


def test_settled_slabs_go_at_once_during_steps_and_never_under_one(monkeypatch):
    monkeypatch.setattr(sim_engine, "FREE_IN_STEP", 0.3)
    counts: collections.Counter = collections.Counter()
    for seed in range(SEEDS):
        result = run_seed(seed, STEPS)
        assert not result.violations, (result.replay, result.violations[:3])
        counts.update(result.faults)
    assert counts["unmapped_in_step"] > SEEDS // 2, counts      # the case happened, often


def test_the_simulator_catches_a_slab_called_settled_while_a_step_writes_it(monkeypatch):
    """The rule without its step condition: a slab whose last block was
    freed in the step that runs is unmapped under that step."""
    monkeypatch.setattr(sim_engine, "FREE_IN_STEP", 0.3)
    monkeypatch.setattr(PoolBooks, "settled", lambda self, slab_ids: [
        s for s in slab_ids if (slab := self._slabs.get(s)) is not None and slab.live == 0])
    for seed in range(SEEDS):
        result = run_seed(seed, STEPS)
        if result.violations:
            assert "unmapped at once (settled) while step" in result.violations[0], result.violations
            return
    raise AssertionError(f"a settled rule without its step condition was not caught in {SEEDS} seeds")
