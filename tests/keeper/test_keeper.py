"""The keeper (``kvelastic keeper``) as a real process: pages deposited by a
process outlive it, come back whole, are let go when forgotten; bad requests
change nothing; only the daemon's user may use it, and only a keeper of the
daemon's user is handed pages."""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest

from kvelastic.keeper import messages as m
from kvelastic.keeper.client import KeeperClient, KeeperRefused
from kvelastic.protocol import keeper_socket_path
from kvelastic.vmm.fdchannel import FdChannel
from tests.daemon.hostile import tenant_script
from tests.daemon_proc import short_dir, wait_for

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGE = 64 << 10


class KeeperProcess:
    def __init__(self, folder: pathlib.Path, socket: str | None = None) -> None:
        """``socket``: the daemon's (its keeper listens beside it), by default one in ``folder``."""
        self.socket = socket or str(folder / "kv.sock")
        self.path = keeper_socket_path(self.socket)
        self.log_path = folder / "keeper.log"
        self.env = dict(os.environ, KVELASTIC_SOCKET=self.socket)

    def start(self) -> KeeperProcess:
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "kvelastic", "keeper"], env=self.env,
                                     stdout=self._log, stderr=subprocess.STDOUT)
        wait_for(lambda: "ready" in self.log() or self.proc.poll() is not None, timeout=30, what="the keeper")
        assert self.proc.poll() is None, self.log()
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def open_fds(self) -> int:
        """The memfd pages the keeper process holds open (what its descriptors say they are)."""
        fds, pages = f"/proc/{self.proc.pid}/fd", 0
        for fd in os.listdir(fds):
            try:
                pages += os.readlink(f"{fds}/{fd}").startswith("/memfd:")
            except FileNotFoundError:          # closed meanwhile (a connection's socket)
                pass
        return pages

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self._log.close()
        return self.proc.returncode


@pytest.fixture
def keeper(tmp_path):
    k = KeeperProcess(short_dir(tmp_path)).start()
    yield k
    k.stop()


def page(pattern: int) -> int:
    fd = os.memfd_create(f"page-{pattern}")
    os.write(fd, bytes([pattern]) * PAGE)
    return fd


DEPOSITOR = """
import os, sys
sys.path.insert(0, {root!r})
from kvelastic.keeper.client import KeeperClient
fds = []
for pattern in (7, 8, 9):
    fd = os.memfd_create("page")
    os.write(fd, bytes([pattern]) * {size})
    fds.append((100 + pattern, fd))
with KeeperClient({path!r}) as k:
    print("HELD", k.keep(fds), flush=True)
    os.kill(os.getpid(), 9)                 # as a daemon killed with its pages' only descriptors
"""


