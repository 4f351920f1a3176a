"""Source B's rules (``daemon/staging.py``), in process on the daemon's own
books: which demoted blocks are copied, and what the engine's acknowledging
journal decides about each copy. A copy is written only when no drop of its
block (its key removed, the keys cleared, its slab removed) came between the
journal that demoted it and the one that acknowledged its ticket; a refused
journal, the engine's departure and the deadline discard what is pending;
blocks of a step not finished, of a private engine, already in the tier or
past the staging budget are never copied. The real loop and processes:
``test_eviction_demotion.py``."""

from __future__ import annotations

import pytest

from kvelastic import protocol as p
from kvelastic.core.stats import COUNTER_NAMES
from kvelastic.daemon import effects as fx
from kvelastic.daemon import journal_intake, staging
from kvelastic.daemon.staging import COPY_TIMEOUT, Staging
from kvelastic.daemon.state import Phase, SlabRecord
from kvelastic.daemon.tiering import Tiering
from tests.tier.test_demotion import books_with, record

BPS = 4


class Rig:
    """One engine holding slab 0 (two pages, 4 blocks) on books with a tier."""

    def __init__(self, private: bool = False) -> None:
        self.engine = record(2, 1, BPS)
        self.engine.private = private
        self.engine.stats = dict.fromkeys(COUNTER_NAMES, 0)     # as registration leaves them
        self.books = books_with(self.engine)
        self.tiering = Tiering(self.books)
        self.staging = Staging(self.books, self.tiering)
        self.engine.slabs[0] = SlabRecord(0, [10, 11], ["cpu", "cpu"], Phase.HELD, set())
        self.step = 0

    def journal(self, *ops: p.JournalOp, ack: int = 0) -> list[fx.Effect]:
        m = p.Journal(engine_id=self.engine.engine_id, ops=list(ops), occupancy={}, tier_ack=ack)
        journal_intake.accept(self.engine, m, self.books.now)
        self.staging.journal(self.engine, m)
        return self.books.take()

    def cache(self, *blocks: int, done: bool = True) -> None:
        """Keys ``k<block>`` stored in a model step (finished, with ``done``)."""
        self.step += 1
        self.journal(p.StepBegun(self.step), *(p.StoreKey(f"k{b}".encode(), b) for b in blocks),
                     *([p.StepDone(self.step)] if done else []))

    def demote(self, *blocks: int) -> tuple[list[int], int]:
        """A journal demoting ``blocks``; the loop stages every copy. (slots, ticket)."""
        effects = self.journal(*(p.DemoteBlock(b) for b in blocks))
        staged = [e for e in effects if isinstance(e, fx.DemoteBlocks)]
        tickets = [e.msg.ticket for e in effects if isinstance(e, fx.Send) and isinstance(e.msg, p.TierCopied)]
        assert all(e.staged for e in staged) and len(tickets) == (1 if staged else 0)
        if staged:       # the ticket is sent after the copies: the loop performs effects in order
            assert effects.index(staged[-1]) < next(i for i, e in enumerate(effects) if isinstance(e, fx.Send))
        slots = [b.slot for e in staged for b in e.blocks]
        self.staging.copied(slots, [])
        return slots, tickets[0] if tickets else 0

    def settled(self, effects: list[fx.Effect]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """What a ``WriteStaged`` among ``effects`` writes and drops; writes committed as the loop would."""
        writes = [e for e in effects if isinstance(e, fx.WriteStaged)]
        write = tuple(s for e in writes for s in e.write)
        self.tiering.written(list(write), [])
        return write, tuple(s for e in writes for s in e.drop)

    def found(self) -> int:
        tier = self.books.tier
        assert tier is not None
        return len(tier.lookup("ns", [f"k{b}".encode() for b in range(BPS)], self.books.now))


def test_a_copy_is_written_only_once_acknowledged_and_then_found():
    rig = Rig()
    rig.cache(0, 1, 2, 3)
    slots, ticket = rig.demote(0, 1)
    assert len(slots) == 2 and rig.staging.staged_bytes == 2 * rig.engine.block_bytes
    assert rig.found() == 0                                          # reserved, not findable yet
    assert rig.settled(rig.journal(ack=ticket - 1)) == ((), ())      # an older ack settles nothing
    assert rig.settled(rig.journal(ack=ticket)) == (tuple(slots), ())
    assert rig.found() == 2 and rig.staging.staged_bytes == 0 and not rig.staging.copies
    assert rig.books.tier.stats.demotions_evicted == 2


@pytest.mark.parametrize("drop", [
    lambda b: p.RemoveKey(f"k{b}".encode(), b),
    lambda b: p.ClearKeys(),
])
def test_a_block_dropped_before_the_ack_is_discarded_even_when_the_same_journal_acknowledges(drop):
    rig = Rig()
    rig.cache(0, 1, 2, 3)
    slots, ticket = rig.demote(0, 1)
    write, dropped = rig.settled(rig.journal(drop(0), ack=ticket))
    assert dropped == (slots[0],) + ((slots[1],) if isinstance(drop(0), p.ClearKeys) else ())
    assert write == tuple(s for s in slots if s not in dropped)
    assert rig.books.tier.stats.failures["raced"] == len(dropped)


def test_a_drop_in_a_journal_between_the_copy_and_the_ack_counts_too():
    rig = Rig()
    rig.cache(0, 1, 2, 3)
    slots, ticket = rig.demote(0, 1)
    assert rig.settled(rig.journal(p.RemoveKey(b"k1", 1))) == ((), ())    # no ack yet: noted
    assert rig.settled(rig.journal(ack=ticket)) == ((slots[0],), (slots[1],))


def test_a_refused_journal_the_engines_departure_and_the_deadline_discard_pending_copies():
    rig = Rig()
    rig.cache(0, 1, 2, 3)
    slots, _ = rig.demote(0)
    rig.staging.refused(rig.engine)
    assert rig.settled(rig.books.take()) == ((), (slots[0],))
    slots, _ = rig.demote(1)
    rig.staging.end_for(rig.engine)
    assert rig.settled(rig.books.take()) == ((), (slots[0],))
    slots, ticket = rig.demote(2)
    rig.books.now += COPY_TIMEOUT + 1
    rig.staging.expire()
    assert rig.settled(rig.books.take()) == ((), (slots[0],))
    assert rig.books.tier.stats.failures["unconfirmed"] == 3
    assert rig.settled(rig.journal(ack=ticket)) == ((), ())          # a late ack finds nothing
    assert rig.found() == 0 and rig.staging.staged_bytes == 0


def test_blocks_of_an_unfinished_step_a_private_engine_or_in_the_tier_already_are_not_copied():
    rig = Rig()
    rig.cache(0, 1)
    rig.cache(2, 3, done=False)
    slots, ticket = rig.demote(0, 1, 2, 3)                           # 2 and 3: their step runs
    assert len(slots) == 2
    rig.settled(rig.journal(ack=ticket))
    assert rig.demote(0, 1) == ([], 0)                               # in the tier already: nothing sent
    private = Rig(private=True)
    private.cache(0)
    assert private.demote(0) == ([], 0)


def test_staging_never_holds_more_than_its_budget(monkeypatch):
    rig = Rig()
    monkeypatch.setattr(staging, "MAX_STAGED_BYTES", 3 * rig.engine.block_bytes)
    rig.cache(0, 1, 2, 3)
    slots, _ = rig.demote(0, 1, 2, 3)
    assert len(slots) == 3 and rig.staging.staged_bytes == 3 * rig.engine.block_bytes


def test_an_engine_that_never_acknowledges_holds_no_more_than_its_share(monkeypatch):
    rig = Rig()
    monkeypatch.setattr(staging, "MAX_STAGED_PER_ENGINE", 2 * rig.engine.block_bytes)
    rig.cache(0, 1, 2, 3)
    assert len(rig.demote(0, 1, 2)[0]) == 2                      # no ack: the third waits
    assert rig.demote(3) == ([], 0)
    assert rig.staging.staged_bytes == 2 * rig.engine.block_bytes


def test_a_failed_read_aborts_the_copy_and_frees_its_room():
    rig = Rig()
    rig.cache(0)
    effects = rig.journal(p.DemoteBlock(0))
    (slot,) = [b.slot for e in effects if isinstance(e, fx.DemoteBlocks) for b in e.blocks]
    rig.staging.copied([], [(slot, "io")])
    assert not rig.staging.copies and rig.staging.staged_bytes == 0
    assert rig.books.tier.stats.failures["io"] == 1
