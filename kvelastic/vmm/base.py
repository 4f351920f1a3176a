"""The one interface that every virtual-memory backend implements.

A ``Backend`` creates physical *pages* (all of ``page_size`` bytes), exports them
as file descriptors and imports them in another process, zeroes them, and
reserves *arenas*: a range of virtual addresses that costs no memory until pages
are mapped into it. An arena hands out torch tensors that alias its addresses
(no copy), so a view built over a range before its pages arrive sees them once
they are mapped.

Invariants (every backend):
- Pages are mapped at offsets that are multiples of ``page_size``; each page
  slot holds at most one page, and the arena tracks them in ``_mapped``.
- The reserved range is never left with a hole: unmapping puts the range back
  to reserved-but-inaccessible, it never gives the addresses away.
- A call that raises a ``VmmError`` changed nothing (checks happen before the
  first system call; a failed system call is rolled back).
- Releasing a page that is still mapped is allowed: the memory lives on until
  the last mapping and the last descriptor are gone (CUDA and memfd agree).
- An arena is not thread-safe: one thread maps and unmaps it (workers do so at
  step boundaries, never while a step may read the range).
"""

from __future__ import annotations

import contextlib
import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from types import TracebackType
from typing import TYPE_CHECKING

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
)

if TYPE_CHECKING:  # torch is imported on first tensor(): the daemon's control path never needs it
    import torch

MiB = 1 << 20
DEFAULT_PAGE_SIZE = 2 * MiB


class Page(ABC):
    """A physical page. ``size`` is fixed at creation; ``closed`` after release."""

    __slots__ = ("size",)

    def __init__(self, size: int) -> None:
        self.size = size

    @property
    @abstractmethod
    def closed(self) -> bool: ...


