"""The loop's side of the tier: the bytes the allocator's ``tiering.py`` decided
to move. Demotion reads a block's runs from memfd pages the daemon holds alone
and writes them to the tier's store (a ``TierStore``); a ``TierFetch`` is answered with a chunk
of a block read (and checked) from it. The loop reads the pages itself (they
may be reused right after); the disk writes run on the store's writer
thread (``tier/writer.py``), whose results the loop takes in each pass
(``finished``) and reports to the allocator, which commits or aborts.

Reads for fetches run on the store's reader threads (``tier/reader.py``),
never in the loop: a block's size is the engine's choice (up to
``MAX_BLOCK_BYTES``), and a tenant fetching large blocks from many
connections would otherwise hold the loop that seals every other tenant's
steps. The loop hands each fetch over with its tenant (the engine's uid) and
engine (``read``: refused, ``busy``, past the tenant's share of the reader),
takes the answers in each pass (``reads``: at most ``READS_PER_PASS``) and
sends them, a block invalidated or dropped while it was read answered as
not served.

Blocks of a running engine (source B) are read into ``staged`` first and
written only once the engine's journal proved they were not rewritten while
read (``WriteStaged``): torn bytes never reach the disk, where a restart
would find them. ``staged`` holds what ``tiering.py`` reserved and has not
decided yet, at most ``tiering.MAX_STAGED_BYTES``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable

from kvelastic import protocol as p
from kvelastic.daemon import effects as fx
from kvelastic.daemon.devices import Device
from kvelastic.status_report import TierReads
from kvelastic.tier.reader import REFUSALS, ReadJob, TierReader
from kvelastic.tier.store import TierStore
from kvelastic.tier.writer import MoveJob, TierWriter, WriteJob

log = logging.getLogger("kvelastic.daemon")

# Answers the loop sends in one pass; more wait for the next pass (the
# reader's descriptor stays readable), so a burst of answers never holds a
# pass much longer than reading its frames does.
READS_PER_PASS = 64
# (the fetch, its answer, why its block failed or "", whether the block is done with)
Answer = tuple[fx.ReadTierBlock, p.TierData, str, bool]


def read_runs(devices: dict[str, Device], runs: tuple[tuple[str, int, int, int], ...]) -> bytes:
    """A block's bytes: its runs (device, page id, offset, length) read in order
    from the pages' memfds (host backend). Raises ``OSError`` when one is gone."""
    parts = []
    for device, page_id, offset, length in runs:
        page = devices[device].pages.get(page_id)
        fd = getattr(page, "fd", -1)
        if page is None or fd < 0:
            raise OSError(f"page {page_id} of device {device} has no descriptor here")
        data = os.pread(fd, length, offset)
        if len(data) != length:
            raise OSError(f"page {page_id}: read {len(data)} of {length} bytes at {offset}")
        parts.append(data)
    return b"".join(parts)


