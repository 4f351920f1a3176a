"""``kvelastic bench sim``: the deterministic simulations.

``--scale seeds`` (the default): runs ``SEEDS`` seeded small-node
simulations with faults (``kvelastic_tools.sim``) and reports the steps, the
faults injected by kind, the cached blocks handed on within a namespace
(by live replicas, and from departed engines' kept cache: warm starts),
the invariant violations (must be 0, each with its replay command) and the
simulation speed; the baseline is the same simulation without faults, in
the same run. Odd seeds run with the node's tier (``sim/tier.py``): ``tier``
reports those seeds and what the tier saw (blocks demoted and promoted, disks
full, torn blocks, leases ended with their engine or at their deadline,
invalidations of tier namespaces).

``--scale node``: one compressed day of a GPU node (``kvelastic_tools.sim.node``):
8 engines on an 80 GiB device in 2 MiB pages, driven by a seeded trace;
reports the allocator's decision rate against the node's peak need,
utilisation against an oracle, demand served, handoff latency, slab moves
and thrash, against the same trace on a static split in the same run, and
writes a plot (``KVELASTIC_SIM_PLOT``, default ``node-sim.png``).
"""

from __future__ import annotations

import collections
import logging
import os
import time
from typing import Any

from kvelastic_tools.sim.run import run_seed
from kvelastic_tools.sim.tier import with_tier

TIER_KINDS = ("tier_", "lease_")     # the tier's faults and events (``sim/tier.py``)

SEEDS = 10_000
STEPS = 300


def _run(seeds: int, faults: bool) -> tuple[dict[str, Any], float]:
    injected: collections.Counter = collections.Counter()
    violations: list[str] = []
    handed = orphaned = kept = restored = 0
    start = time.perf_counter()
    for seed in range(seeds):
        result = run_seed(seed, STEPS, faults=faults)
        injected.update(result.faults)
        handed += result.handed_blocks
        orphaned += result.orphan_blocks
        kept += result.kept_blocks
        restored += result.restored_blocks   # kept blocks adopted by engines across a daemon restart
        violations += [f"{v}  (replay: {result.replay})" for v in result.violations[:1]]
    elapsed = time.perf_counter() - start
    tier = {kind: n for kind, n in sorted(injected.items()) if kind.startswith(TIER_KINDS)}
    return {"seeds": seeds, "steps": seeds * STEPS, "faults": dict(sorted(injected.items())),
            "tier": {"seeds": sum(map(with_tier, range(seeds))), **tier},
            "faults_total": sum(injected.values()), "handed_blocks": handed, "orphan_blocks": orphaned,
            "kept_blocks": kept, "restored_blocks": restored, "violations": len(violations),
            "violation_examples": violations[:5]}, elapsed


NODE_SEED = 1
NODE_DAY_SECONDS = 480.0         # 24 h in 8 simulated minutes (180x)
NODE_QUICK_DAY_SECONDS = 96.0    # --quick: 24 h in 96 s (900x) ...
NODE_QUICK_SCALE = 0.25          # ... on a quarter of the node (20 GiB, a quarter of the load)


def run(quick: bool = False, scale: str = "seeds") -> dict[str, Any]:
    if scale == "node":
        from kvelastic_tools.sim.node import run_node

        return run_node(seed=NODE_SEED, day_seconds=NODE_QUICK_DAY_SECONDS if quick else NODE_DAY_SECONDS,
                        drain=10.0 if quick else 30.0, scale=NODE_QUICK_SCALE if quick else 1.0,
                        plot_path=os.environ.get("KVELASTIC_SIM_PLOT") or "node-sim.png")
    if scale != "seeds":
        raise ValueError(f"scale {scale!r}: 'seeds' or 'node'")
    logging.disable(logging.CRITICAL)     # the daemon's operator log is noise here
    try:
        seeds = 200 if quick else SEEDS
        with_faults, elapsed = _run(seeds, faults=True)
        baseline, base_elapsed = _run(max(1, seeds // 10), faults=False)
    finally:
        logging.disable(logging.NOTSET)
    speed = with_faults["steps"] / elapsed
    base_speed = baseline["steps"] / base_elapsed
    return {"benchmark": "sim", **with_faults, "seconds": round(elapsed, 2),
            "steps_per_second": round(speed), "baseline_no_faults": {**baseline, "steps_per_second": round(base_speed)},
            "ratio_speed_vs_no_faults": round(speed / base_speed, 3)}
