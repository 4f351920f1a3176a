"""CUDA backend: VMM pages (cuMemCreate) mapped into cuMemAddressReserve ranges.

- A page is a ``cuMemCreate`` allocation exportable as a POSIX file descriptor,
  so the daemon can hand it to worker processes, which import it.
- An arena is a ``cuMemAddressReserve`` range: address space only.
- ``map`` is ``cuMemMap`` + ``cuMemSetAccess`` (rolled back by ``cuMemUnmap`` if
  the access call fails); ``unmap`` is ``cuMemUnmap``, which leaves the range
  reserved. Pages are pre-created, so ``cuMemCreate`` (~200 us) never sits on
  the mapping path.
- ``zero`` maps the page at a private scratch address and runs ``cuMemsetD8``
  on a private stream (it never waits on the caller's compute streams). New
  pages are zeroed too: ``cuMemCreate`` does not promise zeroed memory.
  ``create_pages(n)`` scrubs a batch at once: n handles mapped side by side in
  the scratch range, one ``cuMemSetAccess``, one memset, one stream sync (the
  per-page scrub is mostly those fixed costs, not bandwidth).
- Tensors over an arena are DLPack tensors naming the device (``_dlpack``):
  torch never asks the driver about the address, which may not be mapped yet.

Importing this module never touches the driver: ``cuda.bindings`` is loaded on
first use, and on a machine without a usable GPU constructing the backend
raises one ``BackendUnavailable`` naming the cause.

The driver binds a context per thread; the backend makes the device's primary
context current in the constructing thread, and again in any other thread
that creates, imports, exports or releases a page (a worker maps on its I/O
thread, which never called ``make_current``); ``map``/``unmap`` retry once in
the right context when the driver says the thread has none.
"""

from __future__ import annotations

import functools
import os
import threading
import weakref
from typing import TYPE_CHECKING, Any

from kvelastic.vmm._dlpack import KDL_CUDA, tensor_at
from kvelastic.vmm.base import DEFAULT_PAGE_SIZE, Arena, Backend, Page
from kvelastic.vmm.errors import BackendUnavailable, ClosedHandleError, CudaError, OutOfRange, PageMismatch

if TYPE_CHECKING:
    import torch


def _driver() -> Any:
    from cuda.bindings import driver

    return driver


# Which backend's context each thread last made current (one per device).
_tls = threading.local()


def _error_name(err: Any) -> str:
    try:
        status, name = _driver().cuGetErrorName(err)
        if not status and name:
            return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # noqa: BLE001 - fall back to the enum's own name
        pass
    return getattr(err, "name", str(err))


def check(call: str, result: tuple[Any, ...]) -> Any:
    """Unpack a cuda-python result tuple; raise CudaError (with the CUresult name) on failure."""
    err = result[0]
    if err:
        raise CudaError(call, _error_name(err))
    if len(result) == 1:
        return None
    return result[1] if len(result) == 2 else result[1:]


@functools.cache
def probe() -> tuple[bool, str]:
    """(usable, why): cuInit succeeds and at least one device is visible."""
    try:
        driver = _driver()
    except Exception as exc:  # noqa: BLE001 - ImportError or a broken install
        return False, f"cuda-python is not importable ({type(exc).__name__})"
    try:
        (err,) = driver.cuInit(0)
    except Exception as exc:  # noqa: BLE001 - libcuda.so missing raises here
        return False, f"the NVIDIA driver library (libcuda.so) cannot be loaded ({type(exc).__name__})"
    if err:
        return False, f"cuInit failed: {_error_name(err)}"
    err, count = driver.cuDeviceGetCount()
    if err or count <= 0:
        return False, "the driver sees no CUDA device"
    return True, f"{count} CUDA device(s)"


def unavailable_message(why: str) -> str:
    return (
        f"the cuda backend needs a usable CUDA GPU, and this machine has none: {why}. "
        "Use KVELASTIC_BACKEND=auto or host to serve from host memory."
    )


def format_uuid(raw: bytes) -> str:
    """16 bytes as ``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`` (nvidia-smi's form)."""
    h = raw.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


