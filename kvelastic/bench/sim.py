"""``kvelastic bench sim``: the deterministic simulation over many seeds.

Runs ``SEEDS`` seeded node simulations with faults (``kvelastic.sim``) and
reports the steps, the faults injected by kind, the invariant violations
(must be 0, each with its replay command) and the simulation speed; the
baseline is the same simulation without faults, in the same run.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Any

from kvelastic.sim.run import run_seed

SEEDS = 10_000
STEPS = 300


def _run(seeds: int, faults: bool) -> tuple[dict[str, Any], float]:
    injected: collections.Counter = collections.Counter()
    violations: list[str] = []
    start = time.perf_counter()
    for seed in range(seeds):
        result = run_seed(seed, STEPS, faults=faults)
        injected.update(result.faults)
        violations += [f"{v}  (replay: {result.replay})" for v in result.violations[:1]]
    elapsed = time.perf_counter() - start
    return {"seeds": seeds, "steps": seeds * STEPS, "faults": dict(sorted(injected.items())),
            "faults_total": sum(injected.values()), "violations": len(violations),
            "violation_examples": violations[:5]}, elapsed


def run(quick: bool = False) -> dict[str, Any]:
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
