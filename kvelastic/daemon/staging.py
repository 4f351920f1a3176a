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
(a restart would find them there). Blocks of a private engine, or already
in the tier, go uncopied.

**Shared fairly.** Staging holds at most ``MAX_STAGED_BYTES``, of which an
engine at most ``MAX_STAGED_PER_ENGINE`` and a tenant (uid), all its engines
together, at most ``MAX_STAGED_PER_TENANT``: a tenant that never
acknowledges holds half of it for ``COPY_TIMEOUT`` at a time, never all.
When staging is full and a tenant needs room, the oldest unconfirmed copies
of the largest holder go first (discarded, ``evicted_share``), as long as
that holder keeps at least what the one asking will hold: the tenants that
want room even out, and two never take a copy back and forth. Any copy
may be discarded before its ack (a discarded copy is only a demotion not
made), so this never breaks the ack rule.

**Retried.** A block refused for room (counted: ``refused_staging``), or one
whose step had not finished, is remembered (``MAX_RETRY`` an engine, oldest
first) and copied on a later journal of its engine if it is still demoted:
the engine marks a block ``DEMOTE`` once, so nothing else would bring it
back. A copy taken then is as safe as one taken on the journal that marked
it: what the ack rule needs is that every drop made before the copy ended
reaches the daemon before the ack, which holds whenever the copy is taken.
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
from kvelastic.errors import require

MAX_STAGED_BYTES = 64 << 20    # copies awaiting their engine's word, all engines together
# And of one engine: one that never acknowledges holds no more than this of
# the staging (for ``COPY_TIMEOUT`` at a time), never all of it.
MAX_STAGED_PER_ENGINE = 16 << 20
# And of one tenant (uid), all its engines together: half, so that however
# many engines a tenant runs, the other half is left to the others without
# a copy discarded; past that, ``_evict_for`` evens out the tenants that want room.
MAX_STAGED_PER_TENANT = 32 << 20
COPY_TIMEOUT = 10.0            # seconds a copy waits for its ticket's ack
MAX_RETRY = 256                # blocks an engine may have waiting for a later copy


