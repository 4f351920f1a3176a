"""The libc calls the host backend needs, bound once through ctypes.

``mmap`` is called directly (not via Python's ``mmap`` module) because the
backend needs raw addresses and ``MAP_FIXED`` placement inside a reservation.
Every function is bound with ``use_errno=True`` so failures carry their errno.
Constants are Linux's (identical on x86_64 and aarch64).
"""

from __future__ import annotations

import ctypes
import ctypes.util

from kvelastic.vmm.errors import BackendUnavailable, SystemCallError

PROT_NONE = 0x0
PROT_READ = 0x1
PROT_WRITE = 0x2
MAP_SHARED = 0x01
MAP_PRIVATE = 0x02
MAP_FIXED = 0x10
MAP_ANONYMOUS = 0x20
MAP_NORESERVE = 0x4000
FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02

# Flag sets used by the host backend and by the raw baseline of the benchmark.
PROT_RW = PROT_READ | PROT_WRITE
MAP_PAGE = MAP_SHARED | MAP_FIXED
MAP_RESERVE = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE
MAP_RESERVE_FIXED = MAP_RESERVE | MAP_FIXED

MAP_FAILED = ctypes.c_void_p(-1).value


def _load() -> ctypes.CDLL:
    name = ctypes.util.find_library("c") or "libc.so.6"
    try:
        return ctypes.CDLL(name, use_errno=True)
    except OSError as exc:  # pragma: no cover - every Linux has a libc
        raise BackendUnavailable(f"host backend: cannot load libc ({exc})") from exc


_lib = _load()

mmap = _lib.mmap
mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int64]
mmap.restype = ctypes.c_void_p

munmap = _lib.munmap
munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
munmap.restype = ctypes.c_int

fallocate = _lib.fallocate
fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
fallocate.restype = ctypes.c_int

get_errno = ctypes.get_errno


def failed(call: str) -> SystemCallError:
    """The typed error for the libc call that just failed (reads errno now)."""
    return SystemCallError(call, ctypes.get_errno())


def reserve(nbytes: int, align: int) -> int:
    """Reserve ``nbytes`` of inaccessible address space aligned to ``align``.

    Over-reserves by ``align`` and trims both ends, so the result is aligned
    (2 MiB alignment lets the kernel use huge page-table entries).
    """
    span = nbytes + align
    addr = mmap(None, span, PROT_NONE, MAP_RESERVE, -1, 0)
    if addr is None or addr == MAP_FAILED:
        raise failed("mmap(PROT_NONE reservation)")
    base = -(-addr // align) * align
    if base > addr:
        munmap(addr, base - addr)
    tail = addr + span - (base + nbytes)
    if tail:
        munmap(base + nbytes, tail)
    return base


def release(addr: int, nbytes: int) -> None:
    if munmap(addr, nbytes) != 0:
        raise failed("munmap")
