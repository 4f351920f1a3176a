"""Benchmarks: ``kvelastic bench NAME --json``.

Each benchmark module exposes ``run(quick: bool) -> dict``; the dict holds the
figures, the baseline measured in the same run, and their ratio. The CLI
prints it as one JSON object on the last line of output.

The built-in ones need nothing but kvelastic. Other packages add theirs as
entry points of the group ``kvelastic.benchmarks`` whose value names such a
module (the vLLM plugin declares ``vllm`` and ``elastic``), so kvelastic never
imports them by name.
"""

import importlib
from importlib.metadata import entry_points
from typing import Any

ENTRY_POINT_GROUP = "kvelastic.benchmarks"
BUILT_IN: dict[str, str] = {
    "core": "kvelastic.bench.core",
    "vmm": "kvelastic.bench.vmm",
    "grant": "kvelastic.bench.grant",
    "handoff": "kvelastic.bench.handoff",
    "sim": "kvelastic.bench.sim",
    "fuzz": "kvelastic.bench.fuzz",
}


def available() -> dict[str, str]:
    """Benchmark name -> module: the built-in ones and those installed packages
    declare. A declared name cannot shadow a built-in one."""
    declared = {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}
    return {**declared, **BUILT_IN}


def run(name: str, quick: bool = False) -> dict[str, Any]:
    modules = available()
    if name not in modules:
        raise KeyError(name)
    module = importlib.import_module(modules[name])
    return module.run(quick=quick)
