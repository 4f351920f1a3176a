"""Behaviour every backend shares: mapping, aliasing, hand-off, typed errors.

Each error test checks the promise of ``VmmError``: the failed call changed
nothing (mappings, their data, and the pages stay as they were).
"""

from __future__ import annotations

import os

import pytest
import torch

from kvelastic.vmm import DEFAULT_PAGE_SIZE, get_backend
from kvelastic.vmm.base import Backend
from kvelastic.vmm.errors import (
    AlreadyMapped,
    ClosedHandleError,
    InvalidPageSize,
    MappingError,
    NotMapped,
    OutOfRange,
    PageMismatch,
    TensorLayoutError,
    UnalignedOffset,
    VmmError,
)
from tests.vmm.memio import pattern, read, write

PS = DEFAULT_PAGE_SIZE
N = 4096  # bytes checked at the start of a page (enough to see aliasing)


def test_page_size_and_granularity(backend: Backend) -> None:
    assert backend.page_size == PS
    assert PS % backend.granularity == 0
    page = backend.create_page()
    assert page.size == PS and not page.closed
    backend.release_page(page)
    assert page.closed
    with pytest.raises(InvalidPageSize):
        get_backend(backend.name, page_size=backend.granularity + 1)
    with pytest.raises(InvalidPageSize):
        get_backend(backend.name, page_size=0)


def test_reserve_rounds_up_to_pages(backend: Backend) -> None:
    with backend.reserve(PS + 1) as arena:
        assert arena.size == 2 * PS
        assert arena.base % PS == 0
    with pytest.raises(OutOfRange):
        backend.reserve(0)


def test_map_unmap_remap(backend: Backend) -> None:
    p1, p2 = backend.create_page(), backend.create_page()
    with backend.reserve(4 * PS) as arena:
        arena.map(0, p1)
        assert read(arena, 0, N) == bytes(N), "a new page reads as zeros"
        write(arena, 0, pattern(1, N))
        assert arena.unmap(0) is p1
        assert not arena.is_mapped(0)
        arena.map(0, p2)
        assert read(arena, 0, N) == bytes(N), "the slot now shows the other page"
        write(arena, 0, pattern(2, N))
        arena.map(3 * PS, p1)  # the page's memory outlived its mapping
        assert read(arena, 3 * PS, N) == pattern(1, N)
        assert read(arena, 0, N) == pattern(2, N)
        assert arena.mapped() == {0: p2, 3 * PS: p1}
    assert arena.closed and arena.mapped() == {}
    backend.release_page(p1)
    backend.release_page(p2)


def test_same_page_in_two_arenas_aliases(backend: Backend) -> None:
    page = backend.create_page()
    with backend.reserve(2 * PS) as a, backend.reserve(2 * PS) as b:
        a.map(PS, page)
        b.map(0, page)
        write(a, PS + 100, b"kvelastic")
        assert read(b, 100, 9) == b"kvelastic"
    backend.release_page(page)


def test_export_import_shares_memory(backend: Backend) -> None:
    page = backend.create_page()
    fd = backend.export(page)
    twin = backend.import_page(fd)  # takes ownership of fd
    assert twin.size == PS
    with backend.reserve(2 * PS) as arena:
        arena.map(0, page)
        arena.map(PS, twin)
        write(arena, 0, pattern(7, N))
        assert read(arena, PS, N) == pattern(7, N)
    backend.release_page(twin)
    backend.release_page(page)


def test_release_while_mapped_keeps_memory_until_unmap(backend: Backend) -> None:
    page = backend.create_page()
    with backend.reserve(PS) as arena:
        arena.map(0, page)
        write(arena, 0, pattern(3, N))
        backend.release_page(page)
        assert read(arena, 0, N) == pattern(3, N)
        arena.unmap(0)
        with pytest.raises(ClosedHandleError):
            arena.map(0, page)
        assert not arena.is_mapped(0)


def test_zero(backend: Backend) -> None:
    page = backend.create_page()
    with backend.reserve(PS) as arena:
        arena.map(0, page)
        write(arena, 0, pattern(4, N))
        write(arena, PS - N, pattern(5, N))
        arena.unmap(0)
        backend.zero(page)
        arena.map(0, page)
        assert read(arena, 0, N) == bytes(N)
        assert read(arena, PS - N, N) == bytes(N)
    backend.release_page(page)


