"""Demotion source B: blocks a running engine is about to evict, copied into
the node's tier while still cached (docs/tier.md, "Source B"). No I/O: it
emits ``fx.DemoteBlocks(staged=True)`` and ``fx.WriteStaged``, and the loop
(``tier_io.py``) moves the bytes.

Under pressure an engine's journal marks the next blocks its LRU will evict
``DEMOTE`` (``core/handon.py``). A marked block of a finished step is cached:
its bytes are final until the engine evicts and reuses it, which it may do
at any moment with no word to the daemon first. So the loop copies the
marked blocks into its staging at once, and then tells the engine
``TierCopied(ticket)``. The engine's next journal carries the ticket back
(``Journal.tier_ack``), taken after it heard it. Every drop of a block's key
(``REMOVE``, ``CLEAR``, its slab removed) that the engine made before the copy
ended was made before it heard the ticket, so it is in that journal or an
earlier one, and a block is rewritten only after its key was dropped. Hence
the rule, applied when the ack comes:

- a copy whose block the engine dropped after the daemon asked for it, up
  to the acknowledging journal, may be torn: it is discarded (``raced``);
- every other copy of that ticket or an earlier one is whole: written to the
  tier and committed.

A journal the daemon refused, the engine's departure, a resend of its whole
index (which begins with ``CLEAR``) and ``COPY_TIMEOUT`` without an ack
discard what is pending (``unconfirmed``). Torn bytes never reach the disk
(a restart would find them there). Staging holds at most
``MAX_STAGED_BYTES`` (an engine at most ``MAX_STAGED_PER_ENGINE``); blocks
past it go uncopied, as do those of a private engine, of a step not
finished, or already in the tier.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import cast

from kvelastic import protocol as p
from kvelastic.daemon import effects as fx
from kvelastic.daemon.books import Books
from kvelastic.daemon.state import EngineRecord, Phase, shape_of
from kvelastic.daemon.tiering import Tiering

MAX_STAGED_BYTES = 64 << 20    # copies awaiting their engine's word, all engines together
# And of one engine: one that never acknowledges holds no more than this of
# the staging (for ``COPY_TIMEOUT`` at a time), never all of it.
MAX_STAGED_PER_ENGINE = 16 << 20
COPY_TIMEOUT = 10.0            # seconds a copy waits for its ticket's ack


@dataclasses.dataclass
class Copy:
    serial: int          # the engine's registration
    block: int           # its block id there
    ticket: int
    nbytes: int
    deadline: float
    raced: bool = False  # its key was dropped after the daemon asked: maybe torn


class Staging:
    """Copies of running engines' demoted blocks, until their engines confirm them."""

    def __init__(self, books: Books, tiering: Tiering) -> None:
        self.books = books
        self.tiering = tiering
        self.copies: dict[int, Copy] = {}                 # slot -> its copy
        self._by_engine: dict[int, dict[int, int]] = {}   # serial -> block -> slot
        self.staged_bytes = 0
        self._next_ticket = 1

    # ------------------------------------------------------------ journal
    def journal(self, engine: EngineRecord, m: p.Journal) -> None:
        """``m`` was applied to ``engine``'s mirror: note its drops, settle
        what its ack confirms, and copy the blocks it demoted."""
        mine = self._by_engine.get(engine.serial)
        if mine:
            bps = engine.blocks_per_slab
            if not engine.keys_current:        # told to clear: what it copied may be of before
                self._race(mine.values())
            for op in m.ops:
                if isinstance(op, p.ClearKeys):
                    self._race(mine.values())
                elif isinstance(op, p.RemoveKey) and op.block in mine:
                    self._race([mine[op.block]])
                elif isinstance(op, p.RemoveSlab):
                    self._race([s for b, s in mine.items() if b // bps == op.slab])
            if m.tier_ack > 0:
                self._settle(engine.serial, m.tier_ack)
        demoted = [op.block for op in m.ops if isinstance(op, p.DemoteBlock)]
        if demoted:
            self._copy(engine, demoted)

    def refused(self, engine: EngineRecord) -> None:
        """A journal of ``engine`` was refused whole: the drops it carried are
        unknown, so no pending copy can be confirmed."""
        self._discard(engine.serial, "unconfirmed")

    def end_for(self, engine: EngineRecord) -> None:
        """The engine left: its copies will never be confirmed."""
        self._discard(engine.serial, "unconfirmed")

    def expire(self) -> None:
        now = self.books.now
        late = [slot for slot, c in self.copies.items() if now > c.deadline]
        if late:
            self._finish([], [(slot, "unconfirmed") for slot in late])

    def copied(self, staged: list[int], failed: list[tuple[int, str]]) -> None:
        """The loop staged (or could not read) the blocks of a ``DemoteBlocks(staged=True)``."""
        if failed:
            self._finish([], failed, written=False)

    # ------------------------------------------------------------ internals
    def _copy(self, engine: EngineRecord, blocks: list[int]) -> None:
        books = self.books
        if not books.takes_evictions or engine.private or books.tier is None or not engine.keys_current:
            return
        mirror, bps, shape = engine.mirror, engine.blocks_per_slab, shape_of(engine)
        mine = self._by_engine.setdefault(engine.serial, {})
        by_slab: dict[int, list[p.CachedBlock]] = {}
        room = min(MAX_STAGED_BYTES - self.staged_bytes, MAX_STAGED_PER_ENGINE - len(mine) * shape.block_bytes)
        for block in blocks:
            # Still demoted (not hit again in the same journal), of a finished step, not pending already.
            if block in mine or block not in mirror.demoted or \
                    mirror.stored_in.get(block, mirror.done + 1) > mirror.done:
                continue
            slab = engine.slabs.get(block // bps)
            if slab is None or slab.phase is not Phase.HELD or not slab.pages or room < shape.block_bytes:
                continue
            room -= shape.block_bytes
            by_slab.setdefault(slab.slab_id, []).append(
                p.CachedBlock(block % bps, cast(bytes, mirror.key_of[block]), mirror.label_of.get(block, b"")))
        if not by_slab:
            return
        ticket, deadline, reserved = self._next_ticket, books.now + COPY_TIMEOUT, False
        for slab_id, cached in by_slab.items():
            slab = engine.slabs[slab_id]
            for slot, c in self.tiering.reserve(engine.namespace, shape, slab.pages, slab.page_devices,
                                                tuple(cached), staged=True):
                block = slab_id * bps + c.offset
                self.copies[slot] = Copy(engine.serial, block, ticket, shape.block_bytes, deadline)
                mine[block] = slot
                self.staged_bytes += shape.block_bytes
                self.tiering.counted_as[slot] = "demotions_evicted"
                reserved = True
        if reserved:
            # After the copies (the loop performs effects in order): the
            # engine hears the ticket only once they ended.
            self._next_ticket += 1
            books.emit(fx.Send(engine.identity, p.TierCopied(ticket=ticket)))

    def _race(self, slots: Iterable[int]) -> None:
        for slot in slots:
            self.copies[slot].raced = True

    def _settle(self, serial: int, ack: int) -> None:
        due = [(slot, c) for slot, c in self.copies.items() if c.serial == serial and c.ticket <= ack]
        whole = [slot for slot, c in due if not c.raced]
        self._finish(whole, [(slot, "raced") for slot, c in due if c.raced])

    def _discard(self, serial: int, reason: str) -> None:
        mine = self._by_engine.get(serial)
        if mine:
            self._finish([], [(slot, reason) for slot in mine.values()])
        self._by_engine.pop(serial, None)

    def _finish(self, write: list[int], dropped: list[tuple[int, str]], written: bool = True) -> None:
        """Take these copies off the books: ``write`` to the tier (committed
        when the loop answers), ``dropped`` aborted (``written``: staged, so
        the loop discards their bytes)."""
        for slot in [*write, *(s for s, _ in dropped)]:
            c = self.copies.pop(slot)
            self.staged_bytes -= c.nbytes
            mine = self._by_engine.get(c.serial)
            if mine is not None:
                mine.pop(c.block, None)
                if not mine:
                    del self._by_engine[c.serial]
        if dropped:
            self.tiering.written([], dropped)
        if write or (dropped and written):
            self.books.emit(fx.WriteStaged(tuple(write), tuple(s for s, _ in dropped) if written else ()))
