"""Host-memory backend: memfd pages mapped into PROT_NONE reservations.

- A page is a ``memfd`` of ``page_size`` bytes. Its memory is allocated on
  first touch and goes back to the kernel when the last mapping and the last
  descriptor are gone; ``zero`` punches a hole, which frees it at once.
- An arena is an anonymous ``PROT_NONE`` / ``MAP_NORESERVE`` mapping: address
  space only, no memory and no commit charge.
- ``map`` is ``mmap(MAP_FIXED | MAP_SHARED)`` of the page over its slot and
  ``unmap`` is ``mmap(MAP_FIXED, PROT_NONE)`` anonymous over it: both replace
  the slot atomically, so the range never has a hole another mmap could take.

Each mapped page is one kernel VMA; ``vm.max_map_count`` (65530 by default)
caps a process at about 128 GiB of 2 MiB pages mapped at once.
"""

from __future__ import annotations

import ctypes
import mmap as _pymmap
import os
import stat
import weakref
from typing import TYPE_CHECKING

from kvelastic.vmm import _libc
from kvelastic.vmm.base import DEFAULT_PAGE_SIZE, Arena, Backend, Page
from kvelastic.vmm.errors import BackendUnavailable, ClosedHandleError, PageMismatch, SystemCallError

if TYPE_CHECKING:
    import torch

_mmap = _libc.mmap
_PROT_RW = _libc.PROT_RW
_PROT_NONE = _libc.PROT_NONE
_MAP_PAGE = _libc.MAP_PAGE
_MAP_RESERVE_FIXED = _libc.MAP_RESERVE_FIXED


class HostPage(Page):
    """A memfd page. ``fd`` is -1 once released."""

    __slots__ = ("fd",)

    def __init__(self, fd: int, size: int) -> None:
        super().__init__(size)
        self.fd = fd

    @property
    def closed(self) -> bool:
        return self.fd < 0

    def __repr__(self) -> str:
        return f"HostPage(fd={self.fd}, size={self.size})"


class _Reservation:
    """Owns the reserved address range; munmaps it when the last owner dies.

    Owners are the arena (until ``close``) and every tensor view over it, so a
    view that outlives its arena points at inaccessible, still-reserved memory.
    """

    __slots__ = ("__weakref__",)

    def __init__(self, base: int, size: int) -> None:
        weakref.finalize(self, _libc.munmap, base, size)


class HostArena(Arena):
    def __init__(self, base: int, size: int, page_size: int) -> None:
        super().__init__(base, size, page_size)
        self._reservation: _Reservation | None = _Reservation(base, size)

    def map(self, offset: int, page: Page) -> None:
        ps = self.page_size
        if (
            type(page) is not HostPage
            or page.fd < 0
            or page.size != ps
            or offset % ps
            or not 0 <= offset <= self._last
            or offset in self._mapped
            or self._closed
        ):
            raise self._map_error(offset, page, HostPage)
        addr = self.base + offset
        if _mmap(addr, ps, _PROT_RW, _MAP_PAGE, page.fd, 0) != addr:
            err = _libc.failed("mmap(MAP_FIXED|MAP_SHARED page)")
            # A failed MAP_FIXED may already have dropped the old slot: put the
            # reservation back so the range never has a hole.
            _mmap(addr, ps, _PROT_NONE, _MAP_RESERVE_FIXED, -1, 0)
            raise err
        self._mapped[offset] = page

    def unmap(self, offset: int) -> Page:
        page = self._mapped.get(offset)
        if page is None:
            raise self._unmap_error(offset)
        addr = self.base + offset
        if _mmap(addr, self.page_size, _PROT_NONE, _MAP_RESERVE_FIXED, -1, 0) != addr:
            raise _libc.failed("mmap(MAP_FIXED PROT_NONE re-reserve)")
        del self._mapped[offset]
        return page

    def _release_range(self) -> None:
        self._reservation = None

    def _bytes(self, offset: int, nbytes: int) -> torch.Tensor:
        import torch

        buf = (ctypes.c_uint8 * nbytes).from_address(self.base + offset)
        # The view keeps the range reserved. A ctypes instance takes new
        # attributes, which its stub does not declare.
        buf._kvelastic_reservation = self._reservation  # type: ignore[attr-defined]
        return torch.frombuffer(buf, dtype=torch.uint8)

    def _device(self) -> torch.device:
        import torch

        return torch.device("cpu")


class HostBackend(Backend):
    name = "host"

    def __init__(self, page_size: int = DEFAULT_PAGE_SIZE) -> None:
        if not hasattr(os, "memfd_create"):
            raise BackendUnavailable("host backend needs Linux memfd_create (not available on this platform)")
        super().__init__(page_size, _pymmap.PAGESIZE)

    def create_page(self) -> HostPage:
        try:
            fd = os.memfd_create("kvelastic-page", os.MFD_CLOEXEC)
        except OSError as exc:
            raise SystemCallError("memfd_create", exc.errno or 0) from exc
        try:
            os.ftruncate(fd, self.page_size)
        except OSError as exc:
            os.close(fd)
            raise SystemCallError("ftruncate", exc.errno or 0) from exc
        return HostPage(fd, self.page_size)

    def create_pages(self, n: int) -> list[Page]:
        # Nothing to batch: a new memfd reads zero by construction (ftruncate
        # extends an empty file with holes; memory arrives zeroed on first
        # touch), so there is no scrub to share, and memfd_create + ftruncate
        # has no batched form. The base loop (with its rollback) is the whole job.
        return super().create_pages(n)

    def release_page(self, page: Page) -> None:
        fd = self._fd(page, "release_page")
        page.fd = -1  # type: ignore[attr-defined]
        os.close(fd)

    def export(self, page: Page) -> int:
        fd = self._fd(page, "export")
        try:
            return os.dup(fd)
        except OSError as exc:
            raise SystemCallError("dup", exc.errno or 0) from exc

    def import_page(self, fd: int) -> HostPage:
        try:
            st = os.fstat(fd)
        except OSError as exc:
            raise SystemCallError("fstat", exc.errno or 0) from exc
        if not stat.S_ISREG(st.st_mode) or st.st_size != self.page_size:
            raise PageMismatch(
                f"descriptor {fd} is not a {self.page_size}-byte page (size {st.st_size})"
            )
        return HostPage(fd, self.page_size)

    def zero(self, page: Page) -> None:
        fd = self._fd(page, "zero")
        flags = _libc.FALLOC_FL_PUNCH_HOLE | _libc.FALLOC_FL_KEEP_SIZE
        if _libc.fallocate(fd, flags, 0, page.size) != 0:
            raise _libc.failed("fallocate(PUNCH_HOLE)")

    def reserve(self, nbytes: int) -> HostArena:
        size = self._arena_size(nbytes)
        return HostArena(_libc.reserve(size, self.page_size), size, self.page_size)

    @staticmethod
    def _fd(page: Page, op: str) -> int:
        if type(page) is not HostPage:
            raise PageMismatch(f"{op}: expected a HostPage, got {type(page).__name__}")
        if page.fd < 0:
            raise ClosedHandleError(f"{op}: the page was released")
        return page.fd
