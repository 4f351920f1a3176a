"""The daemon's state file (warm restarts): its books written so that a new daemon
can take back what the old one held, and never trust what it cannot prove.

What it holds is the caller's (a msgspec payload); this module makes its
writes atomic and its reads checked::

    magic "KVST" | version u16 | reserved u16 | payload length u64
    | payload CRC-32 u32 | boot id (36 bytes, the kernel's) | header CRC-32 u32
    | payload

- **Atomic**: written to ``.<name>.tmp``, flushed to disk, renamed over the
  file, and the directory flushed: a crash leaves the old file or the new
  one, never a mix.
- **Checked**: a file cut short or too long (``StateTorn``), a flipped bit in
  header or payload (``StateChecksum``), another format (``StateVersion``),
  or one written before the node last booted (``StateStale``: the pages it
  names died with that boot), or one another user could have written
  (``StateUntrusted``) raises, and nothing of it may be used. Each
  error's ``reason`` is the label it is counted under.
"""

from __future__ import annotations

import os
import stat
import struct
import zlib
from pathlib import Path

from kvelastic.errors import KvelasticError

MAGIC = b"KVST"
VERSION = 1
_HEADER = struct.Struct("<4sHHQI36s")
_CRC = struct.Struct("<I")
BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"


class StateFileError(KvelasticError):
    reason = "state"


class StateMissing(StateFileError):
    reason = "missing"


class StateTorn(StateFileError):
    reason = "torn"


class StateChecksum(StateFileError):
    reason = "checksum"


class StateVersion(StateFileError):
    reason = "version"


class StateStale(StateFileError):
    reason = "stale"


class StateUntrusted(StateFileError):
    reason = "untrusted"


def boot_id() -> str:
    """This boot of the node (the kernel's random id, 36 characters)."""
    with open(BOOT_ID_PATH) as f:
        return f.read().strip()


def write_state(path: str | os.PathLike[str], payload: bytes, *, boot: str) -> None:
    """Replace the state file at ``path`` with ``payload``, atomically and durably."""
    final = Path(path)
    boot_bytes = boot.encode()
    if len(boot_bytes) != 36:
        raise ValueError(f"a boot id has 36 characters, got {boot!r}")
    head = _HEADER.pack(MAGIC, VERSION, 0, len(payload), zlib.crc32(payload), boot_bytes)
    temp = final.with_name(f".{final.name}.tmp")
    temp.unlink(missing_ok=True)     # a killed writer's: made anew, so its mode is ours
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        view = memoryview(head + _CRC.pack(zlib.crc32(head)) + payload)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        temp.unlink(missing_ok=True)
        raise
    os.close(fd)
    os.replace(temp, final)
    folder = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def read_state(path: str | os.PathLike[str], *, boot: str) -> bytes:
    """The payload of the state file at ``path``, checked (module docstring)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise StateMissing(f"no state file at {path}") from None
    # It names which pages hold which namespace's KV: one that someone else
    # could have written (a link, another owner, writable or readable by
    # others) could relabel one tenant's cache as another's.
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise StateUntrusted(f"state file {path} is not a file of this user with mode 0600: not read")
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise StateMissing(f"no state file at {path}") from None
    size = _HEADER.size + _CRC.size
    if len(data) < size:
        raise StateTorn(f"state file {path}: header cut short ({len(data)} bytes)")
    magic, version, _, length, payload_crc, boot_bytes = _HEADER.unpack_from(data)
    (header_crc,) = _CRC.unpack_from(data, _HEADER.size)
    if magic != MAGIC:
        raise StateChecksum(f"state file {path}: not a kvelastic state file")
    if zlib.crc32(data[:_HEADER.size]) != header_crc:
        raise StateChecksum(f"state file {path}: header checksum mismatch")
    if version != VERSION:
        raise StateVersion(f"state file {path}: format version {version}, this daemon reads {VERSION}")
    if len(data) != size + length:
        raise StateTorn(f"state file {path}: {len(data) - size} payload bytes, the header says {length}")
    payload = data[size:]
    if zlib.crc32(payload) != payload_crc:
        raise StateChecksum(f"state file {path}: payload checksum mismatch")
    if boot_bytes.decode(errors="replace") != boot:
        raise StateStale(f"state file {path}: written before the node last booted (its pages are gone)")
    return payload
