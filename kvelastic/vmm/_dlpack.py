"""Torch tensors over raw addresses through DLPack, built with ctypes.

Why not ``__cuda_array_interface__`` (what the CUDA arena used first): torch
turns that into a tensor through numpy (absent from some CUDA images) and asks
the driver which device owns the first byte (``cudaPointerGetAttributes``),
which fails when that byte lies in a reserved range whose page is not mapped
yet -- exactly how KV views are built before memory arrives. A DLPack capsule
names the device itself: torch's ``fromDLPack`` passes it to ``from_blob`` as
the target device, so no pointer is queried and numpy is never needed.

Lifetime: the capsule's ``DLManagedTensor`` carries a deleter that torch calls
when the last tensor sharing the storage dies; it drops the ``keepalive``
object (the arena's reservation), so a view that outlives its arena keeps the
addresses reserved. The same code path works for host memory (``KDL_CPU``),
which is how it is tested on machines without a GPU.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

KDL_CPU = 1
KDL_CUDA = 2
_KDL_UINT = 1


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    pass


_Deleter = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_DLManagedTensor._fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _Deleter)]

# address of a DLManagedTensor -> (the struct, its shape array, the keepalive)
_alive: dict[int, tuple[object, object, object]] = {}


def _delete(addr: int | None, _pop=_alive.pop) -> None:  # _pop: bound at definition on purpose
    # Bound through a default argument, not a module global: torch may free a
    # tensor while the interpreter tears modules down.
    try:
        _pop(addr, None)
    except Exception:  # noqa: BLE001 - an exception cannot cross back into torch's C++
        pass


_deleter = _Deleter(_delete)
_NAME = b"dltensor"
# The C thunk must outlive every tensor, including those freed during
# interpreter shutdown: one extra reference that is never dropped.
ctypes.pythonapi.Py_IncRef(ctypes.py_object(_deleter))
_capsule_new = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)(
    ("PyCapsule_New", ctypes.pythonapi))


def tensor_at(ptr: int, nbytes: int, device_type: int, device_id: int, keepalive: object) -> torch.Tensor:
    """A 1-D uint8 tensor over ``[ptr, ptr + nbytes)`` on the given DLPack device.

    No copy and no check of the memory: the caller vouches for the range (it
    may be reserved but not yet mapped). ``keepalive`` lives until the last
    tensor over this storage is gone.
    """
    import torch.utils.dlpack

    if ptr <= 0 or nbytes <= 0:
        raise ValueError(f"tensor_at needs a positive address and size, got {ptr:#x} / {nbytes}")
    shape = (ctypes.c_int64 * 1)(nbytes)
    managed = _DLManagedTensor()
    t = managed.dl_tensor
    t.data = ptr                      # torch ignores byte_offset: the full address goes here
    t.device = _DLDevice(device_type, device_id)
    t.ndim = 1
    t.dtype = _DLDataType(_KDL_UINT, 8, 1)
    t.shape = ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64))
    t.strides = None                  # contiguous
    t.byte_offset = 0
    managed.deleter = _deleter
    addr = ctypes.addressof(managed)
    _alive[addr] = (managed, shape, keepalive)
    try:
        return torch.utils.dlpack.from_dlpack(_capsule_new(addr, _NAME, None))
    except BaseException:
        _alive.pop(addr, None)
        raise


def alive() -> int:
    """How many DLPack tensors made here are still alive (for tests)."""
    return len(_alive)
