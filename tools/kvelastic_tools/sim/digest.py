"""Same seeds, same results: every seed's run of the node simulation
(``run.py``) as one JSON line (its steps, faults and events counted,
violations, cached blocks adopted, and a hash of the daemon's books at the
end), so two versions of the daemon compare seed by seed:

    python -m kvelastic_tools.sim.digest 0 200 > before.jsonl
    ... change the daemon ...
    python -m kvelastic_tools.sim.digest 0 200 > after.jsonl && cmp before.jsonl after.jsonl
"""

from __future__ import annotations

import json
import logging
import sys

from kvelastic_tools.sim.run import run_seed


def digest(seed: int, steps: int = 300) -> str:
    r = run_seed(seed, steps)
    return json.dumps({"seed": seed, "steps": r.steps, "faults": dict(sorted(r.faults.items())),
                       "violations": r.violations, "handed": r.handed_blocks, "orphan": r.orphan_blocks,
                       "kept": r.kept_blocks, "restored": r.restored_blocks, "books": r.books})


def main(argv: list[str]) -> int:
    logging.disable(logging.CRITICAL)
    first, last = int(argv[0]), int(argv[1])
    for seed in range(first, last):
        print(digest(seed), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
