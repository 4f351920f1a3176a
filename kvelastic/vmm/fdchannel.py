"""Page hand-off between processes: page descriptors over AF_UNIX (SCM_RIGHTS).

ZMQ cannot carry file descriptors, so pages travel on this channel. One
``send`` carries a batch of ``(page_id, fd)`` pairs and, optionally, an opaque
*command* (the message that names the pages: the receiver acts on one read,
with no second message to wait for on another socket). The batch is cut into
frames of at most ``MAX_FDS`` descriptors (the kernel's SCM_MAX_FD)::

    frame  := header body             (descriptors ride with the header's first byte)
    header := <u16 magic, u16 count, u32 frames_that_follow, u32 command_bytes>
    body   := count x <u64 page_id>   (same order as the descriptors)
              command                 (the last frame's only; at most MAX_COMMAND bytes)

Invariants:
- The receiver reads exactly one frame's bytes at a time, so the descriptors
  of the next frame are never consumed early (the stream is SOCK_STREAM: reads
  may be partial and are completed in a loop).
- Received descriptors are close-on-exec (MSG_CMSG_CLOEXEC) and owned by the
  caller of ``recv``; if ``recv`` raises, every descriptor it received so far
  is closed, so a failed hand-off leaks nothing. ``send`` never closes the
  caller's descriptors.
- After any error the stream may be out of step: close the channel.
"""

from __future__ import annotations

import array
import os
import socket
import struct
from collections.abc import Sequence
from types import TracebackType

from kvelastic.vmm.errors import FdChannelError, PeerClosed

MAX_FDS = 253  # SCM_MAX_FD: the kernel refuses more descriptors per message
MAX_COMMAND = 1 << 20
_MAGIC = 0x4B56
_HEADER = struct.Struct("<HHII")
_ID = struct.Struct("<Q")
_FD_SIZE = array.array("i").itemsize
_ANCILLARY = socket.CMSG_SPACE(MAX_FDS * _FD_SIZE)


def send_pages(sock: socket.socket, items: Sequence[tuple[int, int]], command: bytes = b"") -> None:
    """Send ``(page_id, fd)`` pairs as one batch (several frames past MAX_FDS),
    ``command`` with its last frame."""
    items = list(items)
    for page_id, fd in items:
        if not (isinstance(page_id, int) and 0 <= page_id < 1 << 64 and isinstance(fd, int) and fd >= 0):
            raise FdChannelError(f"bad (page_id, fd) pair {(page_id, fd)!r}")
    if len(command) > MAX_COMMAND:
        raise FdChannelError(f"a command of {len(command)} bytes (at most {MAX_COMMAND})")
    chunks = [items[i : i + MAX_FDS] for i in range(0, len(items), MAX_FDS)] or [[]]
    for k, chunk in enumerate(chunks):
        more = len(chunks) - 1 - k
        extra = b"" if more else command
        frame = _HEADER.pack(_MAGIC, len(chunk), more, len(extra))
        frame += b"".join(_ID.pack(page_id) for page_id, _ in chunk) + extra
        _send_frame(sock, frame, [fd for _, fd in chunk])


def recv_batch(sock: socket.socket) -> tuple[list[tuple[int, int]], bytes]:
    """Receive one batch sent by ``send_pages``: its pairs (the caller owns the
    fds) and its command (empty if none)."""
    received: list[int] = []  # every fd that arrived, for cleanup on failure
    pairs: list[tuple[int, int]] = []
    try:
        while True:
            first = len(received)
            magic, count, more, command_bytes = _HEADER.unpack(_recv_exact(sock, _HEADER.size, received))
            if magic != _MAGIC:
                raise FdChannelError(f"bad frame (magic {magic:#x}): the stream is out of step")
            if command_bytes > MAX_COMMAND or (command_bytes and more):
                raise FdChannelError(f"bad frame (a command of {command_bytes} bytes, {more} frames to follow)")
            body = _recv_exact(sock, count * _ID.size + command_bytes, received)
            fds = received[first:]
            if len(fds) != count:
                raise FdChannelError(f"a frame announced {count} descriptors but carried {len(fds)}")
            pairs.extend(zip((i for (i,) in _ID.iter_unpack(body[:count * _ID.size])), fds))
            if more == 0:
                return pairs, body[count * _ID.size:]
    except BaseException:
        for fd in received:
            os.close(fd)
        raise


def recv_pages(sock: socket.socket) -> list[tuple[int, int]]:
    """Receive one batch sent by ``send_pages`` without a command; the caller owns the fds."""
    pairs, command = recv_batch(sock)
    if command:
        for _, fd in pairs:
            os.close(fd)
        raise FdChannelError(f"a batch came with a command of {len(command)} bytes where none was expected")
    return pairs


def _send_frame(sock: socket.socket, frame: bytes, fds: list[int]) -> None:
    try:
        sent = socket.send_fds(sock, [frame], fds) if fds else sock.send(frame)
        if sent < len(frame):  # a partial send: the fds already went with the first byte
            sock.sendall(frame[sent:])
    except (BrokenPipeError, ConnectionResetError) as exc:
        raise PeerClosed("the peer closed the page channel") from exc
    except OSError as exc:
        raise FdChannelError(f"sending page descriptors failed: {exc}") from exc


def _recv_exact(sock: socket.socket, nbytes: int, received: list[int]) -> bytes:
    buf = bytearray()
    while len(buf) < nbytes:
        try:
            data, ancillary, flags, _ = sock.recvmsg(nbytes - len(buf), _ANCILLARY, socket.MSG_CMSG_CLOEXEC)
        except ConnectionResetError as exc:
            raise PeerClosed("the peer reset the page channel") from exc
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds = array.array("i")
                fds.frombytes(payload[: len(payload) - len(payload) % _FD_SIZE])
                received.extend(fds)
        if flags & socket.MSG_CTRUNC:
            raise FdChannelError("page descriptors were truncated (the receiver is out of file descriptors?)")
        if not data:
            where = "mid-frame" if buf or received else "before a batch"
            raise PeerClosed(f"the peer closed the page channel {where}")
        buf += data
    return bytes(buf)


class FdChannel:
    """One end of a page channel (a connected AF_UNIX stream socket)."""

    def __init__(self, sock: socket.socket) -> None:
        if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM:
            raise FdChannelError("a page channel needs an AF_UNIX SOCK_STREAM socket")
        self.sock = sock

    @classmethod
    def pair(cls) -> tuple[FdChannel, FdChannel]:
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        return cls(a), cls(b)

    @classmethod
    def connect(cls, path: str) -> FdChannel:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
        except OSError as exc:
            sock.close()
            raise FdChannelError(f"cannot connect to the page channel at {path}: {exc}") from exc
        return cls(sock)

    @classmethod
    def accept(cls, listener: socket.socket) -> FdChannel:
        sock, _ = listener.accept()
        return cls(sock)

    def send(self, items: Sequence[tuple[int, int]], command: bytes = b"") -> None:
        send_pages(self.sock, items, command)

    def recv(self) -> list[tuple[int, int]]:
        return recv_pages(self.sock)

    def recv_batch(self) -> tuple[list[tuple[int, int]], bytes]:
        return recv_batch(self.sock)

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> FdChannel:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def listen(path: str, backlog: int = 16) -> socket.socket:
    """A listening AF_UNIX socket at ``path`` for ``FdChannel.accept``."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock
