from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvelastic.vmm import get_backend
from kvelastic.vmm.base import Backend
from tests.vmm.gpu import CUDA_OK, SKIP_REASON, gpu


@pytest.fixture(params=["host", pytest.param("cuda", marks=gpu)])
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    """Every backend this machine can run; the shared behaviour must hold on each."""
    b = get_backend(request.param)
    yield b
    b.close()


@pytest.fixture
def host() -> Iterator[Backend]:
    b = get_backend("host")
    yield b
    b.close()


@pytest.fixture
def cuda() -> Iterator[Backend]:
    """The cuda backend; tests that use it are also marked with ``on_gpu``."""
    if not CUDA_OK:
        pytest.skip(SKIP_REASON)
    b = get_backend("cuda")
    yield b
    b.close()
