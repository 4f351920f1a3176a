"""The loop's side of the tier: the bytes the allocator's ``tiering.py`` decided
to move. Demotion reads a block's runs from memfd pages the daemon holds alone
and writes them to the ``DiskStore``; a ``TierFetch`` is answered with a chunk
of a block read (and checked) from it. The loop reads the pages itself (they
may be reused right after); the disk writes run on the store's writer
thread (``tier/writer.py``), whose results the loop takes in each pass
(``finished``) and reports to the allocator, which commits or aborts. Reads
for fetches stay in the loop (a committed block, most often in the page
cache).

Blocks of a running engine (source B) are read into ``staged`` first and
written only once the engine's journal proved they were not rewritten while
read (``WriteStaged``): torn bytes never reach the disk, where a restart
would find them. ``staged`` holds what ``tiering.py`` reserved and has not
decided yet, at most ``tiering.MAX_STAGED_BYTES``.
"""

from __future__ import annotations

import logging
import os

from kvelastic import protocol as p
from kvelastic.daemon import effects as fx
from kvelastic.daemon.devices import Device
from kvelastic.tier.disk import DiskStore
from kvelastic.tier.errors import TierReadError
from kvelastic.tier.writer import TierWriter, WriteJob

log = logging.getLogger("kvelastic.daemon")


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
    def __init__(self, devices: dict[str, Device], store: DiskStore | None) -> None:
        self.devices = devices
        self.store = store
        self._last: tuple[int, bytes] | None = None    # the block read last (slot, payload): its next chunks
        self.writer = TierWriter(store) if store is not None else None
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
                                        block.label))

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
        if self.writer is not None:
            self.writer.close()

    def read(self, effect: fx.ReadTierBlock) -> tuple[p.TierData, str, bool]:
        """The answer to a fetch, why the block failed ("" if it did not) and
        whether the block is finished with (its last chunk, or failed)."""
        try:
            if self._last is not None and self._last[0] == effect.slot:
                payload = self._last[1]
            else:
                if self.store is None:
                    raise OSError("no tier store")
                payload = self.store.read(effect.slot, effect.namespace, effect.key)
                self._last = (effect.slot, payload)
        except (TierReadError, OSError) as exc:
            reason = exc.reason if isinstance(exc, TierReadError) else "io"
            log.warning("tier: block %d of namespace %s dropped: %s", effect.slot, effect.namespace, exc)
            return p.TierData(req_id=effect.req_id, lease=effect.lease, block=effect.block, offset=effect.offset,
                              size=-1, data=b""), reason, True
        end = min(len(payload), effect.offset + effect.chunk)
        if end >= len(payload):
            self._last = None
        return p.TierData(req_id=effect.req_id, lease=effect.lease, block=effect.block, offset=effect.offset,
                          size=len(payload), data=payload[effect.offset:end]), "", end >= len(payload)
