"""Arbitration with real processes: a real daemon (host pages), engine
processes with real workers. An idle engine's reserve decays and it never
grows; its warm cache yields to another engine's demand at once, without a
model step; moves and thrash are counted on /metrics. An engine that holds
every slab live yields, as its requests finish, what another's unmet demand
is due of a fair share, and takes none of it back meanwhile."""

import time

from kvelastic import protocol as p
from kvelastic.status_report import EngineStatus
from tests.daemon.books import parse_metrics, value
from tests.daemon_proc import wait_for

SLAB = 2 << 20
GRACE = 0.5


def engine_status(daemon, engine_id: str) -> EngineStatus | None:
    report = daemon.request(p.Status()).status
    return next((e for e in report.engines if e.engine_id == engine_id), None)


def test_an_idle_engine_decays_its_reserve_and_yields_its_cache_without_a_step(daemon_factory, engines):
    daemon = daemon_factory(memory="8MiB", KVELASTIC_IDLE_GRACE=f"{GRACE}s")   # four slabs
    warm = engines(daemon, "warm", low_watermark=4, grace=0.2)      # keeps a one-slab reserve while active
    assert warm.do("ensure", n=8)["ok"]
    warm.do("alloc", n=8)
    warm.do("cache", prefix="sys")
    warm.do("free")                                                 # two cached slabs
    wait_for(lambda: engine_status(daemon, "warm").slabs == 3, what="warm's reserve refill")
    # Idle: the reserve slab goes back, the cached ones stay, and it grows no more.
    wait_for(lambda: engine_status(daemon, "warm").idle, timeout=3, what="warm idle")
    wait_for(lambda: engine_status(daemon, "warm").slabs == 2, timeout=3, what="warm's reserve decayed")
    grants = engine_status(daemon, "warm").grants
    time.sleep(2 * GRACE)
    assert engine_status(daemon, "warm").grants == grants and warm.state()["cached"] == 8

    busy = engines(daemon, "busy", grace=60)
    assert busy.do("ensure", n=8)["ok"]                             # the rest of the budget
    busy.do("alloc", n=8)                                           # all live
    # Demand beyond the budget: the idle engine's cache yields, through its
    # I/O thread (the warm engine process runs no step at all).
    got = busy.do("ensure", n=8, keep_cache=True, timeout=5)     # 8 free blocks: two more slabs
    assert got["ok"] and got["seconds"] < 1.0, got
    assert warm.state()["slabs"] == [] and warm.state()["cached"] == 0
    status = daemon.request(p.Status()).status
    assert status.devices[0].slab_moves == 2 and status.devices[0].thrash == 0
    samples = wait_for(lambda: (m := parse_metrics(daemon.metrics()))
                       and value(m, "kvelastic_slab_moves_total", device="0") == 2 and m, what="the scrape")
    assert value(samples, "kvelastic_slab_thrash_total", device="0") == 0
    assert value(samples, "kvelastic_engine_idle", device="0", engine="warm") == 1
    assert value(samples, "kvelastic_engine_idle", device="0", engine="busy") == 0
    assert value(samples, "kvelastic_demand_wait_seconds_count", device="0") >= 3


def test_an_active_engine_keeps_its_cache_when_the_other_can_evict_its_own(daemon_factory, engines):
    """No ping-pong of caches: soft demand (the requester's own cache covers
    it) takes nothing from an active engine; starvation shows only for hard demand."""
    daemon = daemon_factory(memory="8MiB", KVELASTIC_IDLE_GRACE="30s")
    a = engines(daemon, "a", grace=60)
    b = engines(daemon, "b", grace=60)
    for e, prefix in ((a, "a"), (b, "b")):
        assert e.do("ensure", n=8)["ok"]
        e.do("alloc", n=8)
        e.do("cache", prefix=prefix)
        e.do("free")                                                # two cached slabs each
    time.sleep(0.2)                                                 # the daemon's mirror has both journals
    got = a.do("ensure", n=8, keep_cache=True, timeout=2)          # a could evict its own 8 cached blocks
    assert not got["ok"]
    assert b.state()["cached"] == 8 and a.state()["cached"] == 8
    assert daemon.request(p.Status()).status.devices[0].slab_moves == 0
    assert engine_status(daemon, "a").starved_seconds == 0.0       # soft demand: not starved
    a.do("alloc", n=8)                                              # a's cache is live now
    got = a.do("ensure", n=4, keep_cache=True, timeout=2)          # hard: b's active cache yields
    assert got["ok"] and b.state()["cached"] == 4
    assert daemon.request(p.Status()).status.devices[0].slab_moves == 1


def test_an_engine_holding_everything_live_drains_to_its_fair_share_for_a_starved_one(daemon_factory, engines):
    """Without drains the hog's queue would take every block its finished
    requests free, and the other engine would wait for as long as it has one."""
    daemon = daemon_factory(memory="8MiB", KVELASTIC_IDLE_GRACE="30s")   # four slabs: a share of two each
    hog = engines(daemon, "hog", grace=60)
    assert hog.do("ensure", n=16)["ok"]
    hog.do("alloc", n=16)                                          # every block of the node live
    starved = engines(daemon, "starved", grace=60)
    assert not starved.do("ensure", n=4, timeout=1)["ok"]           # nothing to reclaim: all live
    # Starved past the hold-down (2 s), the daemon asks the hog to drain what
    # the starved engine is due (one slab asked, two over the share): no block
    # of it is the hog's to hand out now.
    state = wait_for(lambda: (st := hog.state())["draining"] and st or starved.do("ensure", n=4, timeout=0.3)
                     and None, timeout=30, what="the hog's drain")
    assert len(state["draining"]) == 1 and state["live"] == 16 and state["free"] == 0
    assert engine_status(daemon, "starved").starved_seconds > 0
    hog.do("free")                                                 # its requests finish
    state = wait_for(lambda: len((st := hog.state())["slabs"]) == 3 and st, what="the drained slab given back")
    assert state["draining"] == [] and state["withheld"] == 0 and state["free"] == 12
    assert not hog.do("ensure", n=16, timeout=1)["ok"]             # over its share: it takes nothing back
    got = starved.do("ensure", n=4, timeout=5)
    assert got["ok"], got
    assert starved.state()["slabs"] and len(hog.state()["slabs"]) == 3
    assert wait_for(lambda: engine_status(daemon, "starved").starved_seconds == 0.0 or None,
                    what="the starved engine's demand met")
