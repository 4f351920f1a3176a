"""Unit tests of TierIndex: the entry's life, eviction by value, leaves
first, loads that hold entries, invalidation, failures and restore; and
pins shared fairly (``tier/pins.py``): a tenant's share of bytes and pins,
a block pinned on and on by new lookups cut off and rested."""

import pytest

from kvelastic.errors import InvariantViolation
from kvelastic.tier.errors import TierSlotState, UnknownTierSlot
from kvelastic.tier.index import TierIndex
from kvelastic.tier.pins import PinBooks

NS = "llama-3f2a"
H = 100.0   # half-life in the tests


def demote(index, key, nbytes=10, cost=1.0, now=0.0, ns=NS, parent=None):
    slot = index.reserve(ns, key, nbytes, cost, now, parent)
    assert slot is not None
    assert index.commit(slot)
    index.check()
    return slot


def findable(index, key, ns=NS, now=0.0):
    """Whether ``key`` is found (its pin released at once: a load that went well)."""
    slots = index.lookup(ns, [key], now)
    index.unpin(slots)
    return bool(slots)


def snapshot(index):
    return (index.bytes_used, index.held_bytes, len(index), index.stats.counters(), index._next_slot,
            {s: (e.pins, e.committed, e.dead) for s, e in index._entries.items()})


# ---------------------------------------------------------------- the life
def test_pending_is_not_found_until_committed():
    index = TierIndex(100, half_life=H)
    slot = index.reserve(NS, b"a", 10, 1.0, 0.0)
    assert index.lookup(NS, [b"a"], 0.0) == []
    assert index.bytes_used == index.held_bytes == 10
    assert index.commit(slot)
    assert index.held_bytes == 0
    assert index.lookup(NS, [b"a", b"b"], 1.0) == [slot]
    assert (index.stats.hit_blocks, index.stats.miss_blocks, index.stats.demotions) == (1, 2, 1)
    index.check()


def test_abort_frees_and_counts_the_failure():
    index = TierIndex(100, half_life=H)
    slot = index.reserve(NS, b"a", 10, 1.0, 0.0)
    index.abort(slot, "disk_full")
    assert index.take_released() == [slot]
    assert index.bytes_used == 0 and index.stats.failures["disk_full"] == 1
    assert index.reserve(NS, b"a", 10, 1.0, 0.0) not in (None, slot)    # slots are never reused
    index.check()


def test_a_key_already_held_is_not_written_again():
    index = TierIndex(100, half_life=H)
    demote(index, b"a")
    assert index.reserve(NS, b"a", 10, 1.0, 0.0) is None
    assert index.reserve("other-ns", b"a", 10, 1.0, 0.0) is not None    # namespaces never meet
    assert index.stats.already_held == 1


def test_lookup_returns_the_leading_run_only():
    index = TierIndex(100, half_life=H)
    a, b, d = demote(index, b"a"), demote(index, b"b"), demote(index, b"d")
    assert index.lookup(NS, [b"a", b"b", b"c", b"d"], 0.0) == [a, b]
    assert index.lookup(NS, [b"c", b"d"], 0.0) == []
    assert index.lookup("other-ns", [b"a"], 0.0) == []
    index.unpin([a, b], loaded=False)
    assert index.stats.failures["load"] == 2 and d is not None
    index.check()


# ------------------------------------------------------- eviction by value
@pytest.mark.parametrize("cost", [1.0, 4.0])      # at equal cost, its hits alone keep it
def test_a_block_hit_often_and_costly_outlives_a_later_one_never_hit(cost):
    index = TierIndex(20, half_life=H)
    hot = demote(index, b"hot", cost=cost, now=0.0)
    for t in range(1, 11):
        assert findable(index, b"hot", now=float(t))
    cold = demote(index, b"cold", cost=1.0, now=20.0)
    demote(index, b"new", now=21.0)
    assert index.take_released() == [cold]
    assert index.lookup(NS, [b"hot"], 21.0) == [hot] and not findable(index, b"cold", now=21.0)


def test_without_hits_and_at_equal_cost_the_older_goes():
    index = TierIndex(20, half_life=H)
    old = demote(index, b"old", now=0.0)
    demote(index, b"newer", now=5.0)
    demote(index, b"newest", now=6.0)
    assert index.take_released() == [old]


def test_hits_decay_a_block_hit_long_ago_loses_to_a_fresh_one():
    index = TierIndex(20, half_life=H)
    stale = demote(index, b"stale", now=0.0)
    for _ in range(20):
        assert findable(index, b"stale", now=1.0)
    demote(index, b"fresh", now=10 * H)     # 2 ** -10 * 21 hits < 1 fresh reference
    demote(index, b"newest", now=10 * H)
    assert index.take_released() == [stale]
    assert index.value(index.lookup(NS, [b"fresh"], 10 * H)[0], 10 * H) == pytest.approx(2.0 / 10)


