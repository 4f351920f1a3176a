"""Random sequences on a TierIndex of two levels (host memory over the disk),
checked against a model of what each level holds.

Every block enters the top level (or the one below where what the top
holds in flight leaves it too little). Making room there moves the least
valuable blocks down (they stay findable, their bytes moved by the store:
``take_moves``, reported back by ``moved`` or a failed move's ``drop``)
rather than evicting them; only the last level evicts, leaves first. After
every step ``check()`` holds (each level within its budget, held bytes per
level, heaps per level), and the model agrees: which blocks are in the tier
and on which level, that a block leaves only by eviction at the last level
(or from the top when nothing below can take it), invalidation or a drop;
that what moves down is of least value at the top when it moves; and that a
lookup finds the leading run of committed blocks whatever their level,
a moving one included.
"""

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvelastic.tier.index import TierIndex
from kvelastic.tier.pins import PinBooks

TOP, LOWER = 60, 100
NAMESPACES = st.sampled_from(["ns-a", "ns-b"])
KEYS = st.sampled_from([b"k0", b"k1", b"k2", b"k3", b"k4", b"k5", b"k6", b"k7"])
SIZES = st.sampled_from([10, 20, 30])
COSTS = st.sampled_from([1.0, 2.0, 5.0, 100.0])
STEPS = st.sampled_from([0.0, 1.0, 50.0, 500.0])


class LevelsMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        # Pins without bounds: their limits are test_index_stateful's; levels are this test's.
        self.index = TierIndex(TOP, half_life=100.0, media=("host", "disk"), lower_bytes=LOWER,
                               pins=PinBooks(1.0, 1 << 20, 1e12))
        self.now = 0.0
        self.blocks: dict[int, dict] = {}       # slot -> ns, key, parent, nbytes, level, committed, moving, dead
        self.loads: list[list[int]] = []

    # ----------------------------------------------------------- helpers
    def live(self, ns, key):
        return next((s for s, b in self.blocks.items() if (b["ns"], b["key"]) == (ns, key) and not b["dead"]), None)

    def pinned(self, slot):
        return sum(load.count(slot) for load in self.loads)

    def top_evictable(self):
        return [s for s, b in self.blocks.items() if b["level"] == 0 and b["committed"] and not b["dead"]
                and not self.pinned(s)]

    def settle(self, values_at_top=None):
        """Apply the index's moves and releases to the model: a move takes a
        top block of least value among those left (``values_at_top``, taken
        before the operation); a release frees a block or marks a dead one gone."""
        moves, released = self.index.take_moves(), self.index.take_released()
        for slot in moves:
            b = self.blocks[slot]
            assert b["level"] == 0 and b["committed"] and not b["dead"] and not self.pinned(slot), (slot, b)
            if values_at_top is not None:      # of least value among those still at the top
                left = [values_at_top[s] for s in self.top_evictable() if s not in released]
                assert values_at_top[slot] <= min(left) * (1 + 1e-9), (slot, values_at_top)
            b["level"], b["moving"] = 1, True
            assert self.index.level_of(slot) == 1 and self.index.moving(slot)
        for slot in released:
            b = self.blocks[slot]
            if b["dead"] and (self.pinned(slot) or not b["committed"] or b["moving"]):
                b["gone"] = True                 # a load, a write or a move holds it: it stays in the books
            else:
                del self.blocks[slot]

    # ------------------------------------------------------------- rules
    @rule(dt=STEPS)
    def advance(self, dt):
        self.now += dt

    @rule(ns=NAMESPACES, key=KEYS, nbytes=SIZES, cost=COSTS, parent=st.none() | KEYS, commit=st.booleans())
    def reserve(self, ns, key, nbytes, cost, parent, commit):
        parent = None if parent == key else parent
        values = {s: self.index.value(s, self.now) for s in self.top_evictable()}
        was_live = self.live(ns, key) is not None
        top_room, lower_room = TOP - self.index.level_held[0], LOWER - self.index.level_held[1]
        slot = self.index.reserve(ns, key, nbytes, cost, self.now, parent)
        self.settle(values)
        if was_live:
            assert slot is None
        if slot is not None:
            level = self.index.level_of(slot)
            # The top, unless what it holds (writes, loads, moves in flight) leaves too little, or
            # a block it would move down found no room below.
            assert level == 0 or nbytes > top_room or lower_room < 2 * max(SIZES.elements), (level, top_room)
            self.blocks[slot] = dict(ns=ns, key=key, parent=parent, nbytes=nbytes, level=level, committed=False,
                                     moving=False, dead=False, gone=False)
            if commit:
                assert self.index.commit(slot)
                self.blocks[slot]["committed"] = True

    @rule(data=st.data())
    def commit(self, data):
        pending = sorted(s for s, b in self.blocks.items() if not b["committed"])
        if pending:
            slot = data.draw(st.sampled_from(pending))
            b = self.blocks[slot]
            assert self.index.commit(slot) == (not b["dead"])
            if b["dead"]:
                del self.blocks[slot]
            else:
                b["committed"] = True

    @rule(data=st.data(), ok=st.booleans())
    def move_done(self, data, ok):
        """The store moved a block's bytes down (or failed to: it is dropped)."""
        moving = sorted(s for s, b in self.blocks.items() if b["moving"])
        if not moving:
            return
        slot = data.draw(st.sampled_from(moving))
        b = self.blocks[slot]
        if ok:                                   # a dead one's move was cancelled by its delete: done too
            assert self.index.moved(slot) == (not b["dead"])
        else:
            self.index.drop(slot, "io")
            if not b["dead"]:
                b["dead"] = True
                self.settle()
        b["moving"] = False
        if slot in self.blocks and b["dead"] and not self.pinned(slot):
            del self.blocks[slot]

    @rule(ns=NAMESPACES, data=st.data())
    def lookup(self, ns, data):
        keys = data.draw(st.lists(KEYS, min_size=1, max_size=4, unique=True))
        expected = []
        for key in keys:
            slot = self.live(ns, key)
            if slot is None or not self.blocks[slot]["committed"]:
                break
            expected.append(slot)
        got = self.index.lookup(ns, keys, self.now)
        assert got == expected, (got, expected)
        if got:
            self.loads.append(got)

    @rule(data=st.data())
    def unpin(self, data):
        """A load ended well (one that did not makes its blocks rest: test_index_stateful's)."""
        if self.loads:
            load = self.loads.pop(data.draw(st.integers(0, len(self.loads) - 1)))
            self.index.unpin(load, loaded=True, now=self.now)
            for slot in set(load):
                b = self.blocks[slot]
                if b["dead"] and not self.pinned(slot) and not b["moving"]:
                    del self.blocks[slot]

    @rule(ns=NAMESPACES)
    def invalidate(self, ns):
        n = self.index.invalidate(ns)
        mine = [s for s, b in self.blocks.items() if b["ns"] == ns and not b["dead"]]
        assert n == len(mine)
        for slot in mine:
            self.blocks[slot]["dead"] = True
        self.settle()

    @invariant()
    def agrees_with_the_model(self):
        self.index.check()
        live = {s for s, b in self.blocks.items() if not b["dead"]}
        assert sum(self.index.namespaces().values()) == len(live)
        for slot in live:
            b = self.blocks[slot]
            assert self.index.level_of(slot) == b["level"] and self.index.moving(slot) == b["moving"]
        for level, budget in enumerate((TOP, LOWER)):
            assert self.index.level_used[level] == sum(b["nbytes"] for b in self.blocks.values()
                                                       if b["level"] == level) <= budget


LevelsMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestLevels = LevelsMachine.TestCase


def test_a_full_top_moves_its_least_valuable_block_down_and_it_stays_findable():
    index = TierIndex(20, media=("host", "disk"), lower_bytes=100)
    cheap = index.reserve("ns", b"cheap", 10, 1.0, 0.0)
    dear = index.reserve("ns", b"dear", 10, 50.0, 0.0)
    index.commit(cheap)
    index.commit(dear)
    new = index.reserve("ns", b"new", 10, 5.0, 0.0)
    assert new is not None and index.take_moves() == [cheap] and index.take_released() == []
    assert (index.level_of(cheap), index.level_of(dear), index.level_of(new)) == (1, 0, 0)
    assert index.lookup("ns", [b"cheap"], 1.0) == [cheap]        # findable while its bytes move
    assert index.moved(cheap) and index.stats.moved_down == index.stats.moves == 1
    index.check()


def test_the_last_level_evicts_for_good_and_one_level_moves_nothing():
    index = TierIndex(10, media=("host", "disk"), lower_bytes=10)
    slots = []
    for i, key in enumerate([b"a", b"b", b"c"]):
        slots.append(index.reserve("ns", key, 10, 1.0 + i, float(i)))
        index.commit(slots[-1])
        for slot in index.take_moves():
            index.moved(slot)
    assert index.take_released() == [slots[0]]                    # host, then disk, then gone
    assert [index.level_of(s) for s in slots[1:]] == [1, 0]
    single = TierIndex(10)
    first = single.reserve("ns", b"a", 10, 1.0, 0.0)
    single.commit(first)
    single.reserve("ns", b"b", 10, 1.0, 1.0)
    assert single.take_moves() == [] and single.take_released() == [first]
