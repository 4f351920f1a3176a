"""The daemon with a keeper: the keeper holds every page the daemon
has, keeps them past the daemon's ``kill -9`` and a graceful stop, and lets
go of what the daemon releases; a new daemon has
the keeper let go of its predecessor's pages but for the kept cache it saved,
which a new daemon adopts. Real processes throughout."""

from __future__ import annotations

import pathlib
import signal
import zlib

import msgspec
import pytest

from kvelastic.daemon.succession import state_path
from kvelastic.keeper.client import KeeperClient
from tests.daemon.test_orphan_cache import KEEP, cache_in_a_step, kept_blocks
from tests.daemon_proc import DaemonProcess, wait_for
from tests.keeper.test_keeper import KeeperProcess

PAGE = 2 << 20


def kept_part(restart: dict) -> dict:
    """What the restart status says of the kept cache."""
    return {k: restart[k] for k in ("state_file", "kept_slabs", "kept_blocks", "dropped", "pages_let_go")}


def kept(keeper: KeeperProcess) -> tuple[int, int]:
    with KeeperClient(keeper.path) as k:
        status = k.status()
    return len(status.page_ids), status.bytes


def test_the_keeper_holds_the_daemons_pages_past_its_death(tmp_path, engines):
    daemon = DaemonProcess(tmp_path, memory="32MiB", KVELASTIC_ORPHAN_CACHE_TTL="1s")
    keeper = KeeperProcess(tmp_path, socket=daemon.socket).start()
    try:
        daemon.start()
        assert "(state file: missing): 0 kept slab(s)" in daemon.log()

        def in_step() -> bool:                  # the keeper holds exactly the pages the daemon created
            return kept(keeper)[0] == daemon.status()["pages"]["created"]

        a = engines(daemon, "a", **KEEP)
        assert a.do("ensure", n=8)["ok"]
        wait_for(in_step, what="every page the daemon created deposited")
        created = daemon.status()["pages"]["created"]
        assert created > 0
        slabs = daemon.status()["engines"][0]["slabs"]
        wait_for(lambda: len(lent_saved(daemon, "a")) == slabs, what="a's slabs saved")
        lent = sum(len(r.pages) for r in lent_saved(daemon, "a"))

        daemon.kill()                                            # kill -9: its own descriptors are gone
        assert kept(keeper) == (created, created * PAGE)         # the memory is not
        daemon.stop()

        daemon = DaemonProcess(tmp_path, memory="32MiB", KVELASTIC_ORPHAN_CACHE_TTL="1s").start()
        assert f"kept slabs dropped: none; {slabs} running engines' slab(s) held for their claims (dropped: none); " \
               f"{created - lent} other page(s) of the keeper let go" in daemon.log()
        wait_for(lambda: daemon.status()["restart"]["lent_adopted"] == slabs, timeout=15,
                 what="a and its worker re-registered, its slabs adopted with their pages")
        assert kept(keeper)[0] == daemon.status()["pages"]["created"] == lent

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


def keeper_and_a_cache(tmp_path, engines):
    """A daemon with a keeper, and engine ``a`` of llama-1 that cached 4
    blocks ("sys", KV bytes 7) and shipped its journal."""
    daemon = DaemonProcess(tmp_path, memory="32MiB")
    keeper = KeeperProcess(tmp_path, socket=daemon.socket).start()
    daemon.start()
    a = engines(daemon, "a", namespace="llama-1", **KEEP)
    assert a.do("ensure", n=4)["ok"]
    cache_in_a_step(a, "sys", 4, value=7)
    a.do("flush")
    return daemon, keeper, a


