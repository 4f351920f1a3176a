"""Summary figures that benchmarks, simulators and the GPU kit report."""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q``-quantile (``0 < q <= 1``) of ``values``: an
    observed value, never an interpolation (a p99 that some sample reached).
    0.0 for no values, so a figure of an empty run reads as zero."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]