def test_value_is_cost_per_byte_a_big_cheap_block_goes_first():
    index = TierIndex(60, half_life=H)
    big = demote(index, b"big", nbytes=40, cost=4.0)      # 0.1 per byte
    demote(index, b"small", nbytes=10, cost=2.0)          # 0.2 per byte
    demote(index, b"new", nbytes=20, cost=1.0)
    assert index.take_released() == [big]


def test_a_parent_is_not_evicted_before_its_child():
    index = TierIndex(20, half_life=H)
    parent = demote(index, b"p", cost=1.0, now=0.0)              # least value, but a prefix of "c"
    child = demote(index, b"c", cost=50.0, now=0.0, parent=b"p")
    demote(index, b"new", now=1.0)
    assert index.take_released() == [child]
    demote(index, b"new2", now=2.0)     # the parent is a leaf again: the next to go
    assert index.take_released() == [parent]


def test_a_pinned_entry_is_never_evicted():
    index = TierIndex(10, half_life=H)
    slot = demote(index, b"a")
    assert index.lookup(NS, [b"a"], 0.0) == [slot]
    assert index.reserve(NS, b"b", 10, 1000.0, 1.0) is None
    assert index.stats.rejected_full == 1 and index.take_released() == []
    index.unpin([slot])
    assert findable(index, b"a")
    assert index.reserve(NS, b"b", 10, 1.0, 2.0) is not None     # unpinned: evictable again
    assert index.take_released() == [slot]


def test_a_pinned_parent_that_becomes_a_leaf_during_its_load_is_not_evicted():
    index = TierIndex(20, half_life=H)
    parent = demote(index, b"p")
    child = demote(index, b"c", cost=9.0, parent=b"p")
    assert index.lookup(NS, [b"p"], 0.0) == [parent]
    index.drop(child, "checksum")           # the parent is a leaf now, and still being loaded
    assert index.take_released() == [child]
    index.check()
    assert index.reserve(NS, b"new", 20, 1000.0, 1.0) is None
    assert index.take_released() == []
    index.unpin([parent])
    assert findable(index, b"p")


def test_a_block_larger_than_the_budget_is_refused():
    index = TierIndex(10, half_life=H)
    demote(index, b"a")
    assert index.reserve(NS, b"big", 11, 1.0, 0.0) is None
    assert findable(index, b"a")


# ------------------------------------------------------------- the losses
def test_invalidate_kills_a_pinned_entry_whose_bytes_go_at_once_and_budget_when_unpinned():
    index = TierIndex(100, half_life=H)
    pinned, idle = demote(index, b"a"), demote(index, b"b")
    other = demote(index, b"a", ns="other-ns")
    assert index.lookup(NS, [b"a"], 0.0) == [pinned]
    assert index.invalidate(NS) == 2
    # Never served again, so its file need not wait for the load: a restart
    # before the load ends must not find it.
    assert sorted(index.take_released()) == sorted([pinned, idle])
    assert not index.servable(pinned) and index.held_bytes == 10 and index.bytes_used == 20
    assert index.lookup(NS, [b"a"], 0.0) == []
    again = demote(index, b"a")           # the key may come back (new KV), at a new slot
    index.unpin([pinned])
    assert index.take_released() == [] and index.held_bytes == 0     # its budget is back; its bytes went already
    assert index.lookup(NS, [b"a"], 0.0) == [again]
    assert findable(index, b"a", ns="other-ns") and other is not None
    index.check()


def test_invalidate_during_a_write_cancels_it_at_once_and_the_commit_frees_it():
    index = TierIndex(100, half_life=H)
    slot = index.reserve(NS, b"a", 10, 1.0, 0.0)
    index.invalidate(NS)
    assert index.take_released() == [slot]     # at once: the store cancels the write (a stop never writes it)
    assert index.bytes_used == 10              # its budget is held until the writer reports
    assert index.commit(slot) is False
    assert index.take_released() == []         # handed out once
    assert index.lookup(NS, [b"a"], 0.0) == [] and index.bytes_used == 0