class CudaPage(Page):
    """A VMM allocation on ``device``. ``handle`` is None once released."""

    __slots__ = ("handle", "device")

    def __init__(self, handle: int, size: int, device: int) -> None:
        super().__init__(size)
        self.handle: int | None = handle
        self.device = device

    @property
    def closed(self) -> bool:
        return self.handle is None

    def __repr__(self) -> str:
        return f"CudaPage(handle={self.handle}, size={self.size}, device={self.device})"


def _free_range(ctx: Any, base: int, size: int, page_size: int, mapped: dict[int, Page]) -> None:
    # Runs when the arena and every view over it are gone, in whatever thread
    # dropped the last one: unmap what an unclosed arena left mapped, then give
    # the addresses back, in the arena's context (pushed, so the thread's own
    # current context is restored after).
    try:
        driver = _driver()
        pushed = not driver.cuCtxPushCurrent(ctx)[0]
        try:
            for offset in list(mapped):
                driver.cuMemUnmap(base + offset, page_size)
            mapped.clear()
            driver.cuMemAddressFree(base, size)
        finally:
            if pushed:
                driver.cuCtxPopCurrent()
    except Exception:  # noqa: BLE001 - interpreter shutdown: the driver frees it anyway
        pass


class _Reservation:
    """Owns the address range; frees it when the arena and all its views are gone."""

    __slots__ = ("__weakref__",)

    def __init__(self, ctx: Any, base: int, size: int, page_size: int, mapped: dict[int, Page]) -> None:
        weakref.finalize(self, _free_range, ctx, base, size, page_size, mapped)


class CudaArena(Arena):
    def __init__(self, base: int, size: int, page_size: int, backend: CudaBackend) -> None:
        super().__init__(base, size, page_size)
        driver = _driver()
        self.device = backend.device
        self._backend = backend
        self._access = backend._access
        self._cuMemMap = driver.cuMemMap
        self._cuMemSetAccess = driver.cuMemSetAccess
        self._cuMemUnmap = driver.cuMemUnmap
        self._no_context = driver.CUresult.CUDA_ERROR_INVALID_CONTEXT
        self._reservation: _Reservation | None = _Reservation(backend._ctx, base, size, page_size, self._mapped)

    def map(self, offset: int, page: Page) -> None:
        ps = self.page_size
        if (
            type(page) is not CudaPage
            or page.handle is None
            or page.size != ps
            or page.device != self.device
            or offset % ps
            or not 0 <= offset <= self._last
            or offset in self._mapped
            or self._closed
        ):
            raise self._map_error(offset, page, CudaPage)
        addr = self.base + offset
        (err,) = self._cuMemMap(addr, ps, 0, page.handle, 0)
        if err == self._no_context:  # a thread that never made the context current
            self._backend.make_current()
            (err,) = self._cuMemMap(addr, ps, 0, page.handle, 0)
        if err:
            raise CudaError("cuMemMap", _error_name(err))
        (err,) = self._cuMemSetAccess(addr, ps, self._access, 1)
        if err:
            self._cuMemUnmap(addr, ps)
            raise CudaError("cuMemSetAccess", _error_name(err))
        self._mapped[offset] = page

    def unmap(self, offset: int) -> Page:
        page = self._mapped.get(offset)
        if page is None:
            raise self._unmap_error(offset)
        (err,) = self._cuMemUnmap(self.base + offset, self.page_size)
        if err == self._no_context:
            self._backend.make_current()
            (err,) = self._cuMemUnmap(self.base + offset, self.page_size)
        if err:
            raise CudaError("cuMemUnmap", _error_name(err))
        del self._mapped[offset]
        return page

    def _map_error(self, offset: int, page: Page, page_type: type[Page]) -> Exception:
        if type(page) is CudaPage and page.device != self.device and not self._closed:
            return PageMismatch(f"page of device {page.device} in an arena of device {self.device}")
        return super()._map_error(offset, page, page_type)

    def _release_range(self) -> None:
        self._reservation = None

    def _bytes(self, offset: int, nbytes: int) -> torch.Tensor:
        import torch

        if not torch.cuda.is_available():
            raise BackendUnavailable(
                "cuda arena tensors need a CUDA build of torch (this torch has no CUDA support)"
            )
        return tensor_at(self.base + offset, nbytes, KDL_CUDA, self.device, self._reservation)

    def _device(self) -> torch.device:
        import torch

        return torch.device("cuda", self.device)


