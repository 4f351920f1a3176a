"""Virtual-memory backends: physical pages, reserved arenas, tensor views.

``get_backend(name)`` picks one: ``host`` (memfd pages, always available on
Linux), ``cuda`` (CUDA VMM; raises ``BackendUnavailable`` without a usable GPU)
or ``auto`` (cuda when usable, else host). The caller reads the configuration
(``KVELASTIC_BACKEND``); this package never reads the environment.
"""

from __future__ import annotations

from kvelastic.vmm.base import DEFAULT_PAGE_SIZE, Arena, Backend, Page
from kvelastic.vmm.errors import BackendUnavailable

BACKENDS = ("auto", "cuda", "host")


def cuda_usable() -> tuple[bool, str]:
    """(usable, why) without raising; cached after the first call."""
    from kvelastic.vmm.cuda import probe

    return probe()


def get_backend(name: str, page_size: int = DEFAULT_PAGE_SIZE, *, device: int = 0) -> Backend:
    """The backend called ``name`` with pages of ``page_size`` bytes."""
    if name == "auto":
        name = "cuda" if cuda_usable()[0] else "host"
    if name == "cuda":
        from kvelastic.vmm.cuda import CudaBackend

        return CudaBackend(page_size, device=device)
    if name == "host":
        from kvelastic.vmm.host import HostBackend

        return HostBackend(page_size)
    raise BackendUnavailable(f"unknown backend {name!r}; choose one of: {', '.join(BACKENDS)}")


__all__ = [
    "BACKENDS",
    "DEFAULT_PAGE_SIZE",
    "Arena",
    "Backend",
    "BackendUnavailable",
    "Page",
    "cuda_usable",
    "get_backend",
]
