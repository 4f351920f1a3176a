"""Demotion from cached slabs reclaimed from a running engine,
in a real daemon process with real engine and worker processes
(``tests/daemon/peer.py``, host pages): an engine of another namespace
needs the memory, the daemon reclaims the idle engine's cached slab, and
once its worker unmapped it the slab's blocks are written to the tier from
the pages that worker wrote, before the pages go to the other engine; an
engine of the first namespace loads them back. Reclaimed for a replica of
the same namespace, the blocks go with the pages instead; reclaimed and
then invalidated before the worker let go, they go nowhere."""

from __future__ import annotations

import json
import threading

import pytest

from kvelastic import protocol as p
from tests.daemon.engines import EngineProcess
from tests.daemon_proc import DaemonProcess, short_dir, wait_for
from tests.tier.test_tier_daemon_flow import BLOCK, fetch, keys, tier

pytestmark = pytest.mark.skipif(__import__("tests.backend").backend.TEST_BACKEND != "host",
                                reason="the daemon reads reclaimed memfd pages: host backend")

IDLE = {"grace": 60, "journal_interval": 3600}     # keeps its slabs; journals when told (``flush``)


class Node:
    """A daemon with a tier (4 pages: two slabs of two pages) and its engines."""

    def __init__(self, tmp_path, **env: str) -> None:
        self.folder = short_dir(tmp_path) / "tier"
        self.folder.mkdir(mode=0o700)
        self.daemon = DaemonProcess(tmp_path, memory="8MiB", KVELASTIC_TIER_DIR=str(self.folder),
                                    KVELASTIC_TIER_SIZE="64MiB", **env).start()
        self.engines: list[EngineProcess] = []

    def engine(self, engine_id: str, namespace: str, **cfg) -> EngineProcess:
        e = EngineProcess(self.daemon.socket, engine_id, namespace=namespace, ppw=2, bps=4, **{**IDLE, **cfg})
        self.engines.append(e)
        return e

    def reclaims(self, engine_id: str) -> int:
        return next(e["reclaims"] for e in self.daemon.status()["engines"] if e["engine_id"] == engine_id)

    def close(self) -> None:
        for e in self.engines:
            e.close()
        self.daemon.stop()


def cache_everything(e: EngineProcess, prefix: str, value: int, *, freed_in_step: bool = False) -> None:
    """Both slabs full of cached blocks whose step finished; ``value`` at each page's first byte.
    ``freed_in_step``: freed while a later step runs (vLLM's async scheduling), which
    leaves the slabs unsettled until it ends: their unmap waits for the worker's step."""
    assert e.do("ensure", n=8)["ok"]
    step = e.do("step")["step"]
    assert e.do("alloc", n=8)["ok"]
    e.do("cache", prefix=prefix)
    e.do("seal")
    e.do("write", value=value)
    if freed_in_step:
        e.do("step")
    e.do("end_step", n=step)
    e.do("free")
    e.do("flush")


def ensure_in_background(e: EngineProcess, n: int) -> threading.Thread:
    """``ensure`` answered while the test goes on (the reclaim it causes is watched meanwhile)."""
    e.proc.stdin.write(json.dumps({"op": "ensure", "n": n, "timeout": 15}) + "\n")
    e.proc.stdin.flush()
    answer: dict = {}
    thread = threading.Thread(target=lambda: answer.update(json.loads(e.proc.stdout.readline())), daemon=True)
    thread.start()
    thread.answer = answer     # type: ignore[attr-defined]
    return thread