class Arena(ABC):
    """A reserved virtual range of ``size`` bytes starting at address ``base``.

    Subclasses implement ``map``/``unmap`` inline (the hot path: integer checks
    and one dict operation before the system call) and fall back to
    ``_map_error``/``_unmap_error`` to build the precise error.
    """

    def __init__(self, base: int, size: int, page_size: int) -> None:
        self.base = base
        self.size = size
        self.page_size = page_size
        # Highest offset where a page still fits.
        self._last = size - page_size
        self._mapped: dict[int, Page] = {}
        self._closed = False

    # --- mapping -----------------------------------------------------------
    @abstractmethod
    def map(self, offset: int, page: Page) -> None:
        """Map ``page`` at ``base + offset``; raises MappingError/ClosedHandleError."""

    @abstractmethod
    def unmap(self, offset: int) -> Page:
        """Unmap the page at ``offset`` (back to reserved, inaccessible); returns it."""

    @abstractmethod
    def _release_range(self) -> None:
        """Give the virtual range back (called once by ``close``, pages already unmapped)."""

    def is_mapped(self, offset: int) -> bool:
        return offset in self._mapped

    def mapped(self) -> dict[int, Page]:
        """A copy of offset -> page for every mapped slot."""
        return dict(self._mapped)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Unmap every page and give the range back. Idempotent.

        Tensor views still alive keep the address range reserved (inaccessible)
        until they die, so a stale view faults instead of reading memory that
        another allocation got.
        """
        if self._closed:
            return
        for offset in sorted(self._mapped):
            self.unmap(offset)
        self._closed = True
        self._release_range()

    def __enter__(self) -> Arena:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # --- tensors -----------------------------------------------------------
    def tensor(
        self,
        dtype: torch.dtype,
        shape: Sequence[int],
        strides: Sequence[int] | None = None,
        offset: int = 0,
    ) -> torch.Tensor:
        """A tensor aliasing the arena at byte ``offset`` (strides in elements).

        The view may cover unmapped slots: reading them faults until a page is
        mapped there, which is how KV views are built before memory arrives.
        """
        import torch

        if self._closed:
            raise ClosedHandleError("tensor() on a closed arena")
        shape = tuple(int(s) for s in shape)
        if strides is None:
            strides = _contiguous_strides(shape)
        strides = tuple(int(s) for s in strides)
        itemsize = dtype.itemsize
        if len(strides) != len(shape) or any(s < 0 for s in shape) or any(s < 0 for s in strides):
            raise TensorLayoutError(f"bad shape {shape} / strides {strides}")
        if offset < 0 or offset % itemsize:
            raise TensorLayoutError(f"offset {offset} is not a non-negative multiple of {itemsize} ({dtype})")
        if math.prod(shape) == 0:
            return torch.empty(shape, dtype=dtype, device=self._device())
        nbytes = (sum((n - 1) * s for n, s in zip(shape, strides)) + 1) * itemsize
        if offset + nbytes > self.size:
            raise TensorLayoutError(
                f"a {dtype} view of shape {shape} strides {strides} at offset {offset} "
                f"needs {nbytes} bytes, past the arena's {self.size}"
            )
        raw = self._bytes(offset, nbytes)
        return raw.view(dtype).as_strided(shape, strides)

    @abstractmethod
    def _bytes(self, offset: int, nbytes: int) -> torch.Tensor:
        """A uint8 tensor over ``[base + offset, + nbytes)`` that keeps the range reserved."""

    @abstractmethod
    def _device(self) -> torch.device: ...

    # --- slow-path diagnosis -----------------------------------------------
    def _map_error(self, offset: int, page: Page, page_type: type[Page]) -> Exception:
        if self._closed:
            return ClosedHandleError("map() on a closed arena")
        if type(page) is not page_type:
            return PageMismatch(f"cannot map a {type(page).__name__} into a {type(self).__name__}")
        if page.closed:
            return ClosedHandleError("map() of a released page")
        if page.size != self.page_size:
            return PageMismatch(f"page of {page.size} bytes in an arena of {self.page_size}-byte pages")
        return self._slot_error(offset, "map", want_mapped=False)

    def _unmap_error(self, offset: int) -> Exception:
        if self._closed:
            return ClosedHandleError("unmap() on a closed arena")
        return self._slot_error(offset, "unmap", want_mapped=True)

    def _slot_error(self, offset: int, op: str, want_mapped: bool) -> Exception:
        if not isinstance(offset, int):
            return UnalignedOffset(f"{op}: offset must be an int, got {type(offset).__name__}")
        if offset % self.page_size:
            return UnalignedOffset(f"{op}: offset {offset} is not a multiple of the page size {self.page_size}")
        if not 0 <= offset <= self._last:
            return OutOfRange(f"{op}: offset {offset} is outside the arena [0, {self.size})")
        if want_mapped and offset not in self._mapped:
            return NotMapped(f"unmap: nothing is mapped at offset {offset}")
        if not want_mapped and offset in self._mapped:
            return AlreadyMapped(f"map: offset {offset} already holds a page")
        return MappingError(f"{op}: offset {offset} rejected")


class Backend(ABC):
    """Creates pages and reserves arenas on one device (host memory or one GPU)."""

    name: str = "?"
    # Whether ``export`` works on a page this process imported (not created):
    # memfds yes; the CUDA driver exports only handles created in the process.
    exports_imported: bool = True

    def __init__(self, page_size: int, granularity: int) -> None:
        if not isinstance(page_size, int) or page_size <= 0 or page_size % granularity:
            raise InvalidPageSize(
                f"page size {page_size} must be a positive multiple of the {self.name} "
                f"backend's granularity ({granularity} bytes)"
            )
        self.page_size = page_size
        self.granularity = granularity

    @abstractmethod
    def create_page(self) -> Page:
        """A new page of ``page_size`` bytes, zero-filled."""

    def create_pages(self, n: int) -> list[Page]:
        """``n`` new pages, zero-filled; all or none: on a failure the pages
        already made are released before the error is raised (a failed call
        changes nothing). The default is ``create_page`` in a loop; a backend
        whose per-page cost is mostly per-call overhead (CUDA: one scrub per
        page) batches it."""
        if not isinstance(n, int) or n < 0:
            raise OutOfRange(f"create_pages: count must be a non-negative int, got {n!r}")
        pages: list[Page] = []
        try:
            for _ in range(n):
                pages.append(self.create_page())
        except BaseException:
            for page in pages:
                # The creation error is what the caller must see; a release that
                # fails too (device lost) leaves nothing more to undo here.
                with contextlib.suppress(Exception):
                    self.release_page(page)
            raise
        return pages

    @abstractmethod
    def release_page(self, page: Page) -> None:
        """Drop this process's handle; mappings keep the memory until unmapped."""

    @abstractmethod
    def export(self, page: Page) -> int:
        """A new descriptor for ``page`` that the caller owns (send it, then close it)."""

    @abstractmethod
    def import_page(self, fd: int) -> Page:
        """A page from a descriptor sent by another process; takes ownership of ``fd``
        on success (it is closed or kept by the page), leaves it open on failure."""

    @abstractmethod
    def zero(self, page: Page) -> None:
        """Fill ``page`` with zeros (done before a page changes hands)."""

    @abstractmethod
    def reserve(self, nbytes: int) -> Arena:
        """An arena of ``nbytes`` rounded up to a whole number of pages."""

    def make_current(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Make this backend's device current for the calling thread (CUDA); a no-op elsewhere."""

    def synchronize(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Wait for work the device may still do on mapped pages (CUDA); a no-op elsewhere."""

    def close(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Release backend-wide resources (scratch mappings). Pages and arenas stay valid."""

    def _arena_size(self, nbytes: int) -> int:
        if not isinstance(nbytes, int) or nbytes <= 0:
            raise OutOfRange(f"reserve: size must be a positive int, got {nbytes!r}")
        return -(-nbytes // self.page_size) * self.page_size


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = []
    acc = 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))
