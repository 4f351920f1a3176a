"""A cached slab that moves to another engine of the same namespace keeps its
KV and its keys: the pages are not zeroed, and the receiver's pool adopts the
blocks as cached, so its first lookups hit. Across namespaces (the tenant
salt is part of one) the pages are fresh and nothing is adopted. Real
daemon, engine and worker processes (host pages)."""

import threading

import pytest

from kvelastic import protocol as p
from tests.daemon.books import parse_metrics, value
from tests.daemon_proc import wait_for


def engine_stats(daemon, engine_id: str) -> dict:
    return next(e for e in daemon.status()["engines"] if e["engine_id"] == engine_id)["stats"]


def warm_giver(daemon, engines):
    """Engine a fills the device's one slab with 4 cached blocks over bytes it wrote."""
    a = engines(daemon, "a", namespace="llama-1", grace=60)
    assert a.do("ensure", n=4)["ok"]
    a.do("alloc", n=4)
    assert a.do("write", value=7)["values"] == [7]
    a.do("cache", prefix="sys")
    a.do("free")
    assert a.state()["cached"] == 4
    return a


def test_a_cached_slab_handed_to_a_replica_carries_its_hits(daemon_factory, engines):
    daemon = daemon_factory(memory="2MiB")                          # one slab
    a = warm_giver(daemon, engines)
    b = engines(daemon, "b", namespace="llama-1", grace=60)
    got = b.do("ensure", n=4, timeout=5)           # hard demand (b caches nothing): a's slab moves
    assert got["ok"], got
    assert a.state()["slabs"] == [] and a.state()["cached"] == 0
    assert b.do("lookup", prefix="sys", n=4)["hits"] == 4           # a's prefix, served by b
    assert b.do("read")["values"] == [7]                            # the same bytes: not zeroed
    wait_for(lambda: engine_stats(daemon, "b")["adopted_blocks"] == 4, what="b's journal")
    def scraped():
        m = parse_metrics(daemon.metrics())
        return m if m.get(("kvelastic_adopted_blocks_total", frozenset({"device": "0", "engine": "b"}.items()))) == 4 \
            else None

    samples = wait_for(scraped, what="the scrape to show b's adopted blocks")
    assert value(samples, "kvelastic_adopted_blocks_total", device="0", engine="a") == 0


@pytest.mark.parametrize("namespace", ["llama-1-tenant-b", "mistral-7"])
def test_across_namespaces_the_pages_are_fresh_and_nothing_is_adopted(daemon_factory, engines, namespace):
    daemon = daemon_factory(memory="2MiB")
    warm_giver(daemon, engines)
    c = engines(daemon, "c", namespace=namespace, grace=60)
    assert c.do("ensure", n=4, keep_cache=True, timeout=5)["ok"]
    assert c.do("lookup", prefix="sys", n=4)["hits"] == 0
    assert c.do("read")["values"] == [0]                            # nothing of a's KV is visible
    assert engine_stats(daemon, "c")["adopted_blocks"] == 0


def test_a_reclaim_answered_after_an_invalidation_hands_on_pages_without_keys(daemon_factory, engines):
    """The namespace is invalidated after the daemon asked a for its slab but
    before a answered (its scheduler held the pool): a lists its cached
    blocks as they were before, so b gets the pages and none of the keys."""
    daemon = daemon_factory(memory="2MiB")                          # one slab
    a = warm_giver(daemon, engines)
    b = engines(daemon, "b", namespace="llama-1", grace=60)
    a.do("hold")                                                    # a is mid-step: the Reclaim waits
    grown = {}
    grow = threading.Thread(target=lambda: grown.update(b.do("ensure", n=4, timeout=10)))
    grow.start()
    wait_for(lambda: "asked to give up 1 slab(s) for engine b" in daemon.log(), what="the reclaim sent")
    assert isinstance(daemon.request(p.Invalidate(target="llama-1")), p.Invalidated)
    a.do("release")                                                 # answers the Reclaim, then the ClearIndex
    grow.join(30)
    assert grown.get("ok"), grown
    assert b.do("lookup", prefix="sys", n=4)["hits"] == 0           # no key from before the invalidation
    assert engine_stats(daemon, "b")["adopted_blocks"] == 0
