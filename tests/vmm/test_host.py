"""Host backend: memory really comes and goes, and the range never has a hole.

The checks read the kernel's own counters (``/proc/self/status``,
``/proc/self/maps``, ``/proc/meminfo``, ``fstat().st_blocks``), never the
backend's bookkeeping.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch

from kvelastic.vmm import DEFAULT_PAGE_SIZE
from kvelastic.vmm.errors import SystemCallError
from kvelastic.vmm.host import HostBackend, HostPage
from tests.vmm.memio import maps_covering, meminfo_kib, pattern, proc_status_kib, read, write

PS = DEFAULT_PAGE_SIZE
PS_KIB = PS // 1024


def _resident(page: HostPage) -> int:
    return os.fstat(page.fd).st_blocks * 512


def test_large_reservation_costs_no_memory(host: HostBackend) -> None:
    with host.reserve(PS) as warm:  # first-use costs of torch's view code are not the arena's
        warm.tensor(torch.float16, (16,))
    gc.collect()
    rss0, size0 = proc_status_kib("VmRSS"), proc_status_kib("VmSize")
    with host.reserve(64 << 30) as arena:
        assert proc_status_kib("VmSize") - size0 >= (64 << 30) // 1024  # the addresses are really taken
        assert proc_status_kib("VmRSS") - rss0 < 1024  # ... and cost no memory
        kv = arena.tensor(torch.float16, (arena.size // 2,))  # a view of the whole 64 GiB, no copy
        assert kv.untyped_storage().nbytes() == 64 << 30
        assert proc_status_kib("VmRSS") - rss0 < 2048  # (allocator noise, far below one page)

        page = host.create_page()
        shmem0 = proc_status_kib("RssShmem")
        last = arena.size - PS
        arena.map(last, page)
        kv[last // 2 :].fill_(1.5)  # touch every byte of the one mapped page
        assert proc_status_kib("RssShmem") - shmem0 == PS_KIB
        assert proc_status_kib("VmRSS") - rss0 < PS_KIB + 2048
        assert _resident(page) == PS
        del kv
    host.release_page(page)


def test_memory_is_given_back_after_unmap_and_release(host: HostBackend) -> None:
    n = 32  # 64 MiB: a clear signal above other processes' shmem noise
    gc.collect()
    shm_sys0 = meminfo_kib("Shmem")
    pages = [host.create_page() for _ in range(n)]
    arena = host.reserve(n * PS)
    shmem0 = proc_status_kib("RssShmem")
    for i, page in enumerate(pages):
        arena.map(i * PS, page)
    arena.tensor(torch.uint8, (n * PS,)).fill_(7)
    assert proc_status_kib("RssShmem") - shmem0 == n * PS_KIB
    assert all(_resident(p) == PS for p in pages)
    assert meminfo_kib("Shmem") - shm_sys0 >= n * PS_KIB * 3 // 4

    for i in range(n):
        arena.unmap(i * PS)
    assert proc_status_kib("RssShmem") - shmem0 <= 64  # no longer mapped in this process
    assert not any("kvelastic-page" in m[3] for m in maps_covering(arena.base, arena.base + arena.size))
    assert all(_resident(p) == PS for p in pages)  # ... but the memfds still hold it

    host.zero(pages[0])  # a punched hole frees at once
    assert _resident(pages[0]) == 0
    fds = [p.fd for p in pages]
    for page in pages:
        host.release_page(page)
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)
    # The last descriptor is gone: the kernel has the memory back (system-wide
    # counter, so allow for other processes' noise).
    assert meminfo_kib("Shmem") - shm_sys0 < n * PS_KIB // 4
    arena.close()


def test_zero_is_seen_through_a_live_mapping(host: HostBackend) -> None:
    page = host.create_page()
    with host.reserve(PS) as arena:
        arena.map(0, page)
        write(arena, 0, pattern(1, 4096))
        host.zero(page)
        assert _resident(page) == 0
        assert read(arena, 0, 4096) == bytes(4096)
    host.release_page(page)


def test_unmap_leaves_no_hole(host: HostBackend) -> None:
    page = host.create_page()
    with host.reserve(3 * PS) as arena:
        end = arena.base + arena.size

        def layout() -> list[tuple[int, int, str]]:
            return [(lo, hi, perms) for lo, hi, perms, _ in maps_covering(arena.base, end)]

        arena.map(PS, page)
        assert any(p.startswith("rw-s") for _, _, p in layout())
        arena.unmap(PS)
        spans = layout()
        assert all(p == "---p" for _, _, p in spans)
        assert spans[0][0] <= arena.base and spans[-1][1] >= end
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), "contiguous: no hole"
    host.release_page(page)


def test_failed_mmap_rolls_back_to_reserved(host: HostBackend, tmp_path) -> None:
    # A read-only descriptor cannot back a PROT_WRITE shared mapping: a real
    # mmap failure inside map(), after every check passed.
    path = tmp_path / "ro"
    path.write_bytes(bytes(PS))
    fd = os.open(path, os.O_RDONLY)
    bad = HostPage(fd, PS)
    good = host.create_page()
    try:
        with host.reserve(2 * PS) as arena:
            arena.map(0, good)
            write(arena, 0, pattern(2, 4096))
            with pytest.raises(SystemCallError) as info:
                arena.map(PS, bad)
            assert info.value.errno_name == "EACCES" and "mmap" in str(info.value)
            assert arena.mapped() == {0: good}
            assert [p for _, _, p, _ in maps_covering(arena.base + PS, arena.base + 2 * PS)] == ["---p"]
            assert read(arena, 0, 4096) == pattern(2, 4096)
    finally:
        os.close(fd)
        host.release_page(good)


def test_views_keep_a_closed_arena_reserved(host: HostBackend) -> None:
    arena = host.reserve(2 * PS)
    base, end = arena.base, arena.base + arena.size
    view = arena.tensor(torch.int32, (16,))
    arena.close()
    # The stale view points at inaccessible, still-reserved addresses, never at
    # memory another allocation could get.
    assert [p for _, _, p, _ in maps_covering(base, end)] == ["---p"]
    del view
    gc.collect()
    assert maps_covering(base, end) == []


def test_import_checks_the_descriptor(host: HostBackend) -> None:
    other = HostBackend(page_size=2 * PS)
    big = other.create_page()
    fd = other.export(big)
    with pytest.raises(Exception) as info:
        host.import_page(fd)
    assert info.value.reason == "page_mismatch"
    os.fstat(fd)  # a failed import leaves the caller's descriptor open
    os.close(fd)
    other.release_page(big)
