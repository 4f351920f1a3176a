"""Typed errors of the virtual-memory backends and the page-descriptor channel.

Same contract as ``kvelastic.errors``: each class has a short ``reason`` (a
metric label) and raising one promises that the failed call changed nothing
(no mapping added or removed, no page created or released, no descriptor
leaked).
"""

from __future__ import annotations

import errno as _errno
import os

from kvelastic.errors import KvelasticError


class VmmError(KvelasticError):
    reason = "vmm"


class InvalidPageSize(VmmError, ValueError):
    """The page size is not a positive multiple of the backend's granularity."""

    reason = "invalid_page_size"


# --- arena mapping ---------------------------------------------------------
class MappingError(VmmError):
    """A map/unmap request that does not fit the arena's state."""

    reason = "mapping"


class UnalignedOffset(MappingError):
    reason = "unaligned_offset"


class OutOfRange(MappingError):
    reason = "out_of_range"


class AlreadyMapped(MappingError):
    reason = "already_mapped"


class NotMapped(MappingError):
    reason = "not_mapped"


class PageMismatch(MappingError):
    """A page of another backend, device or size than the arena's."""

    reason = "page_mismatch"


class TensorLayoutError(VmmError, ValueError):
    """A tensor view that would reach outside the arena or is misaligned."""

    reason = "tensor_layout"


class ClosedHandleError(VmmError):
    """Use of a released page or a closed arena."""

    reason = "closed_handle"


# --- platform --------------------------------------------------------------
class BackendUnavailable(VmmError):
    reason = "backend_unavailable"


class SystemCallError(VmmError, OSError):
    """A libc call failed; carries the errno name (``ENOMEM``) for operators."""

    reason = "syscall"

    def __init__(self, call: str, err: int) -> None:
        self.call = call
        self.errno_name = _errno.errorcode.get(err, str(err))
        OSError.__init__(self, err, f"{call} failed: {self.errno_name} ({os.strerror(err)})")

    def __str__(self) -> str:
        return self.strerror or ""


class CudaError(VmmError):
    """A CUDA driver call failed; ``name`` is the CUresult name (cuGetErrorName)."""

    reason = "cuda"

    def __init__(self, call: str, name: str) -> None:
        super().__init__(f"{call} failed: {name}")
        self.call = call
        self.name = name


# --- page-descriptor channel -----------------------------------------------
class FdChannelError(VmmError):
    reason = "fd_channel"


class PeerClosed(FdChannelError):
    reason = "peer_closed"