def cache_kept_then_daemon_gone(tmp_path, engines, how: str):
    """A daemon with a keeper; engine ``a`` of llama-1 caches 4 blocks ("sys",
    KV bytes 7) and is killed, so they are kept; engine ``c`` (another
    namespace) keeps serving from its own slab (saved as lent); then the
    daemon goes (``kill``: SIGKILL; ``stop``: SIGTERM). Returns the keeper,
    the live engine and the page count the daemon had."""
    daemon, keeper, a = keeper_and_a_cache(tmp_path, engines)
    a.kill()
    wait_for(lambda: kept_blocks(daemon, "llama-1") == 4, what="a's cache kept")
    c = engines(daemon, "c", namespace="qwen", **KEEP)
    assert c.do("ensure", n=4)["ok"]
    cache_in_a_step(c, "own", 4, value=5)
    wait_for(lambda: kept(keeper)[0] == daemon.status()["pages"]["created"], what="every page deposited")
    slabs = next(e for e in daemon.status()["engines"] if e["engine_id"] == "c")["slabs"]
    wait_for(lambda: len(lent_saved(daemon, "c")) == slabs, what="c's slabs saved")
    created = daemon.status()["pages"]["created"]
    if how == "kill":
        daemon.kill()
    daemon.stop()
    return keeper, c, created


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_the_kept_cache_survives_the_daemon(tmp_path, engines, how):
    """SIGKILL or SIGTERM, then a new daemon: it adopts the kept slab with its
    pages (the bytes as written, not zeroed), the running engine re-registers
    with its slab, the next engine of the namespace hits the kept blocks, and
    the books balance: the keeper holds exactly the pages the new daemon has."""
    keeper, c, before = cache_kept_then_daemon_gone(tmp_path, engines, how)
    try:
        daemon = DaemonProcess(tmp_path, memory="32MiB").start()
        status = daemon.status()
        assert kept_part(status["restart"]) == {"state_file": "ok", "kept_slabs": 1, "kept_blocks": 4,
                                                "dropped": {}, "pages_let_go": before - 2}
        assert status["restart"]["lent_held"] == 1                           # c's slab, held for its claim
        assert kept_blocks(daemon, "llama-1") == 4
        assert kept(keeper)[0] == 2                                          # the kept slab's page, c's held
        assert status["pages"]["created"] == 1 + status["restart"]["lent_adopted"]   # (c may be back already)
        assert 'kvelastic_restart_kept_blocks_adopted 4.0' in daemon.metrics()
        assert 'kvelastic_restart_state_file{state="ok"} 1.0' in daemon.metrics()
        wait_for(lambda: [e["engine_id"] for e in daemon.status()["engines"]] == ["c"], timeout=15,
                 what="c re-registered")
        assert c.do("lookup", prefix="own", n=4)["hits"] == 4                 # c serves on
        wait_for(lambda: daemon.status()["restart"]["lent_adopted"] == 1,    # with its page, once its
                 what="c's slab confirmed by its worker")                     # worker re-registered
        b = engines(daemon, "b", namespace="llama-1", **KEEP)
        assert b.do("ensure", n=1)["ok"], f"b got no slab; the daemon's log:\n{daemon.log()[-3000:]}"
        assert b.do("lookup", prefix="sys", n=4)["hits"] == 4
        assert sorted(b.do("read")["values"]) == [0, 7]     # a's KV through two daemons; a fresh page
        assert kept_blocks(daemon, "llama-1") == 0
        wait_for(lambda: kept(keeper)[0] == daemon.status()["pages"]["created"], what="books and keeper agree")
        daemon.stop()
        daemon = DaemonProcess(tmp_path, memory="32MiB").start()              # the kept slab is lent now:
        assert daemon.status()["restart"]["kept_slabs"] == 0                  # never adopted as kept again
        daemon.stop()
    finally:
        keeper.stop()


@pytest.mark.parametrize("damage", ["torn", "checksum", "version"])
def test_a_damaged_state_file_is_never_trusted(tmp_path, engines, damage):
    """A state file cut short, with a flipped bit, or of another format: the
    kept cache it names is dropped, counted by what went wrong, and its pages
    are let go; the next engine of the namespace gets a fresh page."""
    keeper, _, before = cache_kept_then_daemon_gone(tmp_path, engines, "kill")
    try:
        path = pathlib.Path(state_path(DaemonProcess(tmp_path).socket))
        data = bytearray(path.read_bytes())
        if damage == "torn":
            data = data[:-3]
        elif damage == "checksum":
            data[-1] ^= 0x10
        else:
            data[4] += 1                                  # the format's version (its header checksum fixed)
            data[56:60] = zlib.crc32(bytes(data[:56])).to_bytes(4, "little")
        path.write_bytes(bytes(data))
        daemon = DaemonProcess(tmp_path, memory="32MiB").start()
        restart = daemon.status()["restart"]
        assert kept_part(restart) == {"state_file": damage, "kept_slabs": 0, "kept_blocks": 0, "dropped": {},
                                      "pages_let_go": before}
        assert restart["lent_held"] == restart["lent_adopted"] == 0 and restart["lent_dropped"] == {}
        assert restart["lent_unmatched"] in ({}, {"no_record": 1})         # c's claim: nothing proves its page
        assert f'kvelastic_restart_state_file{{state="{damage}"}} 1.0' in daemon.metrics()
        assert kept_blocks(daemon, "llama-1") == 0 and kept(keeper)[0] == daemon.status()["pages"]["created"] == 0
        b = engines(daemon, "b", namespace="llama-1", **KEEP)
        assert b.do("ensure", n=1)["ok"]
        assert b.do("lookup", prefix="sys", n=4)["hits"] == 0
        assert b.do("read")["values"] == [0]
        daemon.stop()
    finally:
        keeper.stop()


