"""The tier's disk in the simulator (``tier.py``): the store, and its writer
as the daemon has it (``kvelastic/tier/writer.py``, fed by ``tier_io.py``
and polled by the loop's ``Daemon._tier_writes``).

The store is a dict, slot -> ``Stored``: the block's namespace, key and
*content* (the KV objects the simulated device held in the block's places
when the loop read its runs), so that a promoted block can be told apart
from any other write of the same key.

The loop reads a block's bytes itself and hands the write over (``submit``:
a ``DemoteBlocks`` of kept cache or of a slab reclaimed, or a staged copy
that a ``WriteStaged`` writes), then goes on. The writer writes the jobs in
order (``run``: a seeded number each step, none while the disk stalls); a
job written is stored at once (its file is on the disk) and reported only
when the loop's next pass takes it (``poll``): the allocator commits or
aborts it then. A write fails as a disk does: it finds the disk full
(``disk_full``: the slot is aborted), or the block it wrote is torn (found at
read: ``TierData`` size -1, the slot dropped).

``delete`` is ``TierWriter.delete``: a job not started yet is cancelled
(never written; reported as written with nothing stored, as the real
writer reports it, so that its dead entry is freed), and a file written is
removed, reported or not. The daemon stops as ``World.restart_daemon``
says: a graceful stop writes every job still queued and not cancelled
(``TierWriter.close``) and reports none of what it wrote; a kill -9 loses
the queue (the thread may have written a job or two more first) and keeps
every file written. The next daemon rebuilds its index from what is on the
disk (``SimStore``, which answers ``rebuild``'s ``scan``).

The next daemon restores nothing of a namespace invalidated since it was
read, by an invalidation the daemon answered (``check_restored``: final,
its files went before its answer). Invariants of the writer (``check``):
every write in flight is of a pending entry, a cancelled one of a dead
entry; every pending entry is in someone's hands (the writer's or the
staging's), or its budget would be held for ever; a delete cancels or
removes no write of a live entry.

The writer draws on a ``random.Random`` of its own (``SimTier`` seeds it):
neither the world's stream nor the tier's moves with its pace.
"""

from __future__ import annotations

import collections
import dataclasses
import random
from collections.abc import Collection
from typing import Any, Protocol

from kvelastic.daemon import effects as fx
from kvelastic.daemon.allocator import Allocator
from kvelastic.tier.index import TierIndex
from kvelastic.tier.store import ScanResult, StoredBlock
from kvelastic_tools.sim.records import KV

# Per block written: the disk is full (aborted); the bytes are torn (dropped when read).
DISK_FULL, TORN = 0.05, 0.05
# Each step, the writer thread: stalls (a slow disk: nothing written for a
# while, seconds of STALL_SECONDS), writes all it holds, else up to
# SOME_WRITES jobs (none, sometimes). The loop's pass takes what was written
# with REPORT a step: a file may be on the disk, its write not reported yet.
STALL, STALL_SECONDS = 0.01, (0.1, 1.5)
ALL_WRITES, SOME_WRITES = 0.35, 2
REPORT = 0.7
KILLED_WRITING = 2      # at a kill -9, up to this many more jobs were written first


class WriterWorld(Protocol):
    """What the writer uses of the world (``tier.TierWorld`` and ``World`` fit it)."""

    @property
    def now(self) -> float: ...

    @property
    def counts(self) -> collections.Counter[str]: ...

    @property
    def allocator(self) -> Allocator: ...

    @property
    def stopped(self) -> bool: ...

    def call(self, fn: Any, *args: Any) -> list[fx.Effect]: ...

    def perform(self, effects: list[fx.Effect]) -> None: ...

    def violation(self, what: str) -> None: ...


@dataclasses.dataclass(eq=False)
class Stored:
    """A block in the store: what the daemon wrote at its slot."""

    namespace: str
    key: bytes
    parent: bytes | None
    cost: float
    nbytes: int
    content: tuple[KV | None, ...]     # the device's KV in the block's places when it was read
    epoch: int                         # its namespace's invalidations before it was read
    torn: bool = False
    evicted: bool = False              # a running engine's block (source B)


@dataclasses.dataclass(eq=False)
class WriteJob:
    """One block handed to the writer (``tier.writer.WriteJob``)."""

    slot: int
    block: Stored                      # what its file holds once written
    staged: bool                       # a staged copy (source B), else source A
    cancelled: bool = False            # deleted before its write started: nothing written
    reason: str = ""                   # once written: "" or why it failed


