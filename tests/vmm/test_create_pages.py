"""``Backend.create_pages``: n zeroed, distinct pages, all or none; and the
daemon's ``Device.create``, which uses it in batches and must still create
every page that fits when a batch fails (out of memory part way).

Why zero is checked after dirty pages were released: a backend may hand back
memory it just freed (CUDA does, within a process), so a new page reading zero
is the backend's work, not luck.
"""

from __future__ import annotations

import os

import pytest

from kvelastic.daemon import devices
from kvelastic.daemon.devices import Device
from kvelastic.vmm import DEFAULT_PAGE_SIZE
from kvelastic.vmm.base import Backend, Page
from kvelastic.vmm.errors import OutOfRange, SystemCallError
from kvelastic.vmm.host import HostBackend, HostPage
from tests.vmm.gpu import on_gpu
from tests.vmm.memio import read, write

PS = DEFAULT_PAGE_SIZE


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _all_zero_after_dirty_release(backend: Backend, n: int) -> list[Page]:
    """Dirty n pages, release them, then create_pages(n): returned, each checked zero."""
    old = [backend.create_page() for _ in range(n)]
    with backend.reserve(n * PS) as arena:
        for i, page in enumerate(old):
            arena.map(i * PS, page)
            write(arena, i * PS, b"\xa5" * 4096)
            write(arena, i * PS + PS - 4096, b"\x5a" * 4096)
        for i in range(n):
            arena.unmap(i * PS)
    for page in old:
        backend.release_page(page)
    pages = backend.create_pages(n)
    with backend.reserve(n * PS) as arena:
        for i, page in enumerate(pages):
            arena.map(i * PS, page)
            assert read(arena, i * PS, PS) == bytes(PS), f"page {i} of the batch is not zero"
            arena.unmap(i * PS)
    return pages


def test_create_pages_gives_distinct_zeroed_pages(backend: Backend) -> None:
    pages = _all_zero_after_dirty_release(backend, 6)
    assert len(pages) == 6 and all(p.size == PS and not p.closed for p in pages)
    assert len({id(p) for p in pages}) == 6
    # Distinct memory, not six handles of one page: a write to one shows in no other.
    with backend.reserve(6 * PS) as arena:
        for i, page in enumerate(pages):
            arena.map(i * PS, page)
        write(arena, 2 * PS, b"\x77" * 64)
        assert [read(arena, i * PS, 64) == b"\x77" * 64 for i in range(6)] == [i == 2 for i in range(6)]
    for page in pages:
        backend.release_page(page)
    assert all(p.closed for p in pages)


def test_create_pages_of_zero_and_bad_counts(backend: Backend) -> None:
    assert backend.create_pages(0) == []
    for bad in (-1, 1.5, "2"):
        with pytest.raises(OutOfRange):
            backend.create_pages(bad)  # type: ignore[arg-type]


class LimitedHost(HostBackend):
    """Host pages that run out after ``limit`` live ones (a device that is full)."""

    def __init__(self, limit: int) -> None:
        super().__init__(PS)
        self.limit = limit
        self.live = 0
        self.made: list[Page] = []

    def create_page(self) -> HostPage:
        if self.live >= self.limit:
            raise SystemCallError("memfd_create", 12)   # ENOMEM
        page = super().create_page()
        self.live += 1
        self.made.append(page)
        return page

    def release_page(self, page: Page) -> None:
        super().release_page(page)
        self.live -= 1


def test_a_failed_create_pages_releases_what_it_made() -> None:
    backend = LimitedHost(limit=3)
    fds = _open_fds()
    with pytest.raises(SystemCallError):
        backend.create_pages(5)
    assert len(backend.made) == 3 and all(p.closed for p in backend.made)
    assert backend.live == 0 and _open_fds() == fds
    assert len(backend.create_pages(3)) == 3     # nothing was left holding the room


def test_device_create_keeps_the_pages_that_fit_when_a_batch_fails() -> None:
    backend = LimitedHost(limit=devices.BATCH + 6)
    device = Device("0", backend, 1 << 40)
    ids = list(range(100, 100 + 2 * devices.BATCH))
    done = device.create(ids)
    # The first batch whole; the second fails as a batch, then page by page up to the limit.
    assert done == ids[:devices.BATCH + 6]
    assert sorted(device.pages) == done and all(not p.closed for p in device.pages.values())
    assert backend.live == devices.BATCH + 6
    device.release_all()
    assert backend.live == 0 and device.pages == {}


class NoBatchHost(HostBackend):
    """A backend whose batched call always fails (a scrub that fails) while single pages work."""

    def create_pages(self, n: int) -> list[Page]:
        raise SystemCallError("batch", 5)


def test_device_create_falls_back_to_one_by_one_and_goes_on() -> None:
    device = Device("0", NoBatchHost(PS), 1 << 40)
    ids = list(range(devices.BATCH + 3))
    assert device.create(ids) == ids
    assert len({id(p) for p in device.pages.values()}) == len(ids)
    device.release_all()


@on_gpu
def test_cuda_create_pages_rolls_back_every_handle_on_a_failed_scrub(cuda: Backend,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from cuda.bindings import driver

    from kvelastic.vmm.errors import CudaError

    def fail(handles: list[int]) -> None:
        raise CudaError("cuMemsetD8Async", "CUDA_ERROR_INJECTED")

    cuda.make_current()
    free_before = driver.cuMemGetInfo()[1]
    monkeypatch.setattr(cuda, "_scrub", fail)
    with pytest.raises(CudaError):
        cuda.create_pages(16)
    monkeypatch.undo()
    # 16 leaked pages would be 32 MiB; allow other allocations' slack of one page or two.
    assert driver.cuMemGetInfo()[1] >= free_before - 2 * PS
    pages = cuda.create_pages(4)     # the scratch range and stream still work after the failure
    assert len(pages) == 4
    for page in pages:
        cuda.release_page(page)