def test_kept_pages_the_keeper_lost_are_dropped(tmp_path, engines):
    """The keeper died with the daemon: the state file names pages nobody
    holds, so the kept slab is dropped (``pages_gone``), never served."""
    keeper, _, _ = cache_kept_then_daemon_gone(tmp_path, engines, "kill")
    keeper.stop()
    keeper = KeeperProcess(tmp_path, socket=DaemonProcess(tmp_path).socket).start()
    try:
        daemon = DaemonProcess(tmp_path, memory="32MiB").start()
        restart = daemon.status()["restart"]
        assert kept_part(restart) == {"state_file": "ok", "kept_slabs": 0, "kept_blocks": 0,
                                      "dropped": {"pages_gone": 1}, "pages_let_go": 0}
        assert restart["lent_held"] == 0 and restart["lent_dropped"] == {"pages_gone": 1}    # c's page gone too
        wait_for(lambda: daemon.status()["restart"]["lent_unmatched"] == {"dropped": 1}, timeout=15,
                 what="c's claim adopted without its page")
        assert kept_blocks(daemon, "llama-1") == 0
        daemon.stop()
    finally:
        keeper.stop()


def test_a_hung_keeper_is_dropped_with_the_state_file_and_the_daemon_serves_on(tmp_path, engines):
    """A keeper that stops answering (SIGSTOP) holds the loop at most
    ``KEEPER_TIMEOUT``: the daemon drops it, removes the state file (what it
    saved can no longer be vouched for), and grants as before."""
    daemon = DaemonProcess(tmp_path, memory="32MiB")
    keeper = KeeperProcess(tmp_path, socket=daemon.socket).start()
    try:
        daemon.start()
        path = pathlib.Path(state_path(daemon.socket))
        assert path.exists()                                    # written at start
        keeper.proc.send_signal(signal.SIGSTOP)
        a = engines(daemon, "a", namespace="llama-1", **KEEP)
        # Its pages cannot be deposited: the loop waits KEEPER_TIMEOUT (1 s,
        # well inside the grow's and the acks' deadlines), then goes on.
        assert a.do("ensure", n=4, timeout=30)["ok"]
        wait_for(lambda: "keeper failed" in daemon.log(), timeout=30, what="the keeper dropped")
        wait_for(lambda: not path.exists(), what="the state file removed")
        assert a.do("ensure", n=8, timeout=15)["ok"], daemon.log()[-3000:]   # no keeper now: no wait
        keeper.proc.send_signal(signal.SIGCONT)
        daemon.stop()
        assert not path.exists()                                # a graceful stop writes none without a keeper
    finally:
        keeper.proc.send_signal(signal.SIGCONT)
        daemon.stop()
        keeper.stop()


def test_an_engine_closes_at_once_while_a_keeper_holds_a_dead_daemons_sockets(tmp_path, engines):
    """With the daemon killed, its keeper still holds the listening sockets
    (for the next daemon): an engine's reconnect is accepted and its
    registration waits for an answer nobody gives. Closing the engine then
    must not wait out that registration's timeout (5 s): it stops waiting at
    ``close`` (``Connection._call_here``)."""
    import time

    daemon = DaemonProcess(tmp_path, memory="32MiB")
    keeper = KeeperProcess(tmp_path, socket=daemon.socket).start()
    try:
        daemon.start()
        a = engines(daemon, "a", namespace="llama-1")
        assert a.do("ensure", n=1)["ok"]
        daemon.kill()
        wait_for(lambda: a.state()["reconnects"] >= 1, what="a lost the daemon")
        started = time.monotonic()
        a.close()
        assert a.proc.returncode == 0
        assert time.monotonic() - started < 3.0, "the engine's close waited out a registration nobody answers"
    finally:
        daemon.stop()
        keeper.stop()


def saved_books(daemon: DaemonProcess):
    from kvelastic.daemon import saved
    from kvelastic.daemon.statefile import boot_id, read_state

    return saved.load(read_state(state_path(daemon.socket), boot=boot_id()))


def lent_saved(daemon: DaemonProcess, engine_id: str) -> list:
    return [r for r in saved_books(daemon).lent if r.engine_id == engine_id]


def running_engine_then_daemon_killed(tmp_path, engines):
    """A daemon with a keeper; engine ``a`` of llama-1 caches 4 blocks
    ("sys", KV bytes 7) and keeps running; once the state file names its
    slabs (lent records, written coalesced), the daemon is killed (-9).
    Returns the keeper, ``a`` and its lent records."""
    daemon, keeper, a = keeper_and_a_cache(tmp_path, engines)
    slabs = next(e for e in daemon.status()["engines"] if e["engine_id"] == "a")["slabs"]
    wait_for(lambda: len(lent_saved(daemon, "a")) == slabs, what="a's slabs saved")
    records = lent_saved(daemon, "a")
    daemon.kill()
    daemon.stop()
    return keeper, a, records