class SimStore:
    """What ``rebuild`` asks of a ``TierStore``: its blocks, and deleting one."""

    def __init__(self, blocks: dict[int, Stored]) -> None:
        self.blocks = blocks

    def scan(self, *, verify_payloads: bool = False) -> ScanResult:
        return ScanResult([StoredBlock(slot, b.namespace, b.key, b.parent, b.nbytes, b.cost)
                           for slot, b in sorted(self.blocks.items())])

    def delete(self, slot: int) -> None:
        self.blocks.pop(slot, None)


class SimWriter:
    """The writer thread and the loop's side of it (module docstring)."""

    def __init__(self, store: dict[int, Stored], rng: random.Random, world: WriterWorld) -> None:
        self.store = store
        self.rng = rng
        self.world = world
        self.queued: collections.OrderedDict[int, WriteJob] = collections.OrderedDict()   # FIFO, by slot
        self.cancelled: set[int] = set()           # queued slots deleted since (``TierWriter._cancelled``)
        self.done: list[WriteJob] = []             # written (or cancelled, or failed), not reported yet
        self.stalled_until = 0.0
        self.stopped_by = "its start"              # how the last daemon stopped (for what its successor finds)

    def in_flight(self) -> list[WriteJob]:
        """Every job handed over and not reported yet: queued, then written."""
        return [*self.queued.values(), *self.done]

    def slots(self) -> set[int]:
        return {*self.queued, *(job.slot for job in self.done)}

    # ------------------------------------------------------------ the loop
    def submit(self, job: WriteJob) -> None:
        self.queued[job.slot] = job

    def delete(self, slot: int, index: TierIndex) -> None:
        """``TierWriter.delete``: the slot's file goes now, and a write of it
        not started yet never happens (either must be a dead entry's)."""
        found = ""
        if slot in self.queued and slot not in self.cancelled:
            self.cancelled.add(slot)
            found = "tier_write_cancelled_queued"
        elif slot in self.store and any(job.slot == slot for job in self.done):
            found = "tier_written_deleted_unreported"
        self.store.pop(slot, None)
        if found:
            self.world.counts[found] += 1
            entry = index._entries.get(slot)
            if entry is None or not entry.dead:
                self.world.violation(f"tier: the write of slot {slot} deleted ({found}), its entry "
                                     f"{'gone' if entry is None else 'live'}")

    def pump(self, index: TierIndex) -> None:
        """The thread's progress this step, and the loop's pass that takes
        what it wrote (``Daemon._tier_writes``): committed or aborted."""
        w = self.world
        if w.stopped or w.allocator.books.tier is not index:
            return
        self.run(w.now)
        taken = self.poll()
        if not taken:
            return
        for job in taken:
            if not job.reason:
                w.counts["tier_write_cancelled" if job.cancelled else
                         "tier_staged_written" if job.staged else "tier_demoted"] += 1
        before = index.stats.demotions_reclaimed
        effects = w.call(w.allocator.tier_written, [job.slot for job in taken if not job.reason],
                         [(job.slot, job.reason) for job in taken if job.reason], w.now)
        w.counts["tier_demoted_reclaimed"] += index.stats.demotions_reclaimed - before   # of those
        w.perform(effects)

    def poll(self) -> list[WriteJob]:
        """What the loop's pass takes (``TierWriter.finished``): every write
        done, when a pass came since (else nothing, this step)."""
        if not self.done or self.rng.random() >= REPORT:
            return []
        done, self.done = self.done, []
        return done

    # ------------------------------------------------------------ the thread
    def run(self, now: float) -> None:
        """The thread's progress during a step."""
        if not self.queued or now < self.stalled_until:
            return
        r = self.rng.random()
        if r < STALL:
            self.stalled_until = now + self.rng.uniform(*STALL_SECONDS)
            self.world.counts["tier_disk_stalled"] += 1
            return
        n = len(self.queued) if r < STALL + ALL_WRITES else self.rng.randint(0, SOME_WRITES)
        for _ in range(min(n, len(self.queued))):
            self._write()

    def _write(self) -> None:
        """The next job queued: written (its file stored), failed, or cancelled."""
        _slot, job = self.queued.popitem(last=False)
        if job.slot in self.cancelled:
            self.cancelled.discard(job.slot)
            job.cancelled = True
        elif self.rng.random() < DISK_FULL:
            job.reason = "disk_full"
            self.world.counts["tier_disk_full"] += 1
        else:
            job.block.torn = self.rng.random() < TORN
            self.store[job.slot] = job.block
        self.done.append(job)

    # ------------------------------------------------------------ stops
    def stop(self, graceful: bool, invalidated: collections.Counter[str]) -> None:
        """The daemon stops (``World.restart_daemon``): gracefully, every job
        queued and not cancelled is written (``TierIO.close``); killed, what
        was not written is lost. Nothing is reported either way."""
        flight = self.in_flight()
        self.stopped_by = f"a {'graceful stop' if graceful else 'kill -9'} with {len(flight)} write(s) in flight"
        if flight:
            kind = "stop" if graceful else "crash"
            self.world.counts[f"tier_{kind}_with_writes_queued"] += 1
            if any(job.block.epoch != invalidated[job.block.namespace] for job in flight):
                self.world.counts[f"tier_{kind}_with_invalidated_writes"] += 1
        if graceful:
            self.close()
        else:
            self.kill()

    def close(self) -> None:
        """A graceful stop (``TierWriter.close``): every job still queued is
        written, a cancelled one excepted; nothing is reported any more."""
        counts = self.world.counts
        counts["tier_unreported_at_stop"] += len(self.done)
        while self.queued:
            counts["tier_written_at_stop"] += self.queued[next(iter(self.queued))].slot not in self.cancelled
            self._write()
        self._reset()

    def kill(self) -> None:
        """kill -9: the thread may have written a job or two more; the rest
        of the queue is lost, every file written stays."""
        counts = self.world.counts
        for _ in range(self.rng.randint(0, min(KILLED_WRITING, len(self.queued)))):
            counts["tier_written_at_kill"] += self.queued[next(iter(self.queued))].slot not in self.cancelled
            self._write()
        counts["tier_unreported_at_kill"] += len(self.done)
        counts["tier_lost_at_kill"] += len(self.queued)
        self._reset()

    def _reset(self) -> None:
        """The next daemon's writer: nothing queued, nothing to report."""
        self.queued.clear()
        self.cancelled.clear()
        self.done.clear()
        self.stalled_until = 0.0

    # ------------------------------------------------------------ checks
    def check(self, index: TierIndex, elsewhere: Collection[int]) -> None:
        """Every write in flight is of a pending entry (a cancelled one of a
        dead one); every pending entry is the writer's or ``elsewhere``
        (the staging's)."""
        w = self.world
        for job in self.in_flight():
            entry = index._entries.get(job.slot)
            if entry is None or entry.committed:
                state = "freed" if entry is None else "committed"
                w.violation(f"tier: slot {job.slot} being written, its entry {state}")
            elif (job.cancelled or job.slot in self.cancelled) and not entry.dead:
                w.violation(f"tier: the write of slot {job.slot} cancelled, its entry live")
        pending = {slot for slot, entry in index._entries.items() if not entry.committed}
        lost = pending - self.slots() - set(elsewhere)
        if lost:
            w.violation(f"tier: pending slots {sorted(lost)} are in no one's hands (never written, never aborted)")


def check_restored(w: WriterWorld, store: dict[int, Stored], invalidated: collections.Counter[str],
                   final: collections.Counter[str], stopped_by: str) -> set[int]:
    """What a new daemon restored (``store``, after ``rebuild``) holds nothing
    of a namespace invalidated since it was read, by an invalidation the
    daemon answered (``final``: its files went before its answer); the slots
    that do (violations). One it was killed before answering may have left
    files: restored, they are current again (the operator heard no answer)."""
    back: set[int] = set()
    for slot, b in sorted(store.items()):
        if b.epoch == invalidated[b.namespace]:
            continue
        if b.epoch < final[b.namespace]:
            w.counts["tier_invalidated_restored"] += 1
            back.add(slot)
            w.violation(f"tier: block {b.key!r} of {b.namespace} (slot {slot}) of an invalidated scope restored "
                        f"by a new daemon after {stopped_by} (read before invalidation {b.epoch + 1}, answered)")
        else:
            w.counts["tier_unanswered_invalidation_restored"] += 1
            b.epoch = invalidated[b.namespace]
    return back