def test_drop_of_a_loaded_block_is_never_found_again_its_bytes_go_and_it_is_freed_after_the_load():
    index = TierIndex(100, half_life=H)
    slot = demote(index, b"a")
    assert index.lookup(NS, [b"a"], 0.0) == [slot]
    index.drop(slot, "checksum")
    assert index.lookup(NS, [b"a"], 0.0) == [] and index.take_released() == [slot]    # bad bytes go at once
    index.unpin([slot], loaded=False)
    assert index.take_released() == [] and len(index) == 0
    assert index.stats.failures["checksum"] == 1 and index.stats.failures["load"] == 1
    index.check()


@pytest.mark.parametrize("call", [
    lambda ix, s: ix.commit(s),                     # committed already
    lambda ix, s: ix.abort(s),                      # committed: drop it instead
    lambda ix, s: ix.unpin([s]),                    # not pinned
    lambda ix, s: ix.unpin([s + 1]),                # pending: never pinned
    lambda ix, s: ix.drop(s + 1, "torn"),           # pending: abort it instead
    lambda ix, s: ix.drop(99, "torn"),              # unknown slot
    lambda ix, s: ix.commit(99),
    lambda ix, s: ix.restore(NS, b"z", 10, s, 1.0, 0.0),    # slot in use
])
def test_a_wrong_call_raises_and_changes_nothing(call):
    index = TierIndex(100, half_life=H)
    slot = demote(index, b"a")
    index.reserve(NS, b"b", 10, 1.0, 0.0)
    before = snapshot(index)
    with pytest.raises((UnknownTierSlot, TierSlotState)):
        call(index, slot)
    assert snapshot(index) == before
    index.check()


def test_unknown_failure_reason_is_refused():
    index = TierIndex(100, half_life=H)
    slot = demote(index, b"a")
    with pytest.raises(ValueError):
        index.drop(slot, "cosmic-rays")
    assert findable(index, b"a")


# ---------------------------------------------------------------- restore
def test_restore_keeps_slots_and_hands_out_later_ones():
    index = TierIndex(30, half_life=H)
    assert index.restore(NS, b"a", 10, 7, 1.0, 0.0)
    assert not index.restore(NS, b"a", 10, 8, 1.0, 0.0)     # a second file of the key
    assert index.lookup(NS, [b"a"], 0.0) == [7]
    index.unpin([7])
    assert index.reserve(NS, b"b", 10, 1.0, 0.0) == 8
    assert index.restore(NS, b"c", 20, 3, 9.0, 0.0)         # over budget: the least valuable goes
    assert index.take_released() == [7] and index.stats.evictions["budget"] == 1
    index.check()


# ------------------------------------------------------------ the checker
def test_check_catches_broken_books():
    index = TierIndex(100, half_life=H)
    slot = demote(index, b"a")
    index._entries[slot].pins = 1       # pinned without the held bytes counted
    with pytest.raises(InvariantViolation):
        index.check()
    index._entries[slot].pins = 0
    index.check()
    index.bytes_used = 101
    with pytest.raises(InvariantViolation):
        index.check()


def test_counters_are_flat_and_named_by_reason():
    index = TierIndex(100, half_life=H)
    demote(index, b"a")
    assert findable(index, b"a") and not findable(index, b"b")
    counters = index.stats.counters()
    assert counters["demotions"] == 1 and counters["promotions"] == 1
    assert counters["evictions_value"] == 0 and counters["failures_torn"] == 0
    assert index.stats.hit_rate() == 0.5


# ------------------------------------------------- pins shared fairly (pins.py)
def tenants_index(n_blocks=8, nbytes=10, budget=100, **pins):
    """An index of ``n_blocks`` committed blocks ``b0``, ``b1``, ... with
    its pin bounds (``PinBooks``) set by ``pins``."""
    index = TierIndex(budget, half_life=H, pins=PinBooks(**pins))
    for i in range(n_blocks):
        demote(index, f"b{i}".encode(), nbytes=nbytes)
    return index


KEYS8 = [f"b{i}".encode() for i in range(8)]


def test_a_tenant_pins_no_more_than_its_share_of_the_budget_and_another_tenant_its_own():
    index = tenants_index()                      # 100 bytes: a tenant's share is 25, two 10-byte blocks
    first, cut = index.pin(NS, KEYS8, 0.0, tenant=1)
    assert len(first) == 2 and cut == "pin_share"               # what fits, the rest cut
    assert index.pin(NS, KEYS8, 0.0, tenant=1) == ([], "pin_share")     # nothing more: its share is taken
    assert len(index.pin(NS, KEYS8, 0.0, tenant=2)[0]) == 2             # another tenant's share is its own
    assert len(index.lookup(NS, KEYS8, 0.0)) == 8                       # an in-process caller: unbounded
    assert index.stats.refused["pin_share"] == 3
    assert index.held_bytes == 80                                      # every block pinned by someone
    index.check()
    index.unpin(first, tenant=1, now=0.0)
    assert len(index.pin(NS, KEYS8, 0.0, tenant=1)[0]) == 2             # its pins ended: room again
    index.check()


