"""GPU test marking: ``gpu`` marker plus a clean skip where no CUDA GPU is usable."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import pytest

from kvelastic.vmm import cuda_usable

F = TypeVar("F", bound=Callable[..., Any])

CUDA_OK, CUDA_WHY = cuda_usable()
SKIP_REASON = f"no usable CUDA GPU ({CUDA_WHY})"
requires_gpu = pytest.mark.skipif(not CUDA_OK, reason=SKIP_REASON)
gpu = [pytest.mark.gpu, requires_gpu]  # for pytest.param(..., marks=gpu)


def on_gpu(test: F) -> F:
    return pytest.mark.gpu(requires_gpu(test))
