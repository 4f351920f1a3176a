"""Tenants competing for source B's staging (``daemon/staging.py``), in random
sequences: four engines of three tenants (uids 1, 1, 2, 3) cache and demote
blocks, acknowledge their tickets or never do, have journals refused, and
let copies expire, on a staging small enough to be full most of the time.

After every step the staging's own ``check`` (its books agree, no tenant
past its share) holds, and what each demotion did obeys the sharing rules:

- a block refused for room was refused because its engine or its tenant
  was at its share, or because the staging was full and no other tenant
  could give up a copy and still hold at least what the asking tenant
  would: a tenant below every other is never refused while another holds
  more than it would;
- a copy discarded to make room (``evicted_share``) is of another tenant,
  the oldest of that tenant's, and of the largest holder at the time;
- a refused block is copied on a later journal once there is room
  (``staging_retried``), never counted as refused twice.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvelastic import protocol as p
from kvelastic.daemon import effects as fx
from kvelastic.daemon import staging
from kvelastic.daemon.staging import COPY_TIMEOUT
from tests.tier.test_staging import BPS, Node

UIDS = (1, 1, 2, 3)
ENGINES = st.integers(0, len(UIDS) - 1)
BLOCKS = st.lists(st.integers(0, BPS - 1), min_size=1, max_size=BPS, unique=True)
# In blocks: the staging holds 6, an engine 3, a tenant 4.
TOTAL, PER_ENGINE, PER_TENANT = 6, 3, 4


class StagingMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.node = Node(*UIDS)
        self.bb = self.node.engines[0].block_bytes
        self.saved = (staging.MAX_STAGED_BYTES, staging.MAX_STAGED_PER_ENGINE, staging.MAX_STAGED_PER_TENANT)
        staging.MAX_STAGED_BYTES = TOTAL * self.bb
        staging.MAX_STAGED_PER_ENGINE = PER_ENGINE * self.bb
        staging.MAX_STAGED_PER_TENANT = PER_TENANT * self.bb
        self.heard = [0] * len(UIDS)          # the last ticket each engine heard
        self.generation = 0                   # keys are new each caching step

    def teardown(self) -> None:
        staging.MAX_STAGED_BYTES, staging.MAX_STAGED_PER_ENGINE, staging.MAX_STAGED_PER_TENANT = self.saved

    # ----------------------------------------------------------- helpers
    @property
    def tier(self):
        tier = self.node.books.tier
        assert tier is not None
        return tier

    def blocks_of(self, uid: int) -> int:
        return self.node.staging.tenant_bytes.get(uid, 0) // self.bb

    def engine_blocks(self, i: int) -> int:
        return len(self.node.staging._by_engine.get(self.node.engines[i].serial, {}))

    def heard_from(self, i: int, effects: list[fx.Effect]) -> None:
        for e in effects:
            if isinstance(e, fx.Send) and isinstance(e.msg, p.TierCopied):
                self.heard[i] = max(self.heard[i], e.msg.ticket)

    def written(self, effects: list[fx.Effect]) -> None:
        """The loop writes what a ``WriteStaged`` says and commits it."""
        write = [s for e in effects if isinstance(e, fx.WriteStaged) for s in e.write]
        self.node.tiering.written(write, [])

    # ------------------------------------------------------------- rules
    @rule(i=ENGINES, blocks=BLOCKS)
    def cache_and_demote(self, i: int, blocks: list[int]) -> None:
        node, engine = self.node, self.node.engines[i]
        uid = engine.uid
        self.generation += 1
        node.step += 1
        drops = [p.RemoveKey(key=engine.mirror.key_of[b], block=b) for b in blocks if b in engine.mirror.key_of]
        node.journal(i, *drops, p.StepBegun(node.step),
                     *(p.StoreKey(f"e{i}g{self.generation}k{b}".encode(), b) for b in blocks),
                     p.StepDone(node.step))
        before = {t: list(node.staging._by_tenant.get(t, {})) for t in set(UIDS)}
        held = {t: self.blocks_of(t) for t in set(UIDS)}
        refused = self.tier.stats.refused["staging"]
        mine_before = self.engine_blocks(i)
        effects = node.journal(i, *(p.DemoteBlock(b) for b in blocks))
        self.heard_from(i, effects)
        slots = [b.slot for e in effects if isinstance(e, fx.DemoteBlocks) for b in e.blocks]
        node.staging.copied(slots, [])
        evicted = [s for e in effects if isinstance(e, fx.WriteStaged) for s in e.drop]
        # Evictions: another tenant's oldest copies, of the largest holder then.
        for slot in evicted:
            victim = next(t for t, slots_of in before.items() if slot in slots_of)
            assert victim != uid, "a tenant's own copy was evicted for it"
            assert before[victim][0] == slot, "a copy other than the tenant's oldest was evicted"
            before[victim].pop(0)
            assert held[victim] == max(n for t, n in held.items() if t != uid), "not the largest holder's copy"
            held[victim] -= 1
        # Refusals: the engine or tenant at its share, or no other tenant able to give.
        if self.tier.stats.refused["staging"] > refused:
            mine, theirs = self.engine_blocks(i), self.blocks_of(uid)
            at_share = mine + 1 > PER_ENGINE or theirs + 1 > PER_TENANT
            full = sum(self.blocks_of(t) for t in set(UIDS)) + 1 > TOTAL
            could_give = any(self.blocks_of(t) - 1 >= theirs + 1 for t in set(UIDS) if t != uid)
            assert at_share or (full and not could_give), \
                (f"uid {uid} refused with {theirs} block(s) staged while others hold "
                 f"{ {t: self.blocks_of(t) for t in set(UIDS) if t != uid} }")
        assert self.engine_blocks(i) >= mine_before

    @rule(i=ENGINES)
    def acknowledge(self, i: int) -> None:
        """The engine's next journal carries back the last ticket it heard:
        its copies are written, and blocks waiting for room may be copied."""
        ack = self.heard[i]
        effects = self.node.journal(i, ack=ack)
        self.heard_from(i, effects)
        self.written(effects)
        slots = [b.slot for e in effects if isinstance(e, fx.DemoteBlocks) for b in e.blocks]
        self.node.staging.copied(slots, [])
        serial = self.node.engines[i].serial
        assert not any(c.serial == serial and c.ticket <= ack for c in self.node.staging.copies.values()), \
            "an acknowledged copy is still pending"

    @rule(i=ENGINES)
    def journal_refused(self, i: int) -> None:
        self.node.staging.refused(self.node.engines[i])
        self.node.books.take()
        assert self.engine_blocks(i) == 0

    @rule()
    def time_passes(self) -> None:
        self.node.books.now += COPY_TIMEOUT + 1
        self.node.staging.expire()
        self.node.books.take()
        assert not self.node.staging.copies

    @invariant()
    def books_agree(self) -> None:
        self.node.staging.check()
        assert self.node.staging.staged_bytes <= TOTAL * self.bb
        assert all(self.blocks_of(t) <= PER_TENANT for t in set(UIDS))


StagingMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_tenants_share_the_staging = StagingMachine.TestCase


def never_evicts(self, uid, wanted):
    """Staging full, nothing is taken from the largest holder (finding 7's staging)."""
    return False


def evicts_the_newest(self, uid, wanted):
    """The largest holder gives up its newest copy, not its oldest."""
    held, victim = max((n, t) for t, n in self.tenant_bytes.items() if t != uid) if len(self.tenant_bytes) > (
        uid in self.tenant_bytes) else (0, None)
    if victim is None:
        return False
    slot = list(self._by_tenant[victim])[-1]
    if held - self.copies[slot].nbytes < wanted:
        return False
    self._finish([], [(slot, "evicted_share")])
    return True


@pytest.mark.parametrize(("fault", "found"), [(never_evicts, "refused with"),
                                              (evicts_the_newest, "other than the tenant's oldest")])
def test_the_machine_catches_an_unfair_staging(fault, found, monkeypatch):
    monkeypatch.setattr(staging.Staging, "_evict_for", fault)
    with pytest.raises(AssertionError, match=found):
        StagingMachine.TestCase("runTest").runTest()
