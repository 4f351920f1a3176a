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


# ------------------------------------------------- shared fairly, and retried
class Node:
    """Engines of several tenants (uids), each holding slab 0 (4 blocks) of
    its own pages, on one daemon's books with a tier: ``journal`` as ``Rig``'s."""

    def __init__(self, *uids: int) -> None:
        self.engines = []
        for i, uid in enumerate(uids):
            engine = record(2, 1, BPS, engine_id=f"e{i}", namespace=f"ns{uid}")
            engine.uid, engine.stats = uid, dict.fromkeys(COUNTER_NAMES, 0)
            self.engines.append(engine)
        self.books = books_with(*self.engines)
        self.tiering = Tiering(self.books)
        self.staging = Staging(self.books, self.tiering)
        for i, engine in enumerate(self.engines):
            engine.slabs[0] = SlabRecord(0, [10 + 2 * i, 11 + 2 * i], ["cpu", "cpu"], Phase.HELD, set())
        self.step = 0

    def journal(self, i: int, *ops: p.JournalOp, ack: int = 0) -> list[fx.Effect]:
        engine = self.engines[i]
        m = p.Journal(engine_id=engine.engine_id, ops=list(ops), occupancy={}, tier_ack=ack)
        journal_intake.accept(engine, m, self.books.now)
        self.staging.journal(engine, m)
        self.staging.check()
        return self.books.take()

    def cached_and_demoted(self, i: int, blocks: range = range(BPS), done: bool = True) -> list[fx.Effect]:
        """Engine ``i`` caches ``blocks`` in a model step (finished, with ``done``), then demotes them."""
        self.step += 1
        self.journal(i, p.StepBegun(self.step), *(p.StoreKey(f"e{i}k{b}".encode(), b) for b in blocks),
                     *([p.StepDone(self.step)] if done else []))
        return self.journal(i, *(p.DemoteBlock(b) for b in blocks))

    def staged(self, uid: int) -> int:
        return self.staging.tenant_bytes.get(uid, 0) // self.engines[0].block_bytes


def copied(effects: list[fx.Effect]) -> list[int]:
    return [b.slot for e in effects if isinstance(e, fx.DemoteBlocks) for b in e.blocks]


def ticket(effects: list[fx.Effect]) -> int:
    return next(e.msg.ticket for e in effects if isinstance(e, fx.Send) and isinstance(e.msg, p.TierCopied))


def dropped(effects: list[fx.Effect]) -> list[int]:
    return [s for e in effects if isinstance(e, fx.WriteStaged) for s in e.drop]


def test_one_tenants_engines_together_hold_no_more_than_its_share(monkeypatch):
    """Finding 7: four engines of one uid that never acknowledge held all of
    the staging, so another tenant's blocks were never copied."""
    node = Node(1, 1, 1, 1, 2)
    bb = node.engines[0].block_bytes
    monkeypatch.setattr(staging, "MAX_STAGED_BYTES", 16 * bb)
    monkeypatch.setattr(staging, "MAX_STAGED_PER_ENGINE", 4 * bb)
    monkeypatch.setattr(staging, "MAX_STAGED_PER_TENANT", 8 * bb)
    assert [len(copied(node.cached_and_demoted(i))) for i in range(4)] == [4, 4, 0, 0]   # never acknowledged
    assert node.staged(1) == 8 and node.books.tier.stats.refused["staging"] == 8
    assert len(copied(node.cached_and_demoted(4))) == 4 and node.staged(2) == 4          # the other tenant's


