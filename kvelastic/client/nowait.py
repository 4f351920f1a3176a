"""Write to a socket without letting go of the GIL, when the write cannot block.

Python releases the GIL around every socket call. On the scheduler's thread
that is a hand-off: the engine's I/O thread, woken by its tick and waiting
for the GIL, takes it, and the scheduler waits for it back (a thread switch
each way). A seal writes a few kilobytes on the lifeline once per step that
dropped a key, and that hand-off, not the write, is what the step would pay
(``docs/benchmarks.md``).

``send_now`` calls libc's ``send`` through ``ctypes.PyDLL``, which keeps the
GIL, with ``MSG_DONTWAIT``: it never blocks, so holding the GIL through it is
safe. It returns how many bytes went (0 where the socket's buffer is full
or the call is unavailable); the caller writes the rest the ordinary way.
"""

from __future__ import annotations

import ctypes
import errno

MSG_DONTWAIT = 0x40
MSG_NOSIGNAL = 0x4000   # a closed peer is an EPIPE error, not a signal


def _libc_send():
    try:
        send = ctypes.PyDLL(None, use_errno=True).send
    except (OSError, AttributeError):   # no libc symbols in this process: the ordinary path only
        return None
    send.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int]
    send.restype = ctypes.c_ssize_t
    return send


_send = _libc_send()


def send_now(fd: int, data: bytes) -> int:
    """Bytes of ``data`` written to socket ``fd`` now, holding the GIL; 0 if
    none could go without blocking. Other errors raise ``OSError``, as a
    socket call would."""
    if _send is None:
        return 0
    sent = _send(fd, data, len(data), MSG_DONTWAIT | MSG_NOSIGNAL)
    if sent >= 0:
        return sent
    err = ctypes.get_errno()
    if err in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR):
        return 0
    raise OSError(err, f"send: {errno.errorcode.get(err, err)}")
