"""Names for kvelastic's threads as the kernel shows them (``top -H``,
``/proc/PID/task/*/comm``), so an operator, or a profile, can tell the
client's I/O thread from vLLM's own inside an engine's process. Linux only;
a no-op elsewhere or if the call fails. The kernel keeps 15 bytes."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from typing import Any

_PR_SET_NAME = 15


def _prctl() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _prctl()


def name_this_thread(name: str) -> None:
    """Give the calling thread ``name`` (cut to 15 bytes) in the kernel's tables."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
