"""The loop's side of the tier: the bytes the allocator's ``tiering.py`` decided
to move. Demotion reads a block's runs from memfd pages the daemon holds alone
and writes them to the ``DiskStore``; a ``TierFetch`` is answered with a chunk
of a block read (and checked) from it. Synchronous in this slice: a block of
a small model is tens of KiB; an off-loop writer thread is what remains.

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
from kvelastic.tier.errors import TierReadError, TierWriteError

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
        # Source B's copies awaiting the engine's word: slot -> (namespace, block, payload).
        self.staged: dict[int, tuple[str, fx.DemoteBlock, bytes]] = {}

    def demote(self, effect: fx.DemoteBlocks) -> tuple[list[int], list[tuple[int, str]]]:
        """Write each block (or stage it: ``effect.staged``); (slots written or
        staged, [(failed slot, reason)])."""
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
            elif self._write(effect.namespace, block, payload, failed):
                done.append(block.slot)
        if done and not effect.staged:
            log.info("tier: %d block(s) of namespace %s demoted", len(done), effect.namespace)
        return done, failed

    def write_staged(self, effect: fx.WriteStaged) -> tuple[list[int], list[tuple[int, str]]]:
        """Write the staged copies found whole, drop the others; (slots
        written, [(failed slot, reason)])."""
        for slot in effect.drop:
            self.staged.pop(slot, None)
        done: list[int] = []
        failed: list[tuple[int, str]] = []
        for slot in effect.write:
            staged = self.staged.pop(slot, None)
            if staged is None:
                failed.append((slot, "io"))
            elif self._write(*staged, failed):
                done.append(slot)
        return done, failed

    def _write(self, namespace: str, block: fx.DemoteBlock, payload: bytes, failed: list[tuple[int, str]]) -> bool:
        if self.store is None:
            failed.append((block.slot, "io"))
            return False
        try:
            self.store.write(block.slot, namespace, block.key, payload, cost=block.cost, parent=block.parent)
        except TierWriteError as exc:
            log.warning("tier: block %d of namespace %s not demoted: %s", block.slot, namespace, exc)
            failed.append((block.slot, exc.reason))
        except OSError as exc:
            log.warning("tier: block %d of namespace %s not demoted: %s", block.slot, namespace, exc)
            failed.append((block.slot, "io"))
        else:
            return True
        return False

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
