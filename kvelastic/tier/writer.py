"""The tier's disk writes off the daemon's loop: one thread writes the
blocks the loop hands it, in order, and reports each slot back (written,
or the failure's reason) for the loop to commit or abort. The loop reads a
block's bytes from its pages itself (they may be reused right after); only
the disk waits here, so a large demotion never holds a grant or a message.

Deletes stay in the loop (an invalidated block's file must be gone before
the loop goes on, or a restart would find it). A delete of a slot still
queued or being written cancels its write: ``_lock`` spans one block's
write and the loop's delete, so either the write ended (and the delete
removes its file) or it never starts. Nothing is left behind either way.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import threading
from dataclasses import dataclass

from kvelastic.threadname import name_this_thread
from kvelastic.tier.errors import TierWriteError
from kvelastic.tier.store import TierStore

log = logging.getLogger("kvelastic.daemon")


@dataclass(frozen=True)
class WriteJob:
    slot: int
    namespace: str
    key: bytes
    parent: bytes | None
    cost: float
    payload: bytes
    label: bytes = b""
    level: int = 0          # the medium (0: the top)

    @property
    def nbytes(self) -> int:
        return len(self.payload)


@dataclass(frozen=True)
class MoveJob:
    """A block's bytes moved one medium down (``TierStore.move``): host memory to disk."""
    slot: int
    nbytes: int


class TierWriter:
    def __init__(self, store: TierStore) -> None:
        self.store = store
        self._jobs: queue.SimpleQueue[WriteJob | MoveJob | None] = queue.SimpleQueue()
        self._done: collections.deque[tuple[int, str]] = collections.deque()   # (slot, "" or reason)
        self._lock = threading.Lock()
        # Under ``_lock``: slots handed over whose write has not started, and
        # those of them deleted since (their write never happens).
        self._waiting: set[int] = set()
        self._cancelled: set[int] = set()
        self.queued: set[int] = set()           # the loop's: slots handed over, not reported back yet
        self.queued_bytes = 0
        # The loop polls this descriptor: a byte on it says a write finished.
        self.wake_fd, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._thread = threading.Thread(target=self._run, name="kvelastic-tier-writer", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ the loop
    def submit(self, job: WriteJob | MoveJob) -> None:
        self.queued.add(job.slot)
        self.queued_bytes += job.nbytes
        with self._lock:
            self._waiting.add(job.slot)
        self._jobs.put(job)

    def delete(self, slot: int) -> None:
        """Delete a slot's file now; a write of it not yet done never happens."""
        with self._lock:
            if slot in self._waiting:
                self._cancelled.add(slot)
            self.store.delete(slot)

    def finished(self) -> tuple[list[int], list[tuple[int, str]]]:
        """The writes done since the last call: (slots written or cancelled,
        [(slot, reason)])."""
        try:
            while os.read(self.wake_fd, 4096):
                pass
        except BlockingIOError:
            pass
        written: list[int] = []
        failed: list[tuple[int, str]] = []
        while self._done:
            slot, reason = self._done.popleft()
            self.queued.discard(slot)
            if reason:
                failed.append((slot, reason))
            else:
                written.append(slot)
        return written, failed

    def close(self, timeout: float = 30.0) -> None:
        """Write what is queued, then stop. A slot deleted while queued (its
        entry invalidated) is not written: nothing dead reaches the disk."""
        self._jobs.put(None)
        self._thread.join(timeout)
        os.close(self._wake_w)
        os.close(self.wake_fd)

    # ------------------------------------------------------------- the thread
    def _run(self) -> None:
        name_this_thread("kv-tier-write")
        while (job := self._jobs.get()) is not None:
            reason = ""
            with self._lock:
                self._waiting.discard(job.slot)
                if job.slot in self._cancelled:
                    # Deleted while queued: its entry was invalidated (dead: the
                    # commit the loop makes of it frees it) and its file is gone.
                    self._cancelled.discard(job.slot)
                else:
                    reason = self._do(job)
            self.queued_bytes -= job.nbytes
            self._done.append((job.slot, reason))
            try:
                os.write(self._wake_w, b"\0")
            except BlockingIOError:
                pass     # the pipe is full: the loop wakes anyway

    def _do(self, job: WriteJob | MoveJob) -> str:
        """Run one job: "" when done, else the failure's reason (logged)."""
        what = "moved down" if isinstance(job, MoveJob) else f"of namespace {job.namespace} demoted"
        try:
            if isinstance(job, MoveJob):
                self.store.move(job.slot)
            else:
                self.store.write(job.slot, job.namespace, job.key, job.payload, cost=job.cost, parent=job.parent,
                                 label=job.label, level=job.level)
        except TierWriteError as exc:
            log.warning("tier: block %d not %s: %s", job.slot, what, exc)
            return exc.reason
        except OSError as exc:
            log.warning("tier: block %d not %s: %s", job.slot, what, exc)
            return "io"
        return ""