def test_staging_full_the_largest_holders_oldest_copies_go_first(monkeypatch):
    node = Node(1, 1, 2, 3)
    bb = node.engines[0].block_bytes
    monkeypatch.setattr(staging, "MAX_STAGED_BYTES", 8 * bb)
    first = copied(node.cached_and_demoted(0))
    second = copied(node.cached_and_demoted(1))
    assert node.staged(1) == 8                                   # the whole staging, alone
    effects = node.cached_and_demoted(2)                         # tenant 2 needs room: 1's oldest copies go
    assert dropped(effects) == first and len(copied(effects)) == 4
    third = copied(effects)
    assert node.staged(1) == node.staged(2) == 4
    # Tenant 3: the largest holder gives up its oldest copy, one at a time,
    # while it keeps at least what tenant 3 will hold: 2 and 1 a copy each.
    effects = node.cached_and_demoted(3)
    assert dropped(effects) == [third[0], second[0]] and len(copied(effects)) == 2
    assert (node.staged(1), node.staged(2), node.staged(3)) == (3, 3, 2)
    tier = node.books.tier
    assert tier.stats.failures["evicted_share"] == 6 and tier.stats.refused["staging"] == 2
    # Tenant 1 asks again (block 0 hit and demoted anew): no holder keeps as
    # much as it would, so nothing is taken: no copy goes back and forth.
    effects = node.journal(0, p.PromoteBlock(0), p.DemoteBlock(0))
    assert copied(effects) == [] and dropped(effects) == [] and tier.stats.refused["staging"] == 3


def test_an_evicted_copy_is_never_written_and_its_engines_ack_changes_nothing(monkeypatch):
    node = Node(1, 2)
    bb = node.engines[0].block_bytes
    monkeypatch.setattr(staging, "MAX_STAGED_BYTES", 4 * bb)
    effects = node.cached_and_demoted(0)
    old, old_ticket = copied(effects), ticket(effects)
    effects = node.cached_and_demoted(1)
    assert dropped(effects) == old[:2] and len(copied(effects)) == 2
    writes = [e for e in node.journal(0, ack=old_ticket) if isinstance(e, fx.WriteStaged)]
    assert [s for e in writes for s in e.write] == old[2:]          # the copies still held are written
    tier = node.books.tier
    assert all(s not in tier._entries for s in old[:2]) and tier.stats.failures["evicted_share"] == 2


def test_a_block_refused_for_room_is_copied_on_a_later_journal(monkeypatch):
    """A block is marked DEMOTE once: refused for room, it was never copied."""
    node = Node(1)
    bb = node.engines[0].block_bytes
    monkeypatch.setattr(staging, "MAX_STAGED_BYTES", 2 * bb)
    effects = node.cached_and_demoted(0)
    assert len(copied(effects)) == 2 and node.books.tier.stats.refused["staging"] == 2
    later = node.journal(0, ack=ticket(effects))                     # the ack writes them: room again
    node.tiering.written([s for e in later if isinstance(e, fx.WriteStaged) for s in e.write], [])
    assert len(copied(later)) == 2 and node.books.tier.stats.staging_retried == 2
    assert node.books.tier.stats.refused["staging"] == 2             # counted once, when refused
    assert sorted(c.block for c in node.staging.copies.values()) == [2, 3]


def test_a_block_demoted_while_its_step_ran_is_copied_once_it_finished():
    node = Node(1)
    assert copied(node.cached_and_demoted(0, done=False)) == []
    assert len(copied(node.journal(0, p.StepDone(node.step)))) == 4


@pytest.mark.parametrize("then", ["hit", "clear", "refused", "left"])
def test_a_waiting_block_is_not_copied_once_its_key_may_have_changed(then, monkeypatch):
    node = Node(1)
    monkeypatch.setattr(staging, "MAX_STAGED_BYTES", 0)               # no room: all four wait
    node.cached_and_demoted(0)
    monkeypatch.setattr(staging, "MAX_STAGED_BYTES", 64 << 20)
    engine = node.engines[0]
    if then == "hit":
        effects = node.journal(0, *(p.PromoteBlock(b) for b in range(BPS)))
    elif then == "clear":
        effects = node.journal(0, p.ClearKeys())
    else:
        (node.staging.refused if then == "refused" else node.staging.end_for)(engine)
        effects = node.journal(0)
    assert copied(effects) == [] and not node.staging._retry
