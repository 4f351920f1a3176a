"""Benchmarks: ``kvelastic bench NAME --json``.

Each benchmark module exposes ``run(quick: bool) -> dict``; the dict holds the
figures, the baseline measured in the same run, and their ratio. The CLI
prints it as one JSON object on the last line of output.
"""

import importlib
from typing import Any

BENCHMARKS: dict[str, str] = {
    "core": "kvelastic.bench.core",
    "vmm": "kvelastic.bench.vmm",
    "grant": "kvelastic.bench.grant",
    "vllm": "kvelastic.bench.vllm",
    "sim": "kvelastic.bench.sim",
    "fuzz": "kvelastic.bench.fuzz",
    "elastic": "kvelastic.bench.elastic",
}


def run(name: str, quick: bool = False) -> dict[str, Any]:
    if name not in BENCHMARKS:
        raise KeyError(name)
    module = importlib.import_module(BENCHMARKS[name])
    return module.run(quick=quick)
