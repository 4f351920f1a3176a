"""The reclaim order (``kvelastic/daemon/arbiter.py``) on hand-built books and,
with hypothesis, on random ones: tiers, LRU across the node, hard demand,
hold-down, minimums; fair shares, and the slabs drained for a requester
below its share."""

from hypothesis import given, settings
from hypothesis import strategies as st

from kvelastic.daemon.arbiter import Rules, Tier, fair_share, held_bytes, is_hard, pick_drains, pick_victims
from kvelastic.daemon.state import EngineRecord, Phase, SlabRecord

BPS = 4
PAGE = 2 << 20
RULES = Rules(idle_grace=5.0, hold_down=2.0)
NOW = 100.0


def engine(name: str, slabs: dict[int, tuple[int, int, int]], *, active_at: float = NOW,
           lru: dict[int, float] | None = None, min_slabs: int = 0, device: str = "0") -> EngineRecord:
    """An engine holding ``slabs`` (slab id -> (live, cached, free) blocks)."""
    e = EngineRecord(engine_id=name, namespace="ns", pid=1, page_size=PAGE, pages_per_worker=1, num_workers=1,
                     blocks_per_slab=BPS, block_bytes=PAGE // BPS, block_tokens=16, key_group_suffix=False,
                     min_bytes=min_slabs * PAGE, max_bytes=0, max_slabs=64, device=device, active_at=active_at)
    for slab_id, occ in slabs.items():
        e.slabs[slab_id] = SlabRecord(slab_id, [slab_id], [device], Phase.HELD, set())
        e.mirror.slabs[slab_id] = occ
        e.active[slab_id] = (lru or {}).get(slab_id, 0.0)
    return e


EMPTY, CACHED, LIVE = (0, 0, BPS), (0, 2, 2), (1, 1, 2)
IDLE = NOW - 60.0      # last active a minute ago: idle


def names(victims):
    return [(e.engine_id, s) for e, s in victims]


def test_the_order_is_idle_reserve_active_reserve_idle_cache_by_lru():
    requester = engine("r", {0: LIVE})                       # no cache of its own: hard demand
    idle = engine("idle", {1: EMPTY, 2: CACHED, 3: CACHED}, active_at=IDLE, lru={2: 50.0, 3: 10.0})
    active = engine("act", {4: EMPTY, 5: CACHED}, lru={5: 1.0})
    order = names(pick_victims([requester, idle, active], requester, 5, NOW, RULES))
    assert order == [("idle", 1), ("act", 4), ("idle", 3), ("idle", 2), ("act", 5)]


def test_lru_runs_across_idle_engines():
    requester = engine("r", {0: LIVE})
    a = engine("a", {1: CACHED, 2: CACHED}, active_at=IDLE, lru={1: 30.0, 2: 10.0})
    b = engine("b", {3: CACHED}, active_at=IDLE, lru={3: 20.0})
    assert names(pick_victims([requester, a, b], requester, 3, NOW, RULES)) == [("a", 2), ("b", 3), ("a", 1)]


def test_an_active_engines_cache_is_taken_only_when_the_requester_cannot_evict_its_own():
    rich = engine("r", {0: (0, 4, 0)})                       # 4 cached blocks: one slab's worth
    active = engine("act", {5: CACHED})
    assert not is_hard(rich, 1) and is_hard(rich, 2)
    assert pick_victims([rich, active], rich, 1, NOW, RULES) == []
    assert names(pick_victims([rich, active], rich, 2, NOW, RULES)) == [("act", 5)]


def test_never_a_live_slab_never_the_requester_never_another_device_never_below_the_minimum():
    requester = engine("r", {0: EMPTY, 1: CACHED}, active_at=IDLE)
    live = engine("live", {2: LIVE, 3: (3, 0, 1)}, active_at=IDLE)
    far = engine("far", {4: EMPTY}, active_at=IDLE, device="1")
    guarded = engine("min", {5: EMPTY, 6: EMPTY, 7: CACHED}, active_at=IDLE, min_slabs=2)
    victims = names(pick_victims([requester, live, far, guarded], requester, 10, NOW, RULES))
    assert victims == [("min", 5)]                           # one of three: it keeps its minimum of two


def test_hold_down_keeps_memory_where_it_just_went_whatever_the_demand():
    soft = engine("a", {0: (0, 4, 0)})                       # could evict its own cache instead
    took = engine("b", {1: EMPTY}, active_at=IDLE)
    other = engine("c", {2: CACHED}, lru={2: 5.0})
    took.received_from["a"] = NOW - 1.0                      # b got a slab of a's a second ago
    assert pick_victims([soft, took], soft, 1, NOW, RULES) == []
    assert names(pick_victims([soft, took, other], soft, 2, NOW, RULES)) == [("c", 2)]   # hard: from others
    took.received_from["a"] = NOW - RULES.hold_down - 0.1    # the hold-down is over
    assert names(pick_victims([soft, took], soft, 1, NOW, RULES)) == [("b", 1)]


def test_a_fair_share_splits_the_budget_among_the_active_engines_of_the_device():
    r = engine("r", {}, active_at=IDLE)                      # the requester counts, idle or not
    a, idle, far = engine("a", {}), engine("idle", {}, active_at=IDLE), engine("far", {}, device="1")
    assert fair_share([r, a, idle, far], r, 12 * PAGE, NOW, RULES) == 6 * PAGE
    assert fair_share([r], r, 12 * PAGE, NOW, RULES) == 12 * PAGE


