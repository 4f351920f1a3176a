"""Where ``kvelastic bench NAME`` finds its benchmarks: entry points of the
group ``kvelastic.benchmarks``, each naming a module with
``run(quick: bool, **options) -> dict`` (the figures, the baseline measured
in the same run, and their ratio).

The runtime ships no benchmark: they come with the tools package
(``tools/``: ``kvelastic-tools``, which ``make setup`` installs), so a node
that installs the runtime alone carries no benchmark, simulator, fuzzer or
GPU kit, and the runtime never imports the tools by name."""

from __future__ import annotations

import importlib
import os
from importlib.metadata import entry_points
from typing import Any

ENTRY_POINT_GROUP = "kvelastic.benchmarks"


class UnknownBenchmark(KeyError):
    """No installed package declares a benchmark of that name."""


def available() -> dict[str, str]:
    """Benchmark name -> module, as the installed packages declare them."""
    return {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}


def run(name: str, quick: bool = False, **options: Any) -> dict[str, Any]:
    modules = available()
    if name not in modules:
        raise UnknownBenchmark(name)
    # A benchmark's daemons start no keeper (it would outlive the run by
    # KVELASTIC_KEEPER_LINGER): those that measure one start their own.
    os.environ.setdefault("KVELASTIC_KEEPER", "external")
    return importlib.import_module(modules[name]).run(quick=quick, **options)
