"""HostStore: the tier's bytes in host memory the daemon owns (docs/tier.md).

On a GPU node host memory is the tier users want: a promotion from it is a
copy at memory speed, not a read from disk. One store for the node, as the
disk's is: every engine's demoted blocks share ``KVELASTIC_TIER_HOST_SIZE``
(the index's budget), whoever demoted them.

**One memfd per block size** (an *arena*, named ``kvelastic-tier-<bytes>``
in the daemon's ``/proc/PID/fd``), each block at an offset that is a
multiple of its size. Blocks of one model are all of one size, so a node's
arenas are few: a tier of a million blocks costs a handful of descriptors
and no mappings (a mapping per block would run into ``vm.max_map_count``,
65,530 by default, long before a large tier is full). A block is written
with ``pwrite`` and read with ``pread``: a short node answers ENOMEM or
ENOSPC, counted ``memory_full`` with nothing kept, where a store through a
mapping would raise SIGBUS and kill the daemon; and a read copies without
holding the GIL. Deleting a block punches its hole (``FALLOC_FL_PUNCH_HOLE``):
its memory goes back to the kernel at once, and its offset is reused.

**What it trusts.** The bytes never leave the daemon (its descriptors are
its own, close-on-exec), so only the daemon could have written them:
``keyed`` is true without tags, and a read checks only that the slot holds
the block asked for (``IdentityMismatch``). The memory is charged to the
daemon's cgroup and goes with it: a restarted daemon finds none of it
(``scan`` is empty), the index starts empty, nothing stale is ever served.

Thread safety: the writer thread writes, reader threads read and the loop
deletes at once; a lock guards the tables, never held across a copy. A
block's offset is given back only once no read copies from it, so a read
that races a delete copies the block whole or finds it gone, never another
block's bytes.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import threading

import kvelastic.vmm._libc as _libc
from kvelastic.tier.errors import IdentityMismatch, TierMemoryFull, TierReadError, TierWriteError
from kvelastic.tier.store import ScanResult, StoredBlock

_NO_ROOM = (errno.ENOMEM, errno.ENOSPC, errno.EFBIG)
_PUNCH = _libc.FALLOC_FL_PUNCH_HOLE | _libc.FALLOC_FL_KEEP_SIZE


class _Arena:
    """One memfd holding the blocks of one size, each at an offset of its own."""

    def __init__(self, nbytes: int) -> None:
        self.fd = os.memfd_create(f"kvelastic-tier-{nbytes}", os.MFD_CLOEXEC)
        self.nbytes = nbytes
        self.end = 0                  # offsets below it were handed out once
        self.spare: list[int] = []    # offsets given back, their holes punched

    def take(self) -> int:
        if self.spare:
            return self.spare.pop()
        self.end += self.nbytes
        return self.end - self.nbytes

    def give(self, offset: int) -> None:
        """The block's memory back to the kernel; its offset for the next block."""
        if _libc.fallocate(self.fd, _PUNCH, offset, self.nbytes) != 0:
            # Never seen on shmem (it punches since Linux 3.5): the offset is
            # dropped rather than reused over bytes that may still be there.
            return
        self.spare.append(offset)

    def resident(self) -> int:
        return os.fstat(self.fd).st_blocks * 512


@dataclasses.dataclass
class _Block:
    head: StoredBlock
    arena: _Arena
    offset: int
    readers: int = 0            # reads copying from it now
    deleted: bool = False       # its offset is given back by the last reader out


class HostStore:
    def __init__(self) -> None:
        self._mu = threading.Lock()
        self._blocks: dict[int, _Block] = {}
        self._arenas: dict[int, _Arena] = {}     # block size -> its arena
        self._closed = False
        self.bytes_held = 0     # payload bytes in memory now (the index holds the budget)

    @property
    def keyed(self) -> bool:
        return True             # the daemon's own memory: nobody else wrote it (module docstring)

    def resident_bytes(self) -> int:
        """Memory the arenas hold now, as the kernel counts it (their pages)."""
        with self._mu:
            return sum(a.resident() for a in self._arenas.values())

    # ------------------------------------------------------------ write
    def write(self, slot: int, namespace: str, key: bytes, payload: bytes | bytearray | memoryview, *,
              cost: float, parent: bytes | None = None, label: bytes = b"", level: int = 0) -> None:
        """Copy a block into the arena of its size, whole, or raise
        ``TierMemoryFull`` / ``TierWriteError`` and keep nothing of it."""
        if not 0 <= slot < 1 << 64 or level:
            raise ValueError(f"slot out of range, or a level below a store of one medium: {slot}, {level}")
        view = memoryview(payload).cast("B")
        if not view.nbytes:
            raise ValueError(f"tier block {slot}: an empty payload")
        head = StoredBlock(slot, namespace, bytes(key), None if parent is None else bytes(parent), view.nbytes,
                           cost, bytes(label))
        with self._mu:
            if self._closed:
                raise TierWriteError(f"tier block {slot}: the store is closed")
            try:
                arena = self._arenas.get(view.nbytes) or self._arenas.setdefault(view.nbytes, _Arena(view.nbytes))
            except OSError as exc:
                raise _write_error(slot, exc) from exc
            offset = arena.take()
        try:
            done = 0
            while done < view.nbytes:
                done += os.pwrite(arena.fd, view[done:], offset + done)
        except OSError as exc:
            with self._mu:
                arena.give(offset)
            raise _write_error(slot, exc) from exc
        with self._mu:
            old = self._blocks.pop(slot, None)
            self._blocks[slot] = _Block(head, arena, offset)
            self.bytes_held += head.nbytes
            if old is not None:
                self._retire(old)

    def move(self, slot: int) -> None:
        raise TierWriteError(f"tier block {slot}: one medium, nothing below it to move to")

    def delete(self, slot: int) -> None:
        """Let a block's memory go (absent already: nothing to do)."""
        with self._mu:
            block = self._blocks.pop(slot, None)
            if block is not None:
                self._retire(block)

    def _retire(self, block: _Block) -> None:
        """Under the lock: the block leaves the table; its memory goes now, or
        when the last read copying from it ends."""
        self.bytes_held -= block.head.nbytes
        block.deleted = True
        if not block.readers:
            block.arena.give(block.offset)

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
            data = os.pread(block.arena.fd, block.head.nbytes, block.offset)
        except OSError as exc:
            raise TierReadError(f"tier block {slot}: {exc.strerror or exc}") from exc
        finally:
            with self._mu:
                block.readers -= 1
                if block.deleted and not block.readers:
                    block.arena.give(block.offset)
        if len(data) != block.head.nbytes:
            raise TierReadError(f"tier block {slot}: read {len(data)} of {block.head.nbytes} bytes")
        return data

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
            self._blocks.clear()
            self.bytes_held = 0
            for arena in self._arenas.values():
                os.close(arena.fd)
            self._arenas.clear()


def _write_error(slot: int, exc: OSError) -> TierWriteError:
    kind = TierMemoryFull if exc.errno in _NO_ROOM else TierWriteError
    return kind(f"tier block {slot}: {exc.strerror or exc}")
