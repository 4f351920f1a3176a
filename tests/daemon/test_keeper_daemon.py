"""The daemon with a keeper (Step 20): the keeper holds every page the daemon
has, keeps them past the daemon's ``kill -9`` and a graceful stop, and lets
go of what the daemon releases; a new daemon, with no saved books yet, has
the keeper let go of its predecessor's pages. Real processes throughout."""

from __future__ import annotations

from kvelastic.keeper.client import KeeperClient
from tests.daemon.test_orphan_cache import KEEP, cache_in_a_step
from tests.daemon_proc import DaemonProcess, wait_for
from tests.keeper.test_keeper import KeeperProcess

PAGE = 2 << 20


def kept(keeper: KeeperProcess) -> tuple[int, int]:
    with KeeperClient(keeper.path) as k:
        status = k.status()
    return len(status.page_ids), status.bytes


def test_the_keeper_holds_the_daemons_pages_past_its_death(tmp_path, engines):
    daemon = DaemonProcess(tmp_path, memory="32MiB", KVELASTIC_ORPHAN_CACHE_TTL="1s")
    keeper = KeeperProcess(tmp_path, socket=daemon.socket).start()
    try:
        daemon.start()
        assert "keeper: 0 page(s) of the former daemon let go" in daemon.log()

        def in_step() -> bool:                  # the keeper holds exactly the pages the daemon created
            return kept(keeper)[0] == daemon.status()["pages"]["created"]

        a = engines(daemon, "a", **KEEP)
        assert a.do("ensure", n=8)["ok"]
        wait_for(in_step, what="every page the daemon created deposited")
        created = daemon.status()["pages"]["created"]
        assert created > 0

        daemon.kill()                                            # kill -9: its own descriptors are gone
        assert kept(keeper) == (created, created * PAGE)         # the memory is not
        daemon.stop()

        daemon = DaemonProcess(tmp_path, memory="32MiB", KVELASTIC_ORPHAN_CACHE_TTL="1s").start()
        assert f"keeper: {created} page(s) of the former daemon let go" in daemon.log()
        wait_for(lambda: daemon.status()["engines"], timeout=15, what="a re-registered")
        assert kept(keeper)[0] == daemon.status()["pages"]["created"] == 0     # a's slabs: adopted, no pages here

        b = engines(daemon, "b", namespace="llama", **KEEP)
        assert b.do("ensure", n=4)["ok"]
        cache_in_a_step(b, "sys", 4, value=7)
        b.do("flush")
        wait_for(in_step, what="b's pages deposited")
        before = daemon.status()["pages"]["created"]
        assert before > 0
        b.close()                      # its cache is kept for 1 s, then its pages are released, and forgotten
        wait_for(lambda: daemon.status()["pages"]["created"] < before, timeout=15, what="b's kept cache released")
        wait_for(in_step, what="b's released pages forgotten")

        held = kept(keeper)
        assert daemon.stop() == 0                                 # a graceful stop
        assert kept(keeper) == held                               # leaves the pages with the keeper
    finally:
        daemon.stop()
        keeper.stop()