def test_a_running_engines_slabs_are_adopted_with_their_pages_and_its_cache_kept_when_it_leaves(tmp_path, engines):
    """kill -9 of the daemon under a running engine: the new daemon holds the
    pages of its saved lent slabs, the engine re-registers claiming them and
    they are adopted with their pages; when the engine then dies, its cache
    is kept like any engine's, and the next engine of its namespace reads the
    very bytes it wrote (through two daemons)."""
    keeper, a, records = running_engine_then_daemon_killed(tmp_path, engines)
    pages = sum(len(r.pages) for r in records)
    try:
        daemon = DaemonProcess(tmp_path, memory="32MiB").start()
        restart = daemon.status()["restart"]
        assert restart["lent_held"] == len(records) and restart["lent_dropped"] == {}
        assert kept(keeper)[0] == pages                      # every lent page kept, the rest let go
        wait_for(lambda: daemon.status()["restart"]["lent_adopted"] == len(records), timeout=15,
                 what="a re-registered, its slabs adopted with their pages")
        status = daemon.status()
        assert status["restart"]["lent_unmatched"] == {} and status["restart"]["lent_let_go"] == 0
        assert status["pages"]["created"] == pages and status["pages"]["adopted"] == 0
        wait_for(lambda: f"kvelastic_restart_lent_slabs_adopted_total {len(records)}.0" in daemon.metrics(),
                 what="the metrics' snapshot")
        assert a.do("lookup", prefix="sys", n=4)["hits"] == 4                 # a serves on
        a.kill()                                   # it leaves: its cache is kept, its pages the daemon's
        wait_for(lambda: kept_blocks(daemon, "llama-1") == 4, what="a's cache kept")
        b = engines(daemon, "b", namespace="llama-1", **KEEP)
        assert b.do("ensure", n=1)["ok"], f"b got no slab; the daemon's log:\n{daemon.log()[-3000:]}"
        assert b.do("lookup", prefix="sys", n=4)["hits"] == 4
        assert 7 in b.do("read")["values"]          # a's KV, written under the first daemon
        wait_for(lambda: kept(keeper)[0] == daemon.status()["pages"]["created"], what="books and keeper agree")
        daemon.stop()
    finally:
        keeper.stop()


@pytest.mark.parametrize("field", ["namespace", "engine_id"])
def test_a_lent_record_that_does_not_match_the_claim_is_never_used(tmp_path, engines, field):
    """The saved record of a's slab names another namespace (or another
    engine): a's claim adopts the slab without its pages, counted
    (``mismatch``, or ``no_record``: the record of an engine that never
    came is let go after the grace period), and nothing of it is kept
    when a leaves."""
    from kvelastic.daemon import saved
    from kvelastic.daemon.statefile import boot_id, write_state

    keeper, a, records = running_engine_then_daemon_killed(tmp_path, engines)
    try:
        daemon = DaemonProcess(tmp_path, memory="32MiB")
        books = saved_books(daemon)
        other = [msgspec.structs.replace(r, **{field: "other"}) if r.engine_id == "a" else r for r in books.lent]
        write_state(state_path(daemon.socket), saved.save(
            [], books.next_page, 0.0, other), boot=boot_id())
        daemon.start()
        assert daemon.status()["restart"]["lent_held"] == len(records)
        reason = "mismatch" if field == "namespace" else "no_record"
        wait_for(lambda: daemon.status()["restart"]["lent_unmatched"] == {reason: len(records)}, timeout=15,
                 what="a re-registered, its slabs adopted without their pages")
        status = daemon.status()
        assert status["restart"]["lent_adopted"] == 0 and status["pages"]["adopted"] > 0
        wait_for(lambda: f'kvelastic_restart_lent_slabs_unmatched_total{{reason="{reason}"}} {len(records)}.0'
                 in daemon.metrics(), what="the metrics' snapshot")
        wait_for(lambda: daemon.status()["restart"]["lent_let_go"] == len(records), timeout=20,
                 what="the unmatched records let go")
        assert kept(keeper)[0] == daemon.status()["pages"]["created"] == 0
        assert a.do("lookup", prefix="sys", n=4)["hits"] == 4                 # a serves on
        a.kill()
        wait_for(lambda: daemon.status()["pages"]["adopted"] == 0, what="a's slabs gone")
        assert kept_blocks(daemon, "llama-1") == 0                            # nothing of it kept
        daemon.stop()
    finally:
        keeper.stop()
