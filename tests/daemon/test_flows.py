"""Grow, shrink, reclaim and limits with a real daemon and real engine processes."""

import threading

from tests.daemon.books import SLAB, held
from tests.daemon_proc import MiB, wait_for


class BudgetSampler:
    """Samples the daemon's books throughout a test: invariant 2 at every sample."""

    def __init__(self, daemon):
        self.daemon, self.samples, self.violations = daemon, 0, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            s = self.daemon.status()
            used = s["memory"]["held"] + s["memory"]["free"]
            if used > s["budget_bytes"] or s["pages"]["created"] * s["page_size"] > s["budget_bytes"]:
                self.violations.append(s)
            for e in s["engines"]:
                if e["max_bytes"] and e["held_bytes"] > e["max_bytes"]:
                    self.violations.append(s)
            self.samples += 1
            self._stop.wait(0.01)

    def stop(self):
        self._stop.set()
        self._thread.join()
        assert self.samples > 5 and not self.violations, self.violations[:1]


def test_grow_maps_pages_into_the_worker(daemon, engines):
    e = engines(daemon, "e1")
    out = e.do("ensure", n=10)
    assert out["ok"] and len(out["state"]["slabs"]) == 3        # 4 blocks per slab
    assert out["state"]["mapped"] == 3                            # the worker mapped every page
    assert held(daemon, "e1") == 3 * SLAB
    values = e.do("write", value=42)["values"]
    assert values == [42, 42, 42]                                 # real memory behind the views


def test_shrink_returns_idle_slabs_after_grace(daemon, engines):
    e = engines(daemon, "e1", grace=0.3)
    assert e.do("ensure", n=12)["ok"]
    e.do("alloc", n=12)
    e.do("free")
    wait_for(lambda: held(daemon, "e1") == 0, timeout=5, what="idle slabs returned")
    state = e.state()
    assert state["slabs"] == [] and state["mapped"] == 0         # the worker unmapped them too
    s = daemon.status()
    assert s["memory"]["free"] == 3 * SLAB                       # pages back in the daemon
    assert s["engines"][0]["returns"] == 3


def test_reclaim_moves_cached_memory_to_the_engine_that_needs_it(daemon_factory, engines):
    daemon = daemon_factory(memory="16MiB")                        # 8 pages
    sampler = BudgetSampler(daemon)
    a = engines(daemon, "a", grace=60)
    b = engines(daemon, "b", grace=60)
    assert a.do("ensure", n=24)["ok"]                              # 6 slabs
    a.do("alloc", n=24)
    a.do("cache", prefix="p")
    a.do("free")                                                   # all cached, nothing live
    assert a.do("lookup", prefix="p", n=24)["hits"] == 24
    assert b.do("ensure", n=20)["ok"]                              # 5 slabs: 2 free + 3 reclaimed
    assert held(daemon, "b") == 5 * SLAB and held(daemon, "a") == 3 * SLAB
    state = a.state()
    assert len(state["slabs"]) == 3 and state["mapped"] == 3
    assert a.do("lookup", prefix="p", n=24)["hits"] < 24         # its cache gave way
    assert sum(e["reclaims"] for e in daemon.status()["engines"]) == 3
    assert b.do("write", value=7)["values"] == [7] * 5           # reused pages are usable
    sampler.stop()


def test_live_slabs_are_never_reclaimed(daemon_factory, engines):
    daemon = daemon_factory(memory="8MiB")                         # 4 pages
    a = engines(daemon, "a", grace=60)
    b = engines(daemon, "b", grace=60)
    assert a.do("ensure", n=16)["ok"]
    a.do("alloc", n=16)                                            # every block live
    out = b.do("ensure", n=4, timeout=3)
    assert not out["ok"] and out["state"]["slabs"] == []
    assert held(daemon, "a") == 4 * SLAB
    assert a.do("write", value=3)["values"] == [3] * 4


def test_limits_are_respected(daemon_factory, engines):
    daemon = daemon_factory(memory="16MiB")
    sampler = BudgetSampler(daemon)
    a = engines(daemon, "a", grace=60, min_bytes=4 * MiB, max_bytes=6 * MiB)
    b = engines(daemon, "b", grace=60)
    out = a.do("ensure", n=20)
    assert not out["ok"] and len(out["state"]["slabs"]) == 3    # capped at 6 MiB
    a.do("alloc", n=12)
    a.do("cache", prefix="q")
    a.do("free")
    b.do("ensure", n=100, timeout=3)                               # wants everything
    assert held(daemon, "a") == 4 * MiB                            # reclaimed down to its minimum
    assert held(daemon, "b") == 12 * MiB
    sampler.stop()


def test_pages_that_move_to_another_engine_are_fresh(daemon_factory, engines):
    daemon = daemon_factory(memory="8MiB")                         # 4 pages
    a = engines(daemon, "a", grace=60)
    assert a.do("ensure", n=16)["ok"]
    assert a.do("write", value=42)["values"] == [42] * 4
    a.kill()                                                       # its pages go back, dirty
    b = engines(daemon, "b", grace=60, namespace="other")
    assert b.do("ensure", n=16)["ok"]                              # a's 4 released, 4 fresh ones for b
    assert daemon.status()["pages"]["created"] == 4
    assert b.do("read")["values"] == [0, 0, 0, 0]                  # nothing of a's KV is visible
