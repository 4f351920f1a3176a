"""A node-sized, trace-driven simulation: eight engines on one 80 GiB device.

The real ``Allocator`` decides; each engine has a real ``SlabPool`` and the
client's real ``ReservePolicy``; engines, workers and the transport are
simulated on a fake clock, driven by a day-long request trace
(``kvelastic_tools.sim.traces``). Everything is seeded: a seed replays exactly.

Each engine behaves as the vLLM plugin does (docs/architecture.md, Grow):
- a scheduler step every ``STEP`` seconds: running requests first (a decode
  that crosses a block boundary needs one block; when none can be had the
  newest running request is preempted and recomputed later), then waiting
  requests in arrival order (prefix-cache hits first, then new blocks);
- a capacity check that needs more *free* blocks than the pool has sends a
  demand ``Grow`` and blocks the scheduler until the answer or
  ``DEMAND_WAIT`` (``EngineClient.ensure`` with ``keep_cache`` and ``wait``:
  a later answer is a late grant, and no second demand goes before it);
  after a refusal it does not ask again for ``REFUSAL_BACKOFF``; then free +
  cached blocks are what it can use (allocation evicts LRU cached blocks);
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

The parts, from the bottom up: ``node_engine.py`` (an engine, which sees the
loop through ``node_engine.NodeLoop``), ``node_sim.py`` (the event loop,
``NodeSim``), ``node_report.py`` (the figures of finished runs); this module
runs them.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from kvelastic_tools.sim import traces
from kvelastic_tools.sim.node_report import report
from kvelastic_tools.sim.node_sim import BUDGET_PAGES, NodeSim


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