def test_drains_come_from_engines_over_their_share_fewest_live_first_down_to_the_share():
    starved = engine("s", {0: (BPS, 0, 0)})                  # one slab, all live
    hog = engine("h", {1: (4, 0, 0), 2: (1, 0, 3), 3: (2, 0, 2), 4: (4, 0, 0), 5: (3, 0, 1)})
    fair = 3 * PAGE
    got = [(e.engine_id, s) for e, slabs in pick_drains([starved, hog], starved, 4, fair, {}) for s in slabs]
    assert got == [("h", 2), ("h", 3)]                       # s is due 2 more, h may give 2: s asked for 4
    got = [(e.engine_id, s) for e, slabs in pick_drains([starved, hog], starved, 1, 2 * PAGE, {}) for s in slabs]
    assert got == [("h", 2)]                                 # one slab asked: the emptiest
    assert pick_drains([starved, hog], starved, 1, 2 * PAGE, {"h": {1, 2, 3}}) == []   # h at its share already
    assert pick_drains([starved, hog], starved, 4, PAGE, {}) == []                     # s holds its share


def test_no_drain_below_an_engines_minimum_nor_across_devices():
    starved = engine("s", {})
    guarded = engine("g", {1: LIVE, 2: LIVE, 3: LIVE}, min_slabs=3)
    far = engine("far", {4: LIVE, 5: LIVE, 6: LIVE}, device="1")
    assert pick_drains([starved, guarded, far], starved, 2, PAGE, {}) == []


def test_excluded_slabs_are_not_asked_for():
    requester = engine("r", {0: LIVE})
    idle = engine("idle", {1: EMPTY, 2: EMPTY}, active_at=IDLE)
    assert names(pick_victims([requester, idle], requester, 2, NOW, RULES, frozenset({("idle", 1)}))) == [("idle", 2)]


occupancy = st.sampled_from([EMPTY, CACHED, LIVE, (0, BPS, 0), (BPS, 0, 0)])


@st.composite
def books(draw):
    engines = []
    slab_id = 0
    for i in range(draw(st.integers(2, 5))):
        slabs, lru = {}, {}
        for _ in range(draw(st.integers(0, 5))):
            slabs[slab_id] = draw(occupancy)
            lru[slab_id] = draw(st.floats(0, NOW))
            slab_id += 1
        e = engine(f"e{i}", slabs, active_at=draw(st.sampled_from([IDLE, NOW - 1.0])), lru=lru,
                   min_slabs=draw(st.integers(0, 2)))
        if draw(st.booleans()):
            e.received_from["e0"] = NOW - draw(st.floats(0, 4))
        engines.append(e)
    return engines, draw(st.integers(1, 8))


def tier_of(e: EngineRecord, slab_id: int) -> Tier:
    idle = NOW - e.active_at >= RULES.idle_grace
    if e.mirror.slabs[slab_id][1]:
        return Tier.IDLE_CACHED if idle else Tier.ACTIVE_CACHED
    return Tier.IDLE_EMPTY if idle else Tier.ACTIVE_EMPTY


@settings(max_examples=300, deadline=None)
@given(books())
def test_random_books_keep_every_rule(drawn):
    engines, wanted = drawn
    requester = engines[0]
    hard = is_hard(requester, wanted)
    victims = pick_victims(engines, requester, wanted, NOW, RULES)
    chosen = {(e.engine_id, s) for e, s in victims}
    assert len(chosen) == len(victims) <= wanted                         # each once, no more than asked
    for e, s in victims:
        assert e is not requester and e.mirror.slabs[s][0] == 0          # never the requester, never live
        assert hard or tier_of(e, s) is not Tier.ACTIVE_CACHED           # another's active cache: hard only
        assert NOW - e.received_from.get("e0", -1e9) >= RULES.hold_down      # the hold-down, always
    for e in engines:
        kept = len(e.slabs) - sum(1 for v, _ in victims if v is e)
        assert kept * PAGE >= e.min_bytes or kept == len(e.slabs)        # never below a minimum
    # The order: no candidate left behind ranks before one taken, unless its
    # engine was at its minimum.
    worst = max(((tier_of(e, s), e.active[s]) for e, s in victims), default=None)
    if worst is None or len(victims) < wanted:
        return
    for e in engines[1:]:
        if NOW - e.received_from.get("e0", -1e9) < RULES.hold_down:
            continue
        for s, occ in e.mirror.slabs.items():
            if (e.engine_id, s) in chosen or occ[0] or (not hard and tier_of(e, s) is Tier.ACTIVE_CACHED):
                continue
            taken = sum(1 for v, _ in victims if v is e)
            if (len(e.slabs) - taken - 1) * PAGE < e.min_bytes:
                continue
            assert (tier_of(e, s), e.active[s]) >= worst, f"{e.engine_id}:{s} skipped for a worse victim"


@settings(max_examples=300, deadline=None)
@given(books(), st.integers(1, 6))
def test_random_drains_leave_every_engine_at_or_above_its_share(drawn, share_slabs):
    engines, wanted = drawn
    requester, fair = engines[0], share_slabs * PAGE
    drains = pick_drains(engines, requester, wanted, fair, {})
    if held_bytes(requester) >= fair:
        assert drains == []
    asked = sum(len(slabs) for _, slabs in drains)
    assert asked <= wanted and asked * PAGE <= max(0, fair - held_bytes(requester)) + PAGE
    for e, slabs in drains:
        assert e is not requester and len(set(slabs)) == len(slabs) and set(slabs) <= set(e.slabs)
        assert held_bytes(e) - len(slabs) * PAGE >= max(fair, e.min_bytes)
        others = sorted(occ[0] for s, occ in e.mirror.slabs.items() if s not in slabs)
        assert not others or max(e.mirror.slabs[s][0] for s in slabs) <= others[0]   # fewest live first