class TierIO:
    def __init__(self, devices: dict[str, Device], store: TierStore | None) -> None:
        self.devices = devices
        self.store = store
        self.writer = TierWriter(store) if store is not None else None
        self.reader: TierReader[fx.ReadTierBlock] | None = TierReader(store) if store is not None else None
        self.refused = dict.fromkeys(REFUSALS, 0)      # fetches refused, by reason
        self._refused_tenants: set[int] = set()        # logged once each
        # Source B's copies awaiting the engine's word: slot -> (namespace, block, payload).
        self.staged: dict[int, tuple[str, fx.DemoteBlock, bytes]] = {}

    def demote(self, effect: fx.DemoteBlocks) -> tuple[list[int], list[tuple[int, str]]]:
        """Read each block and hand it to the writer (or stage it:
        ``effect.staged``); (slots staged, [(failed slot, reason)]). The
        writes' results come later (``finished``)."""
        done: list[int] = []
        failed: list[tuple[int, str]] = []
        for block in effect.blocks:
            try:
                payload = read_runs(self.devices, block.runs)
            except OSError as exc:
                log.warning("tier: block %d of namespace %s not demoted: %s", block.slot, effect.namespace, exc)
                failed.append((block.slot, "io"))
                continue
            if effect.staged:
                self.staged[block.slot] = (effect.namespace, block, payload)
                done.append(block.slot)
            else:
                self._write(effect.namespace, block, payload, failed)
        return done, failed

    def write_staged(self, effect: fx.WriteStaged) -> tuple[list[int], list[tuple[int, str]]]:
        """Hand the staged copies found whole to the writer, drop the others;
        (slots cancelled, [(failed slot, reason)]). A copy no longer staged
        was deleted (``delete``: its entry died, invalidated): it is never
        written, and reported done at once so that its entry is freed."""
        for slot in effect.drop:
            self.staged.pop(slot, None)
        cancelled: list[int] = []
        failed: list[tuple[int, str]] = []
        for slot in effect.write:
            staged = self.staged.pop(slot, None)
            if staged is None:
                cancelled.append(slot)
            else:
                self._write(*staged, failed)
        return cancelled, failed

    def _write(self, namespace: str, block: fx.DemoteBlock, payload: bytes, failed: list[tuple[int, str]]) -> None:
        if self.writer is None:
            failed.append((block.slot, "io"))
        else:
            self.writer.submit(WriteJob(block.slot, namespace, block.key, block.parent, block.cost, payload,
                                        block.label, block.level))

    def move(self, effect: fx.MoveTierBlocks) -> list[tuple[int, str]]:
        """Hand the moves down to the writer (after the writes queued before
        them); [(failed slot, reason)] at once when there is no writer."""
        if self.writer is None:
            return [(slot, "io") for slot in effect.slots]
        for slot, nbytes in zip(effect.slots, effect.nbytes, strict=True):
            self.writer.submit(MoveJob(slot, nbytes))
        return []

    def delete(self, slots: tuple[int, ...]) -> None:
        """Delete these slots' files now: a staged copy or a queued write of
        one never reaches the disk, a write running now is waited for and its
        file removed (``TierWriter.delete``)."""
        for slot in slots:
            self.staged.pop(slot, None)
        if self.writer is not None:
            for slot in slots:
                self.writer.delete(slot)

    def finished(self) -> tuple[list[int], list[tuple[int, str]]]:
        """The writes done since the last call (``TierWriter.finished``)."""
        if self.writer is None:
            return [], []
        written, failed = self.writer.finished()
        if written:
            log.info("tier: %d block(s) demoted", len(written))
        return written, failed

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
        if self.writer is not None:
            self.writer.close()

    # ------------------------------------------------------------ fetches
    def read(self, effect: fx.ReadTierBlock, tenant: int, engine: str, nbytes: int) -> str:
        """Hand a fetch of ``engine`` (of uid ``tenant``) of a block of
        ``nbytes`` to the reader: "" when queued (its answer comes from
        ``reads``), else why it is refused (counted; nothing queued)."""
        if self.reader is None:
            return "no_store"
        refused = self.reader.submit(ReadJob(effect.slot, effect.namespace, effect.key, nbytes, effect.offset,
                                             effect.chunk, tenant, engine, effect))
        if refused:
            self.refused[refused] = self.refused.get(refused, 0) + 1
            if tenant not in self._refused_tenants:
                if len(self._refused_tenants) > 4096:
                    self._refused_tenants.clear()
                self._refused_tenants.add(tenant)
                log.warning("tier: fetches of uid %d refused: its share of the reader is taken (%s)", tenant, refused)
        return refused

    def reads(self, servable: Callable[[int], bool]) -> list[Answer]:
        """The fetches read since the last call (at most ``READS_PER_PASS``).
        A block not ``servable`` any more (invalidated or dropped while it was
        read) is answered as not served, its bytes never sent."""
        if self.reader is None:
            return []
        out: list[Answer] = []
        for done in self.reader.finished(READS_PER_PASS):
            fetch = done.ticket
            size, data, error, finished = done.size, done.data, done.error, done.finished
            if not servable(fetch.slot):
                size, data, error, finished = -1, b"", "gone", True
            out.append((fetch, p.TierData(req_id=fetch.req_id, lease=fetch.lease, block=fetch.block,
                                          offset=fetch.offset, size=size, data=data), error, finished))
        return out

    def forget(self, slots: Iterable[int]) -> None:
        """These slots' files were deleted: the reader lets go of them."""
        if self.reader is not None:
            self.reader.forget(slots)

    def report(self) -> TierReads:
        queued, held = self.reader.report() if self.reader is not None else (0, 0)
        return TierReads(queued=queued, bytes=held, refused={k: n for k, n in self.refused.items() if n})