@dataclasses.dataclass
class Copy:
    serial: int          # the engine's registration
    uid: int             # its tenant
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
        self._by_tenant: dict[int, dict[int, None]] = {}  # uid -> its copies' slots, oldest first
        self.tenant_bytes: dict[int, int] = {}            # uid -> bytes its copies hold
        self._retry: dict[int, dict[int, None]] = {}      # serial -> blocks to copy later, oldest first
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
        if not engine.keys_current or any(isinstance(op, p.ClearKeys) for op in m.ops):
            self._retry.pop(engine.serial, None)    # keys of before: none is copied later either
        demoted = [op.block for op in m.ops if isinstance(op, p.DemoteBlock)]
        if demoted or engine.serial in self._retry:
            self._copy(engine, demoted)

    def refused(self, engine: EngineRecord) -> None:
        """A journal of ``engine`` was refused whole: the drops it carried are
        unknown, so no pending copy can be confirmed, nor a waiting block trusted."""
        self._discard(engine.serial, "unconfirmed")

    def end_for(self, engine: EngineRecord) -> None:
        """The engine left: its copies will never be confirmed."""
        self._discard(engine.serial, "unconfirmed")

    def check(self) -> None:
        """Staged bytes are the copies', each within its engine's, tenant's and
        the whole staging's room; the per-engine and per-tenant books agree."""
        require(self.staged_bytes == sum(c.nbytes for c in self.copies.values()) <= MAX_STAGED_BYTES,
                "staged bytes are not the copies'")
        tenants: dict[int, int] = {}
        for slot, c in self.copies.items():
            tenants[c.uid] = tenants.get(c.uid, 0) + c.nbytes
            require(self._by_engine.get(c.serial, {}).get(c.block) == slot, f"copy {slot} is not its engine's")
            require(slot in self._by_tenant.get(c.uid, {}), f"copy {slot} is not its tenant's")
        require(tenants == self.tenant_bytes, "the tenants' staged bytes are off")
        require(all(n <= MAX_STAGED_PER_TENANT for n in tenants.values()), "a tenant holds more than its share")
        require(sum(map(len, self._by_engine.values())) == sum(map(len, self._by_tenant.values()))
                == len(self.copies), "copies are kept apart from their books")
        require(all(self._by_engine.values()) and all(self._by_tenant.values()), "empty books are kept")
        require(all(0 < len(r) <= MAX_RETRY for r in self._retry.values()), "a retry list is empty or too long")

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
        """Copy ``blocks`` (demoted by this journal) and those waiting since an
        earlier one, oldest first, as far as there is room."""
        books = self.books
        if not books.takes_evictions or engine.private or books.tier is None or not engine.keys_current:
            return
        tier = books.tier
        mirror, bps, shape = engine.mirror, engine.blocks_per_slab, shape_of(engine)
        waiting = self._retry.pop(engine.serial, {})
        mine = self._by_engine.get(engine.serial, {})
        by_slab: dict[int, list[p.CachedBlock]] = {}
        later: list[int] = []
        planned = 0
        for block in dict.fromkeys([*waiting, *blocks]):
            # Still demoted (not hit again, nor dropped), not pending already.
            if block in mine or block not in mirror.demoted:
                continue
            slab = engine.slabs.get(block // bps)
            if slab is None or slab.phase is not Phase.HELD or not slab.pages:
                continue
            if mirror.stored_in.get(block, mirror.done + 1) > mirror.done:
                later.append(block)            # its step runs: its KV is final once it finished
                continue
            if not self._room_for(engine, shape.block_bytes, planned):
                if block not in waiting:
                    tier.stats.refused["staging"] += 1
                later.append(block)
                continue
            planned += shape.block_bytes
            if block in waiting:
                tier.stats.staging_retried += 1
            by_slab.setdefault(slab.slab_id, []).append(
                p.CachedBlock(block % bps, cast(bytes, mirror.key_of[block]), mirror.label_of.get(block, b"")))
        if later:
            self._retry[engine.serial] = dict.fromkeys(later[:MAX_RETRY])
        if not by_slab:
            return
        ticket, deadline, reserved = self._next_ticket, books.now + COPY_TIMEOUT, False
        for slab_id, cached in by_slab.items():
            slab = engine.slabs[slab_id]
            for slot, c in self.tiering.reserve(engine.namespace, shape, slab.pages, slab.page_devices,
                                                tuple(cached), staged=True):
                self._add(slot, Copy(engine.serial, engine.uid, slab_id * bps + c.offset, ticket, shape.block_bytes,
                                     deadline))
                reserved = True
        if reserved:
            # After the copies (the loop performs effects in order): the
            # engine hears the ticket only once they ended.
            self._next_ticket += 1
            books.emit(fx.Send(engine.identity, p.TierCopied(ticket=ticket)))

    def _add(self, slot: int, c: Copy) -> None:
        self.copies[slot] = c
        self._by_engine.setdefault(c.serial, {})[c.block] = slot
        self._by_tenant.setdefault(c.uid, {})[slot] = None
        self.tenant_bytes[c.uid] = self.tenant_bytes.get(c.uid, 0) + c.nbytes
        self.staged_bytes += c.nbytes
        self.tiering.counted_as[slot] = "demotions_evicted"

    def _room_for(self, engine: EngineRecord, nbytes: int, planned: int) -> bool:
        """Whether ``nbytes`` more of ``engine`` fit (``planned``: this pass's
        copies of it so far), within its own share and its tenant's; staging
        full, by discarding the largest other holder's oldest copies while it
        keeps at least what ``engine``'s tenant will hold."""
        held = len(self._by_engine.get(engine.serial, {})) * nbytes + planned    # an engine's blocks are one size
        tenant = self.tenant_bytes.get(engine.uid, 0) + planned
        if held + nbytes > MAX_STAGED_PER_ENGINE or tenant + nbytes > MAX_STAGED_PER_TENANT:
            return False
        while self.staged_bytes + planned + nbytes > MAX_STAGED_BYTES:
            if not self._evict_for(engine.uid, tenant + nbytes):
                return False
        return True

    def _evict_for(self, uid: int, wanted: int) -> bool:
        """Discard the oldest copy of the tenant holding most, other than
        ``uid``, if it keeps ``wanted`` bytes (what ``uid`` will hold) or more."""
        holders = [(n, t) for t, n in self.tenant_bytes.items() if t != uid]
        if not holders:
            return False
        held, victim = max(holders)
        slot = next(iter(self._by_tenant[victim]))
        if held - self.copies[slot].nbytes < wanted:
            return False
        self._finish([], [(slot, "evicted_share")])
        return True

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
        self._retry.pop(serial, None)

    def _finish(self, write: list[int], dropped: list[tuple[int, str]], written: bool = True) -> None:
        """Take these copies off the books: ``write`` to the tier (committed
        when the loop answers), ``dropped`` aborted (``written``: staged, so
        the loop discards their bytes)."""
        for slot in [*write, *(s for s, _ in dropped)]:
            c = self.copies.pop(slot)
            self.staged_bytes -= c.nbytes
            self.tenant_bytes[c.uid] -= c.nbytes
            if not self.tenant_bytes[c.uid]:
                del self.tenant_bytes[c.uid]
            mine = self._by_engine.get(c.serial)
            if mine is not None:
                mine.pop(c.block, None)
                if not mine:
                    del self._by_engine[c.serial]
            theirs = self._by_tenant[c.uid]
            del theirs[slot]
            if not theirs:
                del self._by_tenant[c.uid]
        if dropped:
            self.tiering.written([], dropped)
        if write or (dropped and written):
            self.books.emit(fx.WriteStaged(tuple(write), tuple(s for s, _ in dropped) if written else ()))