def test_pages_outlive_the_process_that_made_them(keeper):
    out = subprocess.run([sys.executable, "-c", DEPOSITOR.format(root=str(ROOT), size=PAGE, path=keeper.path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == -signal.SIGKILL and out.stdout.strip() == "HELD 3", out.stdout + out.stderr
    with KeeperClient(keeper.path) as k:
        status = k.status()
        assert status.page_ids == [107, 108, 109] and status.bytes == 3 * PAGE
        taken = k.take([109, 107, 555])                               # 555: never deposited
        assert [page_id for page_id, _ in taken] == [109, 107]
        for page_id, fd in taken:
            assert os.pread(fd, PAGE, 0) == bytes([page_id - 100]) * PAGE   # the memory, whole
            os.close(fd)
        assert k.status().page_ids == [107, 108, 109]                 # taking is not forgetting


def test_forgotten_pages_are_let_go_and_a_page_id_keeps_its_first_page(keeper):
    fds = [(i, page(i)) for i in range(3)]
    with KeeperClient(keeper.path) as k:
        base = keeper.open_fds()
        assert k.keep(fds) == 3
        assert keeper.open_fds() == base + 3
        assert k.keep([(1, page(99))]) == 3                            # a duplicate id: the first page stays
        assert keeper.open_fds() == base + 3
        (_, fd), = k.take([1])
        assert os.pread(fd, 1, 0) == bytes([1])
        os.close(fd)
        assert k.forget([0, 2, 42]) == [0, 2]
        assert keeper.open_fds() == base + 1 and k.status().page_ids == [1]
    for _, fd in fds:
        os.close(fd)


def test_a_batch_past_the_kernels_descriptor_limit_goes_and_comes_back_whole(keeper):
    fds = [(i, page(i % 251)) for i in range(300)]                    # SCM_MAX_FD is 253 a message
    with KeeperClient(keeper.path) as k:
        assert k.keep(fds) == 300
        taken = k.take(range(300))
        assert [i for i, _ in taken] == list(range(300))
        assert all(os.pread(fd, 1, PAGE - 1) == bytes([i % 251]) for i, fd in taken)
    for _, fd in [*fds, *taken]:
        os.close(fd)


@pytest.mark.parametrize("bad", ["garbage", "fds_on_forget", "twice", "unknown_field"])
def test_a_bad_request_is_refused_counted_and_changes_nothing(keeper, bad):
    with KeeperClient(keeper.path) as k:
        k.keep([(1, page(1))])
        before, fds = k.status(), keeper.open_fds()
    stray = page(5)
    command, items = {
        "garbage": (b"\xc1not msgpack", [(9, stray)]),
        "fds_on_forget": (m.encode(m.Forget(page_ids=[1])), [(9, stray)]),
        "twice": (m.encode(m.Keep()), [(9, stray), (9, stray)]),
        "unknown_field": (b"\x82\xa4type\xa5Query\xa3bad\x01", []),
    }[bad]
    with FdChannel.connect(keeper.path) as chan:
        chan.send(items, command)
        _, reply = chan.recv_batch()
    refused = m.decode_reply(reply)
    assert isinstance(refused, m.Refused) and refused.reason == "bad_request", refused
    os.close(stray)
    with KeeperClient(keeper.path) as k:
        after = k.status()
    assert keeper.open_fds() == fds                                   # the page that came with it was closed
    assert after.page_ids == before.page_ids and after.bytes == before.bytes
    assert after.refused == {"bad_request": 1}
    assert "refused a request (bad_request)" in keeper.log()


def test_a_peer_that_stalls_mid_request_is_dropped_and_the_keeper_goes_on(keeper):
    with FdChannel.connect(keeper.path) as stalled:
        stalled.sock.sendall(b"\x56\x4b")                              # half a frame header, then nothing
        with KeeperClient(keeper.path) as k:
            wait_for(lambda: "a connection dropped" in keeper.log(), timeout=30, what="the stalled peer dropped")
            assert k.status().page_ids == []


def test_a_second_keeper_on_the_same_socket_refuses_to_start(keeper, tmp_path):
    second = subprocess.run([sys.executable, "-m", "kvelastic", "keeper"], env=keeper.env, capture_output=True,
                            text=True, timeout=60)
    assert second.returncode == 1 and "a keeper already listens on" in second.stderr
    with KeeperClient(keeper.path) as k:                               # the first still serves
        assert k.status().page_ids == []


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a process as another user")
def test_a_process_of_another_user_is_refused():
    folder = pathlib.Path(tempfile.mkdtemp(prefix="kvk-"))
    folder.chmod(0o755)                              # reachable by all (pytest's own folders are not)
    keeper = KeeperProcess(folder).start()
    os.chmod(keeper.path, 0o666)                     # even a socket others could open: the keeper checks the uid
    code = ("from kvelastic.vmm.fdchannel import FdChannel\n"
            "from kvelastic.keeper import messages as m\n"
            f"c = FdChannel.connect({keeper.path!r})\n"
            "try:\n"
            "    c.send([], m.encode(m.Query())); c.recv_batch(); print('ANSWERED')\n"
            "except Exception as exc:\n"
            "    print('CLOSED', type(exc).__name__)\n")
    try:
        out = subprocess.run(tenant_script((6001, 6001), code, ROOT), capture_output=True, text=True, timeout=60,
                             cwd=ROOT)
        assert out.stdout.startswith("CLOSED"), out.stdout + out.stderr
        with KeeperClient(keeper.path) as k:
            assert k.status().refused == {"not_allowed": 1}
        assert "only uid 0 may use the keeper" in keeper.log()
    finally:
        keeper.stop()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a process as another user")
def test_no_page_is_handed_to_a_keeper_of_another_user():
    folder = pathlib.Path(tempfile.mkdtemp(prefix="kvk-"))
    folder.chmod(0o777)
    path = str(folder / "kv.sock.keeper")
    code = ("import socket\n"
            f"s = socket.socket(socket.AF_UNIX); s.bind({path!r}); s.listen(1)\n"
            f"os.chmod({path!r}, 0o777); print('READY', flush=True)\n"
            "c, _ = s.accept(); time.sleep(30)\n")
    impostor = subprocess.Popen(tenant_script((6001, 6001), code, ROOT), stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert impostor.stdout.readline().strip() == "READY"
        with pytest.raises(KeeperRefused, match="runs as uid 6001"):
            KeeperClient(path)
    finally:
        impostor.kill()
        impostor.wait()
        shutil.rmtree(folder, ignore_errors=True)