def test_a_slab_reclaimed_for_another_namespace_is_demoted_and_loaded_back(tmp_path):
    node = Node(tmp_path)
    try:
        a = node.engine("a", "llama-1")
        cache_everything(a, "sys", 7)                        # the whole budget: 8 cached blocks
        b = node.engine("b", "llama-2")
        assert b.do("ensure", n=4)["ok"]                     # a demand: one slab reclaimed from a
        assert node.reclaims("a") == 1
        wait_for(lambda: tier(node.daemon)["writing"] == 0, what="the writes done (off the loop)")
        status = tier(node.daemon)
        assert status["blocks"] == 4 and status["namespaces"] == {"llama-1": 4}
        assert status["counters"]["demotions"] == 4 and status["counters"]["demotions_reclaimed"] == 4
        wait_for(lambda: "kvelastic_tier_demotions_reclaimed_total 4.0" in node.daemon.metrics(),
                 what="the metrics' snapshot caught up")
        assert len(list(node.folder.glob("*.kvb"))) == 4
        assert a.do("lookup", prefix="sys", n=8)["hits"] < 8  # a's index gave the slab's keys up

        c = node.engine("c", "llama-1")
        blocks = []
        for k in keys("sys", 8):                             # which four: the slab the arbiter picked
            pinned = c.send(p.TierLookup(engine_id="c", keys=[k]))
            assert isinstance(pinned, p.TierPinned)
            if pinned.lease:
                assert pinned.nbytes == [BLOCK]
                blocks.append(fetch(c, pinned.lease, 0))     # its last chunk ends the lease
        assert len(blocks) == 4
        # a's worker wrote 7 at each page's first byte: block 0 of the slab, in layer
        # region 0 and region 1 (one after the other in its payload); all else zero.
        written = [x for x in blocks if x and x[0] == 7]
        assert len(written) == 1 and written[0][BLOCK // 2] == 7 and written[0].count(0) == BLOCK - 2
        assert all(x == bytes(BLOCK) for x in blocks if x is not written[0])
        assert tier(node.daemon)["counters"]["promotions"] == 4
        # Each load's latency, lookup to last chunk, in kvelastic_tier_load_seconds.
        load = tier(node.daemon)["load_seconds"]
        assert sum(load["counts"]) == 4 and 0 < load["sum"] < 4 * 10 and load["counts"][-1] == 0
        wait_for(lambda: "kvelastic_tier_load_seconds_count 4.0" in node.daemon.metrics(),
                 what="the metrics' snapshot caught up")
        metrics = node.daemon.metrics()
        assert 'kvelastic_tier_load_seconds_bucket{le="+Inf"} 4.0' in metrics
        assert 'kvelastic_tier_load_seconds_bucket{le="0.0001"}' in metrics
    finally:
        node.close()


def test_a_slab_reclaimed_for_a_replica_goes_with_its_pages_not_to_the_tier(tmp_path):
    node = Node(tmp_path)
    try:
        a = node.engine("a", "llama-1")
        cache_everything(a, "sys", 7)
        b = node.engine("b", "llama-1")
        assert b.do("ensure", n=4)["ok"]
        assert node.reclaims("a") == 1
        assert b.state()["cached"] == 4                      # adopted with the pages
        status = tier(node.daemon)
        assert status["blocks"] == 0 and status["counters"]["demotions_reclaimed"] == 0
    finally:
        node.close()


def test_a_reclaimed_slab_invalidated_before_its_worker_let_go_is_never_demoted(tmp_path):
    node = Node(tmp_path, KVELASTIC_ACK_TIMEOUT="5s", KVELASTIC_GROW_TIMEOUT="15s")
    try:
        a = node.engine("a", "llama-1")
        cache_everything(a, "sys", 7, freed_in_step=True)
        a.do("worker_step")                                  # a model step: the unmap waits for its end
        b = node.engine("b", "llama-2")
        grow = ensure_in_background(b, 4)
        wait_for(lambda: node.reclaims("a") == 1, timeout=10, what="a gave the slab up")
        reply = node.daemon.request(p.Invalidate(target="llama-1"))
        assert isinstance(reply, p.Invalidated) and reply.engines == 1
        a.do("worker_step_end")                              # the step ends: the unmap goes through
        grow.join(20)
        assert grow.answer["ok"], grow.answer                # type: ignore[attr-defined]
        status = tier(node.daemon)
        assert status["blocks"] == 0 and status["counters"]["demotions"] == 0
        assert not list(node.folder.glob("*.kvb"))
    finally:
        node.close()


# ------------------------------------------------------------ in process
def test_what_a_reclaim_may_demote_is_valid_when_asked_and_cached_when_given_up():
    """``valid_blocks``: keys of finished steps only (a block the engine marked
    DEMOTE too), in the order their keys came; ``reclaimed``: of those, the
    ones the engine still cached under the same key when it gave the slab up.
    A geometry that says a slab has 2**30 blocks costs nothing more."""
    from kvelastic.core.journal import DEMOTE, DONE, STEP, STORE, JournalBatch
    from kvelastic.daemon.tiering import Tiering
    from tests.tier.test_demotion import record

    engine = record(2, 1, 8)
    engine.mirror.blocks_per_slab = engine.blocks_per_slab
    slab = 1                                                    # blocks 8..15
    engine.mirror.apply(JournalBatch([(STEP, 1), (STORE, b"k2", 10), (STORE, b"k0", 8), (STEP, 2),
                                      (STORE, b"k1", 9), (DONE, 2), (DEMOTE, 9), (STEP, 3), (STORE, b"k3", 11),
                                      (STORE, b"other", 0)], {}))
    valid = Tiering.valid_blocks(engine, [slab])[slab]
    assert [(c.offset, c.key) for c in valid] == [(0, b"k0"), (2, b"k2"), (1, b"k1")]   # k3: step 3 runs still
    given = [p.CachedBlock(1, b"k1"), p.CachedBlock(2, b"k2-new"), p.CachedBlock(0, b"k0"), p.CachedBlock(3, b"k3")]
    assert [c.key for c in Tiering.reclaimed(valid, given)] == [b"k0", b"k1"]          # k2 keyed anew since
    huge = record(2, 1, 8)
    huge.blocks_per_slab = 1 << 30
    huge.mirror.blocks_per_slab = huge.blocks_per_slab
    assert Tiering.valid_blocks(huge, [3]) == {3: ()}
