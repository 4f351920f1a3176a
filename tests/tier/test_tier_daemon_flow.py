"""Demotion source A and promotion leases in a real daemon process, with real
engine and worker processes (``tests/daemon/peer.py``, host pages): a killed
engine's kept cache expires (``KVELASTIC_ORPHAN_CACHE_TTL``) and its blocks
are written to the tier from the pages its worker wrote; an engine of the
same namespace pins and fetches them (in chunks: a block of 1 MiB), another
namespace finds nothing, a lease dies with its engine, and a block whose
bytes fail their check is dropped and counted, never served."""

from __future__ import annotations

import pytest

from kvelastic import protocol as p
from kvelastic.daemon.tiering import CHUNK
from tests.daemon.engines import EngineProcess
from tests.daemon_proc import DaemonProcess, short_dir, wait_for

pytestmark = pytest.mark.skipif(__import__("tests.backend").backend.TEST_BACKEND != "host",
                                reason="demotion source A reads memfd pages: host backend")

KEEP = {"grace": 60, "journal_interval": 3600}
PAGE = 2 << 20
BLOCK = PAGE * 2 // 4          # ppw 2 (two layer regions), 4 blocks a slab: 512 KiB a region


def tier(daemon: DaemonProcess) -> dict:
    return daemon.status()["tier"]


def fetch(engine: EngineProcess, lease: int, block: int) -> bytes | None:
    """A block's bytes, chunk by chunk; None when the daemon found it bad."""
    data, size = b"", None
    while size is None or len(data) < size:
        reply = engine.send(p.TierFetch(engine_id=engine.engine_id, lease=lease, block=block, offset=len(data)))
        assert isinstance(reply, p.TierData), reply
        if reply.size < 0:
            return None
        assert len(reply.data) <= CHUNK and reply.offset == len(data)
        data, size = data + reply.data, reply.size
    return data


def keys(prefix: str, n: int) -> list[bytes]:
    return [f"{prefix}-{i}".encode() for i in range(n)]


