"""HostStore: the tier's bytes in host memory the daemon owns (docs/tier.md).

On a GPU node host memory is the tier users want: a promotion from it is a
copy at memory speed, not a read from disk. One store for the node, as the
disk's is: every engine's demoted blocks share ``KVELASTIC_TIER_HOST_SIZE``
(the index's budget), whoever demoted them.

Each block lives in its own ``memfd`` (named ``kvelastic-tier``, so the
daemon's ``/proc/PID/smaps`` shows where its memory is), written with
``write`` and then mapped read-only, its descriptor closed: the mapping keeps
the pages, and thousands of blocks cost no descriptors (libc's ``mmap``,
through ``vmm/_libc.py``: Python's ``mmap`` module keeps a duplicate of the
descriptor per mapping). Why ``write`` and
not a store through a writable mapping: a memfd's pages come from shmem, and
a store to a page the kernel cannot supply raises SIGBUS, which would kill
the daemon; ``write`` returns ENOMEM or ENOSPC instead, which become
``TierMemoryFull`` and leave nothing of the block. Deleting a block unmaps
it, and its memory goes back to the kernel at once.

**What it trusts.** The bytes never leave the daemon's address space (no
file, no path, no descriptor kept), so only the daemon could have written
them: ``keyed`` is true without tags, and a read checks only that the slot
holds the block asked for (``IdentityMismatch``). The memory is the
daemon's, charged to its cgroup, and goes with it: a restarted daemon finds
none of it (``scan`` is empty), the index starts empty, and nothing stale is
ever served.

Thread safety: the writer thread writes, reader threads read and the loop
deletes at once; a lock guards the slot table, never held across a copy. A
read that races a delete either copies the bytes whole (the mapping is
closed only once no read holds it) or finds the slot gone.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import os
import threading

import kvelastic.vmm._libc as _libc
from kvelastic.tier.errors import IdentityMismatch, TierMemoryFull, TierReadError, TierWriteError
from kvelastic.tier.store import ScanResult, StoredBlock

_NO_ROOM = (errno.ENOMEM, errno.ENOSPC, errno.EFBIG)


@dataclasses.dataclass
class _Block:
    head: StoredBlock
    addr: int                   # the block's memory, mapped read-only (head.nbytes long)
    readers: int = 0            # reads copying from ``addr`` now
    deleted: bool = False       # unmapped by the last reader out


class HostStore:
    def __init__(self) -> None:
        self._mu = threading.Lock()
        self._blocks: dict[int, _Block] = {}
        self._closed = False
        self.bytes_held = 0     # payload bytes in memory now (the index holds the budget)

    @property
    def keyed(self) -> bool:
        return True             # the daemon's own memory: nobody else wrote it (module docstring)

    # ------------------------------------------------------------ write
    def write(self, slot: int, namespace: str, key: bytes, payload: bytes | bytearray | memoryview, *,
              cost: float, parent: bytes | None = None, label: bytes = b"", level: int = 0) -> None:
        """Copy a block into memory of its own, whole, or raise
        ``TierMemoryFull`` / ``TierWriteError`` and keep nothing of it."""
        if not 0 <= slot < 1 << 64 or level:
            raise ValueError(f"slot out of range, or a level below a store of one medium: {slot}, {level}")
        view = memoryview(payload).cast("B")
        if not view.nbytes:
            raise ValueError(f"tier block {slot}: an empty payload")
        head = StoredBlock(slot, namespace, bytes(key), None if parent is None else bytes(parent), view.nbytes,
                           cost, bytes(label))
        addr = self._copy_in(slot, view)
        with self._mu:
            if self._closed:
                _libc.munmap(addr, view.nbytes)
                raise TierWriteError(f"tier block {slot}: the store is closed")
            old = self._blocks.pop(slot, None)
            self._blocks[slot] = _Block(head, addr)
            self.bytes_held += head.nbytes
            if old is not None:
                self._retire(old)

    @staticmethod
    def _copy_in(slot: int, view: memoryview) -> int:
        """The block copied into a memfd of its own, mapped read-only: its address."""
        try:
            fd = os.memfd_create("kvelastic-tier", os.MFD_CLOEXEC)
        except OSError as exc:
            raise _write_error(slot, exc) from exc
        try:
            done = 0
            while done < view.nbytes:
                done += os.write(fd, view[done:])
            addr = _libc.mmap(None, view.nbytes, _libc.PROT_READ, _libc.MAP_SHARED, fd, 0)
            if addr is None or addr == _libc.MAP_FAILED:
                code = _libc.get_errno()
                raise OSError(code, os.strerror(code))
            return int(addr)
        except OSError as exc:
            raise _write_error(slot, exc) from exc
        finally:
            os.close(fd)

    def move(self, slot: int) -> None:
        raise TierWriteError(f"tier block {slot}: one medium, nothing below it to move to")

    def delete(self, slot: int) -> None:
        """Let a block's memory go (absent already: nothing to do)."""
        with self._mu:
            block = self._blocks.pop(slot, None)
            if block is not None:
                self._retire(block)

    def _retire(self, block: _Block) -> None:
        """Under the lock: the block leaves the table; its pages go now, or
        when the last read copying from them ends."""
        self.bytes_held -= block.head.nbytes
        block.deleted = True
        if not block.readers:
            _libc.munmap(block.addr, block.head.nbytes)

    # ------------------------------------------------------------- read
    def read(self, slot: int, namespace: str | None = None, key: bytes | None = None) -> bytes:
        """The block's payload: raises ``IdentityMismatch`` (another block
        than the one of ``namespace`` and ``key``, where given) or
        ``TierReadError`` (no block in that slot)."""
        with self._mu:
            block = self._blocks.get(slot)
            if block is None:
                raise TierReadError(f"tier block {slot}: not in host memory")
            if (namespace is not None and block.head.namespace != namespace) or \
                    (key is not None and block.head.key != key):
                raise IdentityMismatch(f"tier block {slot} holds another block than the one asked for")
            block.readers += 1
        try:
            return ctypes.string_at(block.addr, block.head.nbytes)
        finally:
            with self._mu:
                block.readers -= 1
                if block.deleted and not block.readers:
                    _libc.munmap(block.addr, block.head.nbytes)

    def header(self, slot: int) -> StoredBlock:
        with self._mu:
            block = self._blocks.get(slot)
            if block is None:
                raise TierReadError(f"tier block {slot}: not in host memory")
            return block.head

    def scan(self, *, verify_payloads: bool = False) -> ScanResult:
        """What the store holds, in slot order: after a daemon's start, nothing
        (its memory went with the daemon before it)."""
        with self._mu:
            return ScanResult(sorted((b.head for b in self._blocks.values()), key=lambda h: h.slot))

    def close(self) -> None:
        """Let every block's memory go; every write after fails."""
        with self._mu:
            self._closed = True
            for block in self._blocks.values():
                self._retire(block)
            self._blocks.clear()


def _write_error(slot: int, exc: OSError) -> TierWriteError:
    kind = TierMemoryFull if exc.errno in _NO_ROOM else TierWriteError
    return kind(f"tier block {slot}: {exc.strerror or exc}")
