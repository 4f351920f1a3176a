"""Byte access to arena memory for the tests, on either backend.

Host arenas are read and written through torch views (the point of the
backend); cuda arenas through the driver's memcpy, so the GPU tests also run
with a CPU-only torch. Also: the process and system memory counters that the
tests use to show memory really comes and goes.
"""

from __future__ import annotations

import ctypes

import torch

from kvelastic.vmm.base import Arena


def write(arena: Arena, offset: int, data: bytes) -> None:
    if arena.__class__.__name__ == "CudaArena":
        from cuda.bindings import driver

        buf = ctypes.create_string_buffer(data, len(data))
        (err,) = driver.cuMemcpyHtoD(arena.base + offset, ctypes.addressof(buf), len(data))
        assert not err, err
        return
    view = arena.tensor(torch.uint8, (len(data),), offset=offset)
    view.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))


def read(arena: Arena, offset: int, nbytes: int) -> bytes:
    if arena.__class__.__name__ == "CudaArena":
        from cuda.bindings import driver

        buf = ctypes.create_string_buffer(nbytes)
        (err,) = driver.cuMemcpyDtoH(ctypes.addressof(buf), arena.base + offset, nbytes)
        assert not err, err
        return buf.raw
    return arena.tensor(torch.uint8, (nbytes,), offset=offset).numpy().tobytes()


def pattern(seed: int, nbytes: int) -> bytes:
    """Distinct, non-zero-heavy bytes per seed."""
    return bytes((seed * 31 + i * 7 + 1) & 0xFF for i in range(nbytes))


def proc_status_kib(field: str) -> int:
    """A ``/proc/self/status`` counter (VmRSS, RssShmem, VmSize) in KiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def meminfo_kib(field: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def maps_covering(start: int, end: int) -> list[tuple[int, int, str, str]]:
    """``/proc/self/maps`` entries that overlap [start, end): (lo, hi, perms, path)."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo < end and hi > start:
                out.append((lo, hi, parts[1], parts[5].strip() if len(parts) > 5 else ""))
    return out
