"""Demotion source B ("the engine evicts it under pressure"),
in a real daemon process with real engine and worker processes
(``tests/daemon/peer.py``, host pages): the blocks a running engine is about
to evict (its journal marks them ``DEMOTE``) are copied by the daemon while
still cached, and written to the tier once the engine's next journal
acknowledges the copy; another engine of the namespace loads them back byte
for byte after the first evicted and rewrote them. A block the engine
evicts and rewrites before it acknowledged the copy is discarded, never
written; so are the copies of an engine killed before it acknowledged."""

from __future__ import annotations

import pytest

from kvelastic import protocol as p
from tests.daemon.engines import EngineProcess
from tests.daemon_proc import DaemonProcess, short_dir, wait_for
from tests.tier.test_tier_daemon_flow import BLOCK, fetch, keys, tier

pytestmark = pytest.mark.skipif(__import__("tests.backend").backend.TEST_BACKEND != "host",
                                reason="the daemon reads running engines' memfd pages: host backend")

KEEP = {"grace": 60, "journal_interval": 3600}     # journals when told (``flush``), or to carry an ack
REGION = BLOCK // 2                                # a block's run in each of its two layer regions


class Node:
    """A daemon with a tier and one slab of budget (two 2 MiB pages, 4 blocks)."""

    def __init__(self, tmp_path) -> None:
        self.folder = short_dir(tmp_path) / "tier"
        self.folder.mkdir(mode=0o700)
        self.daemon = DaemonProcess(tmp_path, memory="4MiB", KVELASTIC_TIER_DIR=str(self.folder),
                                    KVELASTIC_TIER_SIZE="64MiB", KVELASTIC_ORPHAN_CACHE_TTL="0").start()
        self.engines: list[EngineProcess] = []

    def engine(self, engine_id: str, namespace: str = "llama-1") -> EngineProcess:
        e = EngineProcess(self.daemon.socket, engine_id, namespace=namespace, ppw=2, bps=4, low_watermark=4,
                          **KEEP)
        self.engines.append(e)
        return e

    def close(self) -> None:
        for e in self.engines:
            e.close()
        self.daemon.stop()


def step(e: EngineProcess, prefix: str, value: int) -> None:
    """One model step that caches 4 blocks under ``prefix`` (evicting what it
    must) and writes ``value + k`` into block k; its blocks stay cached."""
    n = e.do("step")["step"]
    assert e.do("alloc", n=4)["ok"]
    e.do("cache", prefix=prefix)
    e.do("seal")
    e.do("write_blocks", value=value)
    e.do("end_step", n=n)
    e.do("free")


def under_pressure(e: EngineProcess) -> None:
    """``old`` cached in the engine's one slab: no block is free, so its next
    journal demotes the 4 blocks of ``old``, the next to be evicted (with a
    tier, an engine demotes ahead of any eviction)."""
    assert e.do("ensure", n=4)["ok"]
    step(e, "old", 20)


def copied_not_acknowledged(node: Node) -> EngineProcess:
    """Engine ``a`` under pressure with its pool held (no tick ships the ack
    meanwhile): its journal demoted 4 blocks, which the daemon copied, and
    sent the ticket for."""
    a = node.engine("a")
    under_pressure(a)
    a.do("hold")
    assert a.do("flush")["state"]["demoted"] == 4
    return a


def test_blocks_a_running_engine_evicts_reach_the_tier_and_another_engine_loads_them(tmp_path):
    node = Node(tmp_path)
    try:
        a = node.engine("a")
        under_pressure(a)
        assert a.do("flush")["state"]["demoted"] == 4
        # Copied, acknowledged by a's next journal (its tick ships one for the
        # ticket), written: the tier holds the 4 blocks of "old".
        wait_for(lambda: tier(node.daemon)["counters"]["demotions"] == 4, what="the demoted blocks in the tier")
        counters = tier(node.daemon)["counters"]
        assert counters["demotions"] == counters["demotions_evicted"] == 4
        assert counters["failures_raced"] == counters["failures_unconfirmed"] == 0
        assert len(list(node.folder.glob("*.kvb"))) == 4
        step(a, "new", 30)                                   # evicts and rewrites them in a
        assert a.do("lookup", prefix="old", n=4)["hits"] == 0
        wait_for(lambda: "kvelastic_tier_demotions_evicted_total 4.0" in node.daemon.metrics(),
                 what="the metrics' snapshot caught up")

        b = node.engine("b")
        pinned = b.send(p.TierLookup(engine_id="b", keys=keys("old", 4)))
        assert isinstance(pinned, p.TierPinned) and pinned.nbytes == [BLOCK] * 4
        values = []
        for k in range(4):
            data = fetch(b, pinned.lease, k)
            assert data is not None and len(data) == BLOCK
            # The same byte at the start of the block's run in both layer
            # regions, nothing else: one block's KV, whole.
            assert data[0] == data[REGION] and data.count(0) == BLOCK - 2
            values.append(data[0])
        # What a's worker wrote for "old" (20 + its place in the slab), not the
        # 30 + place it wrote over those blocks after.
        assert sorted(values) == [20, 21, 22, 23]
        other = node.engine("c", namespace="llama-2")
        assert other.send(p.TierLookup(engine_id="c", keys=keys("old", 4))).lease == 0
    finally:
        node.close()


def test_a_block_rewritten_before_the_engine_acknowledged_its_copy_is_discarded(tmp_path):
    node = Node(tmp_path)
    try:
        a = copied_not_acknowledged(node)
        step(a, "new", 30)       # evicts and rewrites the 4 copied blocks before any ack
        a.do("flush")            # their REMOVEs and the ack in one journal
        a.do("release")
        wait_for(lambda: tier(node.daemon)["counters"]["failures_raced"] == 4, what="the copies discarded")
        # That journal demoted the 4 blocks of "new" in turn: copied, confirmed, written.
        wait_for(lambda: tier(node.daemon)["counters"]["demotions"] == 4, what="new's blocks in the tier")
        assert len(list(node.folder.glob("*.kvb"))) == 4     # old's never reached the disk
        b = node.engine("b")
        assert b.send(p.TierLookup(engine_id="b", keys=keys("old", 4))).lease == 0
        pinned = b.send(p.TierLookup(engine_id="b", keys=keys("new", 4)))
        assert len(pinned.nbytes) == 4
        # What a's worker wrote for "new" (the evictions reused the blocks in LRU order).
        assert sorted(fetch(b, pinned.lease, k)[0] for k in range(4)) == [30, 31, 32, 33]
    finally:
        node.close()


def test_copies_of_an_engine_killed_before_it_acknowledged_them_are_discarded(tmp_path):
    node = Node(tmp_path)
    try:
        copied_not_acknowledged(node).kill()
        wait_for(lambda: tier(node.daemon)["counters"]["failures_unconfirmed"] == 4, what="the copies discarded")
        status = tier(node.daemon)
        assert status["blocks"] == 0 and status["bytes"] == 0
        assert not list(node.folder.glob("*.kvb"))
    finally:
        node.close()