def test_kept_cache_is_demoted_and_promoted_under_leases(tmp_path):
    folder = short_dir(tmp_path) / "tier"
    folder.mkdir(mode=0o700)
    daemon = DaemonProcess(tmp_path, memory="8MiB", KVELASTIC_TIER_DIR=str(folder), KVELASTIC_TIER_SIZE="64MiB",
                           KVELASTIC_ORPHAN_CACHE_TTL="1s").start()
    started: list[EngineProcess] = []

    def engine(engine_id: str, namespace: str) -> EngineProcess:
        e = EngineProcess(daemon.socket, engine_id, namespace=namespace, ppw=2, bps=4, **KEEP)
        started.append(e)
        return e

    try:
        a = engine("a", "llama-1")
        assert a.do("ensure", n=4)["ok"]
        step = a.do("step")["step"]
        assert a.do("alloc", n=4)["ok"]
        a.do("cache", prefix="sys")
        a.do("seal")
        a.do("write", value=7)            # the first byte of each page: block 0 of each layer region
        a.do("end_step", n=step)
        a.do("free")
        a.do("flush")
        a.kill()
        wait_for(lambda: tier(daemon)["blocks"] == 4 and tier(daemon)["writing"] == 0, timeout=10,
                 what="a's kept cache demoted and written")
        status = tier(daemon)
        assert status["namespaces"] == {"llama-1": 4} and status["counters"]["demotions"] == 4
        assert daemon.status().get("orphans", []) == []

        b = engine("b", "llama-1")
        other = engine("o", "llama-2")
        nothing = other.send(p.TierLookup(engine_id="o", keys=keys("sys", 4)))
        assert isinstance(nothing, p.TierPinned) and nothing.lease == 0 and nothing.nbytes == []
        pinned = b.send(p.TierLookup(engine_id="b", keys=keys("sys", 4) + keys("new", 1)))
        assert isinstance(pinned, p.TierPinned) and pinned.nbytes == [BLOCK] * 4
        blocks = [fetch(b, pinned.lease, i) for i in range(4)]
        assert all(block is not None and len(block) == BLOCK for block in blocks)
        # The worker wrote 7 at each page's first byte: block 0 of the slab, in layer region 0 and in
        # region 1, which its payload holds one after the other; every other byte is zero.
        written = [block for block in blocks if block and block[0] == 7]
        assert len(written) == 1 and written[0][BLOCK // 2] == 7 and written[0].count(0) == BLOCK - 2
        assert all(block == bytes(BLOCK) for block in blocks if block is not written[0])
        assert tier(daemon)["counters"]["promotions"] == 4
        bad = b.send(p.TierFetch(engine_id="b", lease=pinned.lease, block=0))      # fetched and unpinned
        assert isinstance(bad, p.Error) and bad.reason == p.Reason.BAD_REQUEST.value
        pinned = b.send(p.TierLookup(engine_id="b", keys=keys("sys", 4)))
        assert isinstance(pinned, p.TierPinned) and len(pinned.nbytes) == 4
        b.kill()                                           # four blocks pinned: the lease dies with b
        wait_for(lambda: tier(daemon)["counters"]["failures_load"] == 4, what="b's lease ended")

        for path in folder.glob("*.kvb"):                   # every block's payload: one byte flipped
            data = bytearray(path.read_bytes())
            data[-1] ^= 0xFF
            path.write_bytes(bytes(data))
        c = engine("c", "llama-1")
        pinned = c.send(p.TierLookup(engine_id="c", keys=keys("sys", 4)))
        assert isinstance(pinned, p.TierPinned) and len(pinned.nbytes) == 4
        assert fetch(c, pinned.lease, 0) is None
        assert isinstance(c.send(p.TierRelease(engine_id="c", lease=pinned.lease)), p.Ok)
        counters = tier(daemon)["counters"]
        assert counters["failures_checksum"] == 1 and counters["failures_load"] == 4
        assert tier(daemon)["blocks"] == 3
        wait_for(lambda: len(list(folder.glob("*.kvb"))) == 3, what="the bad block's file deleted")
    finally:
        for e in started:
            e.close()
        daemon.stop()


def test_kept_cache_adopted_by_an_engine_is_written_through_to_the_tier(tmp_path):
    """Kept cache taken by the next engine of its namespace (a warm start) is
    written to the tier on its way, well before its TTL: that engine keeps
    only what its requests use, and what it evicts later stays in the tier."""
    folder = short_dir(tmp_path) / "tier"
    folder.mkdir(mode=0o700)
    daemon = DaemonProcess(tmp_path, memory="8MiB", KVELASTIC_TIER_DIR=str(folder), KVELASTIC_TIER_SIZE="64MiB",
                           KVELASTIC_ORPHAN_CACHE_TTL="600s").start()
    started: list[EngineProcess] = []
    try:
        a = EngineProcess(daemon.socket, "a", namespace="llama-1", ppw=2, bps=4, **KEEP)
        started.append(a)
        assert a.do("ensure", n=4)["ok"]
        step = a.do("step")["step"]
        assert a.do("alloc", n=4)["ok"]
        a.do("cache", prefix="sys")
        a.do("seal")
        a.do("write", value=9)
        a.do("end_step", n=step)
        a.do("free")
        a.do("flush")
        a.kill()
        wait_for(lambda: daemon.status().get("orphans"), timeout=10, what="a's cache kept")
        assert tier(daemon)["blocks"] == 0                 # kept for 600 s: nothing demoted yet

        b = EngineProcess(daemon.socket, "b", namespace="llama-1", ppw=2, bps=4, **KEEP)
        started.append(b)
        assert b.do("ensure", n=4)["ok"]                   # its first grow: a warm start
        assert b.do("lookup", prefix="sys", n=4)["hits"] == 4
        assert tier(daemon)["blocks"] == 4                 # reserved before the pages went to b
        wait_for(lambda: tier(daemon)["counters"]["demotions"] == 4, what="the writes done")   # off the loop
        pinned = b.send(p.TierLookup(engine_id="b", keys=keys("sys", 4)))
        assert isinstance(pinned, p.TierPinned) and pinned.nbytes == [BLOCK] * 4
        blocks = [fetch(b, pinned.lease, i) for i in range(4)]
        assert sum(block is not None and block[0] == 9 for block in blocks) == 1   # a's bytes, as written
    finally:
        for e in started:
            e.close()
        daemon.stop()
