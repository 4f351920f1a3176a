"""The tier in host memory above the disk (``KVELASTIC_TIER_HOST_SIZE`` with
``KVELASTIC_TIER_DIR``), in a real daemon process with real engine and
worker processes (``tests/daemon/peer.py``, host pages): a departed engine's
kept cache enters host memory (what the writes in flight leave no room for
there goes to the disk); a later demotion moves the least valuable blocks
above down to the disk, where they stay findable; another engine loads every
block back with the bytes its worker wrote, wherever each lies; a restart
finds only the disk's blocks; an invalidation empties both media."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvelastic import protocol as p
from tests.daemon.engines import EngineProcess
from tests.daemon_proc import DaemonProcess, short_dir, wait_for
from tests.tier.test_tier_daemon_flow import BLOCK, KEEP, fetch, keys, tier

pytestmark = pytest.mark.skipif(__import__("tests.backend").backend.TEST_BACKEND != "host",
                                reason="demotion source A reads memfd pages: host backend")


def levels(status: dict) -> dict[str, int]:
    return {level["medium"]: level["bytes"] for level in status["levels"]}


def test_blocks_enter_host_memory_move_down_to_disk_and_load_back_from_either(tmp_path):
    folder = short_dir(tmp_path) / "tier"
    folder.mkdir(mode=0o700)
    daemon = DaemonProcess(tmp_path, memory="8MiB", KVELASTIC_TIER_DIR=str(folder), KVELASTIC_TIER_SIZE="64MiB",
                           KVELASTIC_TIER_HOST_SIZE=str(2 * BLOCK), KVELASTIC_ORPHAN_CACHE_TTL="1s").start()
    started: list[EngineProcess] = []

    def engine(engine_id: str) -> EngineProcess:
        e = EngineProcess(daemon.socket, engine_id, namespace="llama-1", ppw=2, bps=4, **KEEP)
        started.append(e)
        return e

    try:
        def demoted(engine_id: str, prefix: str, n: int) -> None:
            """An engine caches ``n`` blocks of ``prefix`` (its worker writes 7 at each page's first byte:
            block 0 of each layer region) and dies; its kept cache expires into the tier."""
            e = engine(engine_id)
            assert e.do("ensure", n=4)["ok"]
            step = e.do("step")["step"]
            assert e.do("alloc", n=n)["ok"]
            e.do("cache", prefix=prefix)
            e.do("seal")
            e.do("write", value=7)
            e.do("end_step", n=step)
            e.do("free")
            e.do("flush")
            e.kill()
            started.remove(e)

        demoted("a", "sys", 4)
        status = wait_for(lambda: (s := tier(daemon))["blocks"] == 4 and s["writing"] == 0 and s, timeout=20,
                          what="a's kept cache demoted")
        assert status["medium"] == "host+disk" and status["budget_bytes"] == 2 * BLOCK + (64 << 20)
        # Four blocks written at once: two fill host memory, the writes in flight leave the others only the disk.
        assert levels(status) == {"host": 2 * BLOCK, "disk": 2 * BLOCK} and len(list(folder.glob("*.kvb"))) == 2
        demoted("a2", "two", 2)                               # room above: the least valuable there move down
        status = wait_for(lambda: (s := tier(daemon))["blocks"] == 6 and s["writing"] == 0
                          and s["counters"]["moves"] == 2 and s, timeout=20, what="two blocks moved down")
        assert status["counters"]["moved_down"] == 2 and status["counters"]["demotions"] == 6
        shown = subprocess.run([sys.executable, "-m", "kvelastic", "status"], env=daemon.env, capture_output=True,
                               text=True, timeout=30).stdout
        assert "tier         host+disk: 6 block(s), 6.0 MiB of 66.0 MiB (host 2.0 MiB of 2.0 MiB, " \
               "disk 4.0 MiB of 64.0 MiB)" in shown, shown
        assert levels(status) == {"host": 2 * BLOCK, "disk": 4 * BLOCK} and len(list(folder.glob("*.kvb"))) == 4

        b = engine("b")
        pinned = b.send(p.TierLookup(engine_id="b", keys=keys("sys", 4)))
        assert isinstance(pinned, p.TierPinned) and pinned.nbytes == [BLOCK] * 4     # moved down: still found
        blocks = [fetch(b, pinned.lease, i) for i in range(4)]
        written = [block for block in blocks if block and block[0] == 7]
        assert len(written) == 1 and written[0][BLOCK // 2] == 7 and written[0].count(0) == BLOCK - 2
        assert all(block == bytes(BLOCK) for block in blocks if block is not written[0])
        pinned = b.send(p.TierLookup(engine_id="b", keys=keys("two", 2)))
        assert isinstance(pinned, p.TierPinned) and pinned.nbytes == [BLOCK] * 2      # in host memory
        assert [fetch(b, pinned.lease, i)[0] for i in range(2)] in ([7, 0], [0, 7])
        assert tier(daemon)["counters"]["promotions"] == 6
        b.close()
        started.remove(b)

        daemon.stop()                                         # host memory goes with the daemon
        daemon.start()
        after = tier(daemon)
        assert after["blocks"] == 4 and levels(after) == {"host": 0, "disk": 4 * BLOCK}
        assert after["namespaces"] == {"llama-1": 4}
        c = engine("c")
        assert c.send(p.TierLookup(engine_id="c", keys=keys("two", 2))).nbytes == []          # gone with it
        pinned = c.send(p.TierLookup(engine_id="c", keys=keys("sys", 4)))
        assert isinstance(pinned, p.TierPinned) and pinned.nbytes == [BLOCK] * 4
        assert all(fetch(c, pinned.lease, i) is not None for i in range(4))

        done = daemon.request(p.Invalidate(target="llama-1"), timeout=30)
        assert isinstance(done, p.Invalidated) and done.tier_blocks == 4
        wait_for(lambda: not list(folder.glob("*.kvb")), what="the disk's files deleted")
        assert tier(daemon)["blocks"] == 0 and levels(tier(daemon)) == {"host": 0, "disk": 0}
    finally:
        for e in started:
            e.close()
        daemon.stop()