# --- every error leaves the state unchanged --------------------------------
@pytest.fixture
def mapped(backend: Backend):
    """An arena of 4 pages with one page mapped at offset PS and data in it."""
    page, spare = backend.create_page(), backend.create_page()
    arena = backend.reserve(4 * PS)
    arena.map(PS, page)
    write(arena, PS, pattern(9, N))
    yield backend, arena, page, spare
    arena.close()
    for p in (page, spare):
        if not p.closed:
            backend.release_page(p)


def _unchanged(arena, page) -> None:
    assert arena.mapped() == {PS: page}
    assert read(arena, PS, N) == pattern(9, N)


@pytest.mark.parametrize(
    ("offset", "error"),
    [
        (PS, AlreadyMapped),  # double map
        (1, UnalignedOffset),
        (PS + 4096, UnalignedOffset),
        (-PS, OutOfRange),
        (4 * PS, OutOfRange),
        (1 << 50, OutOfRange),
    ],
)
def test_bad_map_changes_nothing(mapped, offset: int, error: type[MappingError]) -> None:
    backend, arena, page, spare = mapped
    with pytest.raises(error) as info:
        arena.map(offset, spare)
    assert info.value.reason == error.reason and str(info.value)
    _unchanged(arena, page)
    arena.map(0, spare)  # the spare page is still usable


@pytest.mark.parametrize(
    ("offset", "error"),
    [(0, NotMapped), (2 * PS, NotMapped), (PS + 1, UnalignedOffset), (-PS, OutOfRange), (4 * PS, OutOfRange)],
)
def test_bad_unmap_changes_nothing(mapped, offset: int, error: type[MappingError]) -> None:
    backend, arena, page, spare = mapped
    with pytest.raises(error):
        arena.unmap(offset)
    _unchanged(arena, page)


def test_closed_page_errors(mapped) -> None:
    backend, arena, page, spare = mapped
    backend.release_page(spare)
    for call in (
        lambda: arena.map(0, spare),
        lambda: backend.release_page(spare),
        lambda: backend.export(spare),
        lambda: backend.zero(spare),
    ):
        with pytest.raises(ClosedHandleError):
            call()
    _unchanged(arena, page)


def test_closed_arena_errors(mapped) -> None:
    backend, arena, page, spare = mapped
    arena.close()
    arena.close()  # idempotent
    assert arena.mapped() == {}
    for call in (
        lambda: arena.map(0, spare),
        lambda: arena.unmap(PS),
        lambda: arena.tensor(torch.uint8, (1,)),
    ):
        with pytest.raises(ClosedHandleError):
            call()
    assert not page.closed  # closing an arena never releases pages


def test_foreign_pages_are_rejected(mapped) -> None:
    backend, arena, page, spare = mapped

    other = get_backend(backend.name, page_size=2 * PS)
    big = other.create_page()
    with pytest.raises(PageMismatch):
        arena.map(0, big)
    other.release_page(big)

    host = get_backend("host")
    foreign = host.create_page() if backend.name != "host" else object()
    with pytest.raises(PageMismatch):
        arena.map(0, foreign)  # type: ignore[arg-type]
    with pytest.raises(PageMismatch):
        backend.export(foreign)  # type: ignore[arg-type]
    if backend.name != "host":
        host.release_page(foreign)  # type: ignore[arg-type]
    _unchanged(arena, page)


def test_import_of_a_bad_descriptor_leaves_it_open(backend: Backend) -> None:
    r, w = os.pipe()
    try:
        with pytest.raises(VmmError):
            backend.import_page(r)
        os.fstat(r)  # still ours, still open
    finally:
        os.close(r)
        os.close(w)


def test_tensor_layout_errors(mapped) -> None:
    backend, arena, page, spare = mapped
    with pytest.raises(TensorLayoutError):
        arena.tensor(torch.float32, (4 * PS // 4 + 1,))  # one element past the end
    with pytest.raises(TensorLayoutError):
        arena.tensor(torch.float32, (4,), offset=2)  # misaligned
    with pytest.raises(TensorLayoutError):
        arena.tensor(torch.float32, (4,), offset=-4)
    with pytest.raises(TensorLayoutError):
        arena.tensor(torch.float32, (2, 2), strides=(1,))
    _unchanged(arena, page)
