"""An invalidation is final for the tier: blocks of the namespace still
queued for the tier's writer (or being written) when ``kvelastic
invalidate`` comes are never written, and a restart right after it, by
SIGTERM (the writer writes what is queued) or by SIGKILL (a write may have
ended just before), restores nothing of the namespace.

Real processes: the daemon with a tier on disk, a tenant's engine (uid
6001, in the socket group) whose kept cache of 256 blocks of 1 MiB expires
into the tier (demotion source A), and the operator's ``invalidate`` sent
while the writer still has most of it queued (``status`` says how much is
being written; the test checks that it invalidated pending blocks, so it
proves what it claims). In process: the writer itself, held before its
first write, shows the cancel rule without any timing at all.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import tempfile
import threading

import pytest

from kvelastic import protocol as p
from kvelastic.tier.disk import DiskStore
from kvelastic.tier.writer import TierWriter, WriteJob
from tests.daemon.engines import EngineProcess
from tests.daemon_proc import DaemonProcess, wait_for

pytestmark = pytest.mark.skipif(__import__("tests.backend").backend.TEST_BACKEND != "host",
                                reason="demotion source A reads memfd pages: host backend")

GROUP = 4242
ALICE = (6001, GROUP)
# Small blocks (16 KiB: slabs of 2 pages, 256 blocks), many of them: the
# writer spends a file's open, write and rename on each, far more than the
# loop's read of it, so most are still queued when the invalidation comes.
BLOCKS, BPS = 8192, 256
KEEP = {"grace": 60, "journal_interval": 3600}


def writer_held(tmp_path, gate: threading.Event) -> TierWriter:
    """A real writer over a real store whose thread waits for ``gate`` before its first job."""
    class Held(TierWriter):
        def _run(self) -> None:
            gate.wait(30)
            super()._run()

    return Held(DiskStore(tmp_path / "tier"))


def test_a_write_deleted_while_queued_is_never_written_not_even_by_a_stop(tmp_path):
    gate = threading.Event()
    writer = writer_held(tmp_path, gate)
    for slot in range(4):
        writer.submit(WriteJob(slot, "ns", b"k%d" % slot, None, 1.0, bytes([slot]) * 4096))
    writer.delete(1)
    writer.delete(2)              # invalidated while queued
    gate.set()
    writer.close()                # a graceful stop writes what is queued
    names = sorted(e.slot for e in DiskStore(tmp_path / "tier").scan().entries)
    assert names == [0, 3]


def test_a_write_deleted_after_it_ran_leaves_no_file_and_no_cancel_behind(tmp_path):
    writer = TierWriter(DiskStore(tmp_path / "tier"))
    writer.submit(WriteJob(7, "ns", b"k", None, 1.0, b"x" * 4096))
    wait_for(lambda: writer.finished()[0] == [7] or not writer.queued, what="the write reported")
    writer.delete(7)
    assert not (tmp_path / "tier" / f"{7:016x}.kvb").exists() and not writer._cancelled
    writer.close()


@pytest.fixture
def node():
    folder = pathlib.Path(tempfile.mkdtemp(prefix="kve-final-"))
    folder.chmod(0o755)                      # the tenant's engine reaches the socket
    tier = folder / "tier"
    tier.mkdir(mode=0o700)
    env = dict(KVELASTIC_SOCKET_GROUP=str(GROUP), KVELASTIC_TIER_DIR=str(tier), KVELASTIC_TIER_SIZE="1GiB",
               KVELASTIC_ORPHAN_CACHE_TTL="1s")
    daemons: list[DaemonProcess] = []

    def start() -> DaemonProcess:
        d = DaemonProcess(folder, memory="512MiB", **env).start()
        daemons.append(d)
        return d

    yield folder, tier, start
    for d in daemons:
        d.stop()
    shutil.rmtree(folder, ignore_errors=True)


def kept_cache_demoting(daemon: DaemonProcess, tier: pathlib.Path) -> str:
    """Alice's engine fills its slabs with cached blocks and dies; its kept cache
    expires into the tier. Returns its namespace (as the daemon names it, read
    while it runs) once the writer has begun: its first file is in the folder.
    Why the folder and not ``status``: the status snapshot comes once the loop's
    pass that read the blocks ends, and on a quiet machine the writer has
    finished by then (it writes as fast as the loop reads)."""
    a = EngineProcess(daemon.socket, "a", user=ALICE, namespace="llama", ppw=2, bps=BPS, **KEEP)
    try:
        assert a.do("ensure", n=BLOCKS, timeout=60)["ok"]
        (namespace,) = {e["namespace"] for e in daemon.status()["engines"]}
        step = a.do("step")["step"]
        assert a.do("alloc", n=BLOCKS)["ok"]
        a.do("cache", prefix="sys")
        a.do("seal")
        a.do("write", value=7)
        a.do("end_step", n=step)
        a.do("free")
        a.do("flush")
    finally:
        a.kill()
    wait_for(lambda: any(os.scandir(tier)), timeout=30, interval=0.001, what="the kept cache's demotion under way")
    return namespace


@pytest.mark.parametrize("stop", ["sigterm", "sigkill"])
def test_a_restart_right_after_an_invalidation_restores_nothing_of_it(node, stop):
    folder, tier, start = node
    daemon = start()
    namespace = kept_cache_demoting(daemon, tier)
    done = daemon.request(p.Invalidate(target=namespace), timeout=30)
    assert isinstance(done, p.Invalidated) and done.tier_blocks == BLOCKS, done
    # The writer had blocks queued: they are cancelled, not written (the test proves the case it claims).
    line = next(x for x in reversed(daemon.log().splitlines()) if "of the tier invalidated" in x)
    assert int(line.split("(")[-1].split()[0]) > 0, line
    daemon.kill(signal.SIGTERM if stop == "sigterm" else signal.SIGKILL)
    leftovers = [n for n in os.listdir(tier) if n.endswith(".kvb")]
    assert leftovers == [], f"{len(leftovers)} file(s) of the invalidated namespace left on disk"

    again = start()
    status = again.status()["tier"]
    assert status["blocks"] == 0 and status["namespaces"] == {}
    assert status["counters"]["restored"] == 0
