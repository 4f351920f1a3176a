"""The keeper as users start the daemon (``KVELASTIC_KEEPER``, default
``auto``): with none listening, ``kvelastic daemon`` starts one in a session
of its own, which outlives the daemon's ``kill -9``, hands the next daemon its
kept cache, and lets go of the pages ``KVELASTIC_KEEPER_LINGER`` after the
last daemon left. ``external`` starts none, ``off`` uses none. Real
processes throughout (the suite's other daemons run with ``external``:
tests/conftest.py)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

from kvelastic.keeper.client import KeeperClient
from kvelastic.keeper.server import lingered
from kvelastic.keeper.supervise import CONFIG_ERROR, RestartPolicy
from kvelastic.protocol import keeper_socket_path
from tests.daemon.test_orphan_cache import KEEP, cache_in_a_step, kept_blocks
from tests.daemon_proc import DaemonProcess, wait_for


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:    # a zombie (exited, not yet reaped by init) is gone
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def started_keeper(daemon: DaemonProcess) -> int:
    """The pid of the keeper ``daemon`` says it started."""
    found = re.findall(r"started a keeper \(pid (\d+)\)", daemon.log())
    assert found, daemon.log()[-3000:]
    return int(found[-1])


def held_pages(socket: str) -> int:
    with KeeperClient(keeper_socket_path(socket)) as k:
        return len(k.status().page_ids)


def leave_a_kept_cache(daemon: DaemonProcess, engines) -> None:
    """Engine ``a`` of llama-1 caches 4 blocks (KV bytes 7) and is killed: they
    are kept, and every page of the daemon is in its keeper."""
    a = engines(daemon, "a", namespace="llama-1", **KEEP)
    assert a.do("ensure", n=4)["ok"]
    cache_in_a_step(a, "sys", 4, value=7)
    a.do("flush")
    a.kill()
    wait_for(lambda: kept_blocks(daemon, "llama-1") == 4, what="a's cache kept")
    wait_for(lambda: held_pages(daemon.socket) == daemon.status()["pages"]["created"], what="every page deposited")


def test_linger_counts_from_the_last_daemon_gone():
    assert not lingered(None, 0, 0.0, 1e9)          # a keeper run on its own stays
    assert not lingered(5.0, 1, 0.0, 100.0)         # a daemon is connected
    assert not lingered(5.0, 0, 10.0, 14.9)         # the last one left 4.9 s ago
    assert lingered(5.0, 0, 10.0, 15.0)
    assert lingered(0.0, 0, 10.0, 10.0)


def test_the_daemon_starts_a_keeper_that_keeps_its_cache_through_kill_9(tmp_path, engines):
    """``auto``, as ``make run`` and ``kvelastic daemon`` start it: the kept
    cache of a departed engine survives the daemon's ``kill -9`` in the
    keeper the daemon started, the next daemon uses that keeper (it starts
    none) and adopts the cache, which the next engine of the namespace hits.
    Once no daemon is left, the keeper lets go of its pages and exits."""
    auto = {"KVELASTIC_KEEPER": "auto", "KVELASTIC_KEEPER_LINGER": "2s"}
    daemon = DaemonProcess(tmp_path, memory="32MiB", **auto).start()
    pid = started_keeper(daemon)
    try:
        assert os.getsid(pid) == pid != os.getsid(daemon.proc.pid)    # its own session: no terminal's signal
        leave_a_kept_cache(daemon, engines)
        daemon.kill()
        daemon.stop()
        assert alive(pid)                                   # the daemon's death is not the keeper's

        daemon = DaemonProcess(tmp_path, memory="32MiB", **auto).start()
        assert daemon.log().count("started a keeper") == 1, daemon.log()[-3000:]   # the same keeper
        assert daemon.status()["restart"]["kept_blocks"] == 4
        b = engines(daemon, "b", namespace="llama-1", **KEEP)
        assert b.do("ensure", n=1)["ok"]
        assert b.do("lookup", prefix="sys", n=4)["hits"] == 4
        assert 7 in b.do("read")["values"]                  # a's KV, through the daemon's kill -9
        b.close()
        daemon.stop()
        wait_for(lambda: not alive(pid), timeout=60, what="the keeper gone once no daemon came back")
        with open(keeper_socket_path(daemon.socket) + ".log") as f:
            log = f.read()
        assert "stopping (no daemon for 2 s)" in log, log
        assert not os.path.exists(keeper_socket_path(daemon.socket))
    finally:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_external_starts_no_keeper_and_off_uses_none(tmp_path, engines):
    """``external`` (systemd's units, the DaemonSet) only uses a keeper that
    listens; ``off`` does not use one even then: no page is deposited."""
    daemon = DaemonProcess(tmp_path, KVELASTIC_KEEPER="external").start()
    try:
        assert not os.path.exists(keeper_socket_path(daemon.socket))
        assert "started a keeper" not in daemon.log()
    finally:
        daemon.stop()
    env = dict(os.environ, KVELASTIC_SOCKET=daemon.socket)
    keeper = subprocess.Popen([sys.executable, "-m", "kvelastic", "keeper"], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: os.path.exists(keeper_socket_path(daemon.socket)), timeout=30, what="the keeper")
        daemon = DaemonProcess(tmp_path, KVELASTIC_KEEPER="off").start()
        try:
            a = engines(daemon, "a", **KEEP)
            assert a.do("ensure", n=4)["ok"]
            assert daemon.status()["pages"]["created"] > 0        # it made pages ...
            assert held_pages(daemon.socket) == 0                 # ... and deposited none
            a.close()
            assert "KVELASTIC_KEEPER=off" in daemon.log()
        finally:
            daemon.stop()
    finally:
        keeper.terminate()
        keeper.wait(10)


def test_restarts_back_off_and_a_bad_setting_is_not_retried():
    policy = RestartPolicy(first=1.0, most=8.0, steady=60.0)
    assert [policy.died(ran_for=0.5, status=1) for _ in range(5)] == [1.0, 2.0, 4.0, 8.0, 8.0]
    assert policy.died(ran_for=61.0, status=-9) == 1.0            # it had run steadily: the short wait again
    assert policy.died(ran_for=0.1, status=CONFIG_ERROR) is None


def children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def test_the_image_entrypoint_restarts_a_killed_daemon_with_its_kept_cache(tmp_path, engines):
    """``kvelastic keeper --with-daemon`` (the image's entrypoint): the daemon
    runs as the keeper's child; after its ``kill -9`` the keeper starts it
    again, and the new daemon adopts the kept cache; SIGTERM stops both,
    the daemon first (its sockets gone), status 0."""
    daemon = DaemonProcess(tmp_path, memory="32MiB", KVELASTIC_KEEPER="auto")   # its settings, not started
    top = subprocess.Popen([sys.executable, "-m", "kvelastic", "keeper", "--with-daemon"], env=daemon.env,
                           stdout=open(tmp_path / "top.log", "wb"), stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: children(top.pid) and daemon_answers(daemon), timeout=60, what="the daemon up")
        first = children(top.pid)
        leave_a_kept_cache(daemon, engines)
        os.kill(first[0], signal.SIGKILL)
        wait_for(lambda: children(top.pid) not in ([], first) and daemon_answers(daemon), timeout=60,
                 what="the daemon started again")
        assert daemon.status()["restart"]["kept_blocks"] == 4
        b = engines(daemon, "b", namespace="llama-1", **KEEP)
        assert b.do("ensure", n=1)["ok"]
        assert b.do("lookup", prefix="sys", n=4)["hits"] == 4
        b.close()
        top.terminate()
        assert top.wait(60) == 0
        assert not os.path.exists(daemon.socket) and not os.path.exists(keeper_socket_path(daemon.socket))
        log = (tmp_path / "top.log").read_text()
        assert "the daemon exited with status -9" in log and "started the daemon" in log, log
    finally:
        if top.poll() is None:
            top.kill()
            top.wait()


def daemon_answers(daemon: DaemonProcess) -> bool:
    try:
        daemon.status()
    except TimeoutError:
        return False
    return True