def test_what_one_tenant_pins_leaves_the_rest_of_the_tier_to_others_demotions():
    index = tenants_index()                      # 80 of 100 bytes used, nothing pinned
    for _ in range(10):                          # as much as it can, lookup after lookup
        index.pin(NS, KEYS8, 0.0, tenant=1)
    assert index.held_bytes == 20
    # Another tenant's 70-byte demotion evicts what tenant 1 does not pin.
    assert index.reserve("other", b"big", 70, 1.0, 1.0) is not None
    assert index.stats.rejected_full == 0
    index.check()


def test_a_tenants_pins_are_bounded_in_number_whatever_their_size():
    index = tenants_index(n_blocks=1, nbytes=1, max_pins=3)
    assert [len(index.pin(NS, [b"b0"], 0.0, tenant=1)[0]) for _ in range(4)] == [1, 1, 1, 0]
    assert index.pins.tenants[1].pins == 3 and index.stats.refused["pin_share"] == 1
    index.check()


def test_a_tenants_first_pin_fits_whatever_its_size():
    index = tenants_index(n_blocks=2, nbytes=40)           # a share (25 bytes) holds no block
    assert len(index.pin(NS, KEYS8[:2], 0.0, tenant=1)[0]) == 1
    assert index.pin(NS, KEYS8[:2], 0.0, tenant=1) == ([], "pin_share")
    index.check()


def test_new_lookups_keep_a_block_pinned_no_longer_than_max_pin_and_then_it_rests():
    index = tenants_index(n_blocks=1, max_pin=30.0)
    a = index.pin(NS, [b"b0"], 0.0, tenant=1)[0]
    b = index.pin(NS, [b"b0"], 29.0, tenant=1)[0]           # a new lease within the stretch: pinned
    assert a == b and index.pin(NS, [b"b0"], 30.0, tenant=1) == ([], "pin_held")   # not past it
    index.unpin(a, loaded=False, tenant=1, now=30.0)        # the first lease expired unloaded
    index.unpin(b, loaded=False, tenant=1, now=59.0)        # the second too: the stretch lasted 59 s
    assert index.pin(NS, [b"b0"], 59.0 + 58.9, tenant=1) == ([], "pin_held")        # rests as long
    assert index.pin(NS, [b"b0"], 59.0 + 59.0, tenant=2) == (a, "")
    assert index.stats.refused["pin_held"] == 2
    index.check()


def test_a_pin_that_ends_without_a_load_makes_the_block_rest_as_long_as_it_was_held():
    index = tenants_index(n_blocks=1)
    slots = index.pin(NS, [b"b0"], 0.0, tenant=1)[0]
    index.unpin(slots, loaded=None, tenant=1, now=10.0)     # released unused after 10 s
    assert index.pin(NS, [b"b0"], 19.0, tenant=1) == ([], "pin_held")
    assert index.pin(NS, [b"b0"], 20.0, tenant=1)[0] == slots
    # Its rest was the block's: evictable meanwhile, like any unpinned block.
    index.check()


def test_short_loads_never_rest_and_a_long_stretch_rests_even_when_loaded():
    index = tenants_index(n_blocks=1, max_pin=30.0)
    slots = index.pin(NS, [b"b0"], 0.0, tenant=1)[0]
    index.unpin(slots, loaded=True, tenant=1, now=0.5)      # a load that went well
    assert index.pin(NS, [b"b0"], 0.5, tenant=2)[0] == slots              # pinned again at once
    again = index.pin(NS, [b"b0"], 20.0, tenant=2)[0]
    index.unpin(slots, loaded=True, tenant=2, now=21.0)
    index.unpin(again, loaded=True, tenant=2, now=40.0)     # loaded, but pinned 39.5 s on end
    assert index.pin(NS, [b"b0"], 79.0, tenant=1) == ([], "pin_held")
    assert index.pin(NS, [b"b0"], 79.5, tenant=1)[0] == slots
    index.check()


def test_an_unpin_by_a_tenant_that_holds_no_such_pins_changes_nothing():
    index = tenants_index(n_blocks=1)
    slots = index.pin(NS, [b"b0"], 0.0, tenant=1)[0]
    before = snapshot(index)
    with pytest.raises(TierSlotState):
        index.unpin(slots, tenant=2, now=1.0)
    assert snapshot(index) == before and index.pins.tenants[1].pins == 1
    index.check()
