"""Arbitration on the simulated node (the real ``Allocator``, simulated engines
and workers on a fake clock): the issue's scenario (a flood beside an idle
warm cache), reserve against demand, idle engines, hold-down and thrash."""

from kvelastic import protocol as p
from kvelastic.daemon.requests import Timing
from kvelastic_tools.sim.world import BLOCKS_PER_SLAB, SimEngine, World

GRACE = 1.0
HOLD = 2.0


def node(engines: int = 2, pages: int = 6) -> World:
    w = World(seed=1, engines=0, budget_pages=pages, timing=Timing(idle_grace=GRACE, hold_down=HOLD),
              tier=False)                 # its engines cache blocks they never wrote: no KV to demote
    w.delay = lambda: 0.001                       # a quiet, fast network: only the policy is under test
    w.engines = [SimEngine(w, f"e{i}", workers=1, demand_share=0.0) for i in range(engines)]
    for e in w.engines:
        e.start()
    advance(w, 0.1)
    return w


def advance(w: World, seconds: float) -> None:
    end = w.now + seconds
    while w.now < end:
        w.now += 0.01
        w.deliver()
        if round(w.now * 100) % 10 == 0:
            w.perform(w.allocator.tick(w.now))
            for e in w.engines:
                w.client_send(e.identity, p.Heartbeat(engine_id=e.name))
    assert not w.violations, w.violations


def grow(w: World, e: SimEngine, slabs: int, demand: bool) -> None:
    e.grow(slabs, demand=demand)
    advance(w, 0.3)


def fill(w: World, e: SimEngine, blocks: int, cache_as: str | None = None) -> list:
    """Allocate ``blocks`` (live); with ``cache_as`` cache and free them at once."""
    got = e.pool.allocate(blocks)
    if cache_as is not None:
        e.pool.cache(got, [f"{cache_as}:{i}".encode() for i in range(blocks)])
        e.pool.free(got)
    e.flush_journal()
    advance(w, 0.05)
    return got


def reclaims_sent(w: World) -> int:
    return sum(r.reclaims for r in w.allocator.engines.values())


def test_an_idle_engines_warm_cache_yields_to_a_flood_and_nothing_ping_pongs():
    w = node(pages=6)
    busy, idle = w.engines
    grow(w, idle, 2, demand=True)
    fill(w, idle, 2 * BLOCKS_PER_SLAB, cache_as="warm")           # two slabs of warm cache
    grow(w, busy, 4, demand=True)                                 # the rest of the budget
    assert busy.pool.num_slabs == 4 and w.allocator.pools["0"].creatable() == 0
    advance(w, GRACE + 0.2)                                       # idle goes idle; busy stays busy
    live = []
    for _ in range(4):                                            # the flood: unique prompts, live blocks
        live.append(fill(w, busy, busy.pool.num_free))
        grow(w, busy, 1, demand=True)
        advance(w, 0.2)
    # The idle engine's cache yielded, the busy engine got it, nothing went back.
    assert idle.pool.num_slabs == 0 and busy.pool.num_slabs == 6
    assert w.allocator.moves["0"] == 2 and w.allocator.thrash["0"] == 0
    # The flood ends: busy gives its memory back.
    for blocks in live:
        busy.pool.free(blocks)
    returned = busy.pool.idle_slabs()
    for slab_id in returned:
        busy.pool.take_slab_back(slab_id, reason="return")
    busy.flush_journal()
    busy.send(p.Return(engine_id=busy.name, slabs=returned))
    advance(w, 0.3)
    assert busy.pool.num_slabs == 0 and len(w.allocator.pools["0"].free) == 6
    # Memory is free, yet the idle engine does not refill a reserve while idle.
    before = w.allocator.engines["e1"].grants
    idle.grow(1, demand=False)
    advance(w, 0.5)
    assert w.allocator.engines["e1"].grants == before and idle.pool.num_slabs == 0
    idle.grow(1, demand=True)                                     # demand is served, and wakes it
    advance(w, 0.5)
    assert idle.pool.num_slabs == 1 and not w.allocator.status().engines[1].idle


def test_a_reserve_refill_never_reclaims_only_demand_does():
    w = node(pages=4)
    a, b = w.engines
    grow(w, b, 2, demand=True)
    fill(w, b, 2 * BLOCKS_PER_SLAB, cache_as="b")
    grow(w, a, 2, demand=True)
    fill(w, a, 2 * BLOCKS_PER_SLAB)                               # a is full of live blocks
    grow(w, a, 1, demand=False)
    assert reclaims_sent(w) == 0 and a.pool.num_slabs == 2        # reserve: free memory only
    grow(w, a, 1, demand=True)
    assert reclaims_sent(w) == 1 and a.pool.num_slabs == 3        # demand: b's cache yields


def test_hold_down_then_a_move_back_without_thrash():
    """a takes b's slab with hard demand. Within the hold-down nothing moves
    back to b, not even for its hard demand (its grow comes back short); once
    the hold-down is over b's hard demand takes it back, and that is not
    thrash (thrash is a move back within a second)."""
    w = node(pages=4)
    a, b = w.engines
    grow(w, a, 1, demand=True)
    grow(w, b, 3, demand=True)
    fill(w, a, BLOCKS_PER_SLAB)                                   # a: one slab, all live
    for n in range(3):
        fill(w, b, BLOCKS_PER_SLAB, cache_as=f"b{n}")             # b: three cached slabs
    grow(w, a, 1, demand=True)                                    # hard: a has no cache to evict
    assert (a.pool.num_slabs, b.pool.num_slabs, w.allocator.moves["0"]) == (2, 2, 1)
    grow(w, b, 1, demand=True)                                    # soft: b still caches two slabs
    fill(w, b, b.pool.num_available)                              # b evicts its cache: all live now
    grow(w, b, 1, demand=True)                                    # hard, but within the hold-down
    assert (a.pool.num_slabs, b.pool.num_slabs, w.allocator.moves["0"]) == (2, 2, 1)
    assert w.allocator.status().engines[1].starved_seconds > 0    # b is starved, and it shows
    advance(w, HOLD)
    grow(w, b, 1, demand=True)                                    # after the hold-down: allowed
    assert (a.pool.num_slabs, b.pool.num_slabs) == (1, 3)
    assert w.allocator.moves["0"] == 2 and w.allocator.thrash["0"] == 0
    status = w.allocator.status()
    assert status.devices[0].slab_moves == 2 and status.devices[0].thrash == 0
    assert status.engines[1].starved_seconds == 0                 # fed again


def test_a_move_back_within_a_second_counts_as_thrash():
    """With no hold-down configured, a move back within a second is counted."""
    w = World(seed=1, engines=0, budget_pages=4, timing=Timing(idle_grace=GRACE, hold_down=0.0), tier=False)
    w.delay = lambda: 0.001
    w.engines = [SimEngine(w, f"e{i}", workers=1, demand_share=0.0) for i in range(2)]
    for e in w.engines:
        e.start()
    advance(w, 0.1)
    a, b = w.engines
    grow(w, a, 1, demand=True)
    grow(w, b, 3, demand=True)
    fill(w, a, BLOCKS_PER_SLAB)
    for n in range(3):
        fill(w, b, BLOCKS_PER_SLAB, cache_as=f"b{n}")
    grow(w, a, 1, demand=True)
    fill(w, b, b.pool.num_available)
    grow(w, b, 1, demand=True)
    assert w.allocator.moves["0"] == 2 and w.allocator.thrash["0"] == 1