class CudaBackend(Backend):
    name = "cuda"
    exports_imported = False    # an imported handle's export is refused: keep the sender's descriptor

    def __init__(self, page_size: int = DEFAULT_PAGE_SIZE, device: int = 0) -> None:
        usable, why = probe()
        if not usable:
            raise BackendUnavailable(unavailable_message(why))
        driver = _driver()
        self._driver = driver
        self.device = device
        dev = check("cuDeviceGet", driver.cuDeviceGet(device))
        for name in ("VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED", "HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED"):
            attr = getattr(driver.CUdevice_attribute, f"CU_DEVICE_ATTRIBUTE_{name}")
            if not check("cuDeviceGetAttribute", driver.cuDeviceGetAttribute(attr, dev)):
                raise BackendUnavailable(f"CUDA device {device} lacks {name.lower()}")
        # The primary context is the one torch uses; it stays retained for the
        # life of the process (releasing it would destroy every page and arena).
        self._ctx = check("cuDevicePrimaryCtxRetain", driver.cuDevicePrimaryCtxRetain(dev))
        self.make_current()

        prop = driver.CUmemAllocationProp()
        prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device
        prop.requestedHandleTypes = driver.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        self._prop = prop
        self._fd_type = prop.requestedHandleTypes
        granularity = int(check(
            "cuMemGetAllocationGranularity",
            driver.cuMemGetAllocationGranularity(
                prop, driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM),
        ))
        super().__init__(page_size, granularity)

        access = driver.CUmemAccessDesc()
        access.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = device
        access.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._access = [access]
        self._lock = threading.Lock()  # guards the scratch range used by zero() and create_pages()
        self._scratch: int | None = None
        self._scratch_pages = 0        # the scratch range's size in pages (grown by create_pages)
        self._stream: Any = None

    def make_current(self) -> None:
        check("cuCtxSetCurrent", self._driver.cuCtxSetCurrent(self._ctx))
        _tls.backend = self

    def _current(self) -> None:
        """Make the context current unless this thread's last make_current was ours."""
        if getattr(_tls, "backend", None) is not self:
            self.make_current()

    def synchronize(self) -> None:
        self.make_current()
        check("cuCtxSynchronize", self._driver.cuCtxSynchronize())

    def device_count(self) -> int:
        return int(check("cuDeviceGetCount", self._driver.cuDeviceGetCount()))

    def uuid(self) -> str:
        """The GPU's identity as nvidia-smi prints it (``GPU-`` and 8-4-4-4-12
        hex digits): the same in every process, whatever index
        ``CUDA_VISIBLE_DEVICES`` gives the GPU there."""
        dev = check("cuDeviceGet", self._driver.cuDeviceGet(self.device))
        raw = bytes(check("cuDeviceGetUuid", self._driver.cuDeviceGetUuid(dev)).bytes)[:16]
        return format_uuid(raw)

    def total_memory(self) -> int:
        dev = check("cuDeviceGet", self._driver.cuDeviceGet(self.device))
        return int(check("cuDeviceTotalMem", self._driver.cuDeviceTotalMem(dev)))

    def create_page(self) -> CudaPage:
        self._current()
        handle = check("cuMemCreate", self._driver.cuMemCreate(self.page_size, self._prop, 0))
        page = CudaPage(int(handle), self.page_size, self.device)
        # cuMemCreate does not promise zeroed memory (within one process the
        # driver may hand back what an earlier page held); the interface does.
        try:
            self.zero(page)
        except BaseException:
            self._driver.cuMemRelease(page.handle)
            raise
        return page

    def create_pages(self, n: int) -> list[Page]:
        """``n`` zeroed pages with one scrub for all of them; all or none (a
        failure releases every handle made here, then raises)."""
        if not isinstance(n, int) or n < 0:
            raise OutOfRange(f"create_pages: count must be a non-negative int, got {n!r}")
        if n <= 1:
            return [self.create_page() for _ in range(n)]
        self._current()
        d = self._driver
        handles: list[int] = []
        try:
            for _ in range(n):
                handles.append(int(check("cuMemCreate", d.cuMemCreate(self.page_size, self._prop, 0))))
            self._scrub(handles)
        except BaseException:
            for handle in handles:
                d.cuMemRelease(handle)
            raise
        return [CudaPage(handle, self.page_size, self.device) for handle in handles]

    def release_page(self, page: Page) -> None:
        handle = self._handle(page, "release_page")
        self._current()
        check("cuMemRelease", self._driver.cuMemRelease(handle))
        page.handle = None  # type: ignore[attr-defined]

    def export(self, page: Page) -> int:
        handle = self._handle(page, "export")
        self._current()
        fd = check("cuMemExportToShareableHandle",
                   self._driver.cuMemExportToShareableHandle(handle, self._fd_type, 0))
        return int(fd)

    def import_page(self, fd: int) -> CudaPage:
        self._current()  # the worker's I/O thread imports and maps: bind the context there
        handle = check("cuMemImportFromShareableHandle",
                       self._driver.cuMemImportFromShareableHandle(fd, self._fd_type))
        # The imported handle holds its own reference; an open fd would pin the
        # memory after cuMemRelease.
        os.close(fd)
        return CudaPage(int(handle), self.page_size, self.device)

    def zero(self, page: Page) -> None:
        self._scrub([self._handle(page, "zero")])

    def _scrub(self, handles: list[int]) -> None:
        """Zero these allocations: mapped side by side at the scratch range,
        one access call and one memset over all of them, one sync; every
        mapping made here is undone before returning, error or not (the
        scratch range is back to reserved-only, the handles untouched)."""
        d = self._driver
        ps = self.page_size
        n = len(handles)
        with self._lock:
            self.make_current()
            if self._stream is None:
                self._stream = check("cuStreamCreate",
                                     d.cuStreamCreate(d.CUstream_flags.CU_STREAM_NON_BLOCKING.value))
            va = self._scratch
            if va is None or self._scratch_pages < n:   # (re)reserve: address space only, kept for the next call
                if va is not None:
                    d.cuMemAddressFree(va, self._scratch_pages * ps)
                    self._scratch, self._scratch_pages = None, 0
                va = int(check("cuMemAddressReserve", d.cuMemAddressReserve(n * ps, ps, 0, 0)))
                self._scratch, self._scratch_pages = va, n
            mapped = 0
            try:
                for i, handle in enumerate(handles):
                    check("cuMemMap", d.cuMemMap(va + i * ps, ps, 0, handle, 0))
                    mapped += 1
                check("cuMemSetAccess", d.cuMemSetAccess(va, n * ps, self._access, 1))
                check("cuMemsetD8Async", d.cuMemsetD8Async(va, 0, n * ps, self._stream))
                check("cuStreamSynchronize", d.cuStreamSynchronize(self._stream))
            finally:
                for i in range(mapped):
                    d.cuMemUnmap(va + i * ps, ps)

    def reserve(self, nbytes: int) -> CudaArena:
        size = self._arena_size(nbytes)
        self.make_current()
        base = check("cuMemAddressReserve",
                     self._driver.cuMemAddressReserve(size, self.page_size, 0, 0))
        return CudaArena(int(base), size, self.page_size, self)

    def close(self) -> None:
        with self._lock:
            if self._scratch is not None:
                self._driver.cuMemAddressFree(self._scratch, self._scratch_pages * self.page_size)
                self._scratch, self._scratch_pages = None, 0
            if self._stream is not None:
                self._driver.cuStreamDestroy(self._stream)
                self._stream = None

    def _handle(self, page: Page, op: str) -> int:
        if type(page) is not CudaPage or page.device != self.device:
            raise PageMismatch(f"{op}: expected a CudaPage of device {self.device}, got {page!r}")
        if page.handle is None:
            raise ClosedHandleError(f"{op}: the page was released")
        return page.handle
