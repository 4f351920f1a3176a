"""Who is behind the daemon's socket (security review, finding 10).

The socket folder is found by a path that someone else may have made first
(``/tmp/kvelastic-$UID``) or may re-point later (a symbolic link). The daemon
refuses a linked folder and a planted link in place of its own files; clients
(engines, workers, the operator commands) ask the kernel who listens
(``SO_PEERCRED``) and say nothing to a process that is not root, their own
user, or the owner of a folder nobody else could have made
(``kvelastic.client.trust``). Real processes throughout: a fake "daemon" runs
as uid 65534 and reports every byte it was sent.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from kvelastic import ctl
from kvelastic import protocol as p
from kvelastic.client.connection import Connection
from kvelastic.client.engine import EngineClient
from kvelastic.client.trust import UntrustedDaemon
from kvelastic.client.worker import WorkerClient
from kvelastic.core.pool import SlabPool
from kvelastic.vmm import get_backend
from tests.daemon_proc import DaemonProcess

ROOT = pathlib.Path(__file__).resolve().parents[2]
MiB = 1 << 20
PAGE = 2 * MiB
NOBODY = 65534

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run processes as another user")


def kvelastic(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvelastic", *args], capture_output=True, text=True, env=env,
                          timeout=30, cwd=ROOT)


def engine_client(socket_path: str, engine_id: str = "e1") -> EngineClient:
    return EngineClient(SlabPool(8), socket_path=socket_path, engine_id=engine_id, namespace="m1", page_size=PAGE,
                        pages_per_worker=1, num_workers=1, block_bytes=PAGE // 8, low_watermark=0, shrink_grace=60)


@pytest.fixture
def shared():
    """A folder under /tmp (root's, 0755) that uid 65534 can reach, unlike
    pytest's private tmp_path."""
    folder = pathlib.Path(tempfile.mkdtemp(prefix="kvelastic-trust-"))
    os.chmod(folder, 0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


# ------------------------------------------------------------ (a) the daemon
def test_a_daemon_refuses_a_socket_folder_that_is_a_symbolic_link(shared):
    """The finding: a link (made by anyone, in /tmp) to a folder the daemon's
    user owns was accepted, and re-pointed later. (In ``shared``: a short path,
    where the KV event sockets' names fit.)"""
    real = shared / "real"
    real.mkdir(mode=0o750)
    link = shared / "kvelastic-link"
    link.symlink_to(real)
    daemon = DaemonProcess(link, metrics=False)
    with pytest.raises(RuntimeError, match="exited with 1") as info:
        daemon.start()
    daemon.stop()
    log = daemon.log()
    assert f"the socket folder {link} is a symbolic link (to {real})" in log, log
    assert "KVELASTIC_SOCKET" in log and "remove the link" in log, log
    assert "Traceback" not in log and "ready" not in log, log
    assert sorted(os.listdir(real)) == ["daemon.log"], "nothing of the daemon's was made through the link"
    assert "is a symbolic link" in str(info.value)


def test_a_daemon_refuses_links_planted_in_place_of_its_files(shared):
    """A link where the daemon's socket or its hash-seed key will be (only a
    user who can write the folder could plant one): refused, never followed."""
    run = shared / "run"
    run.mkdir(mode=0o750)
    socket_path = run / "kvelastic.sock"
    (run / "kvelastic.sock.fd").symlink_to(shared / "elsewhere.sock")      # dangling: looks stale
    daemon = DaemonProcess(run, metrics=False)
    with pytest.raises(RuntimeError, match="exited with 1"):
        daemon.start()
    daemon.stop()
    assert f"{socket_path}.fd is a symbolic link" in daemon.log(), daemon.log()
    (run / "kvelastic.sock.fd").unlink()

    key = shared / "someone-elses-key"                  # a file of the right size and mode, elsewhere
    key.write_bytes(b"k" * 32)
    key.chmod(0o600)
    (run / "kvelastic.sock.hash-secret").symlink_to(key)
    daemon = DaemonProcess(run, metrics=False)
    with pytest.raises(RuntimeError, match="exited with 1"):
        daemon.start()
    daemon.stop()
    assert "kvelastic.sock.hash-secret is not a file (a symbolic link?)" in daemon.log(), daemon.log()


# ------------------------------------------------------ (b) a fake daemon
FAKE = r"""
import json, os, socket, sys, zmq
os.setgroups([]); os.setgid(65534); os.setuid(65534)       # everything imported: the interpreter is root's
where, how = sys.argv[1], sys.argv[2]
if how == "link":            # its own folder, and a link to it under the name the clients use
    os.mkdir(where + "-real", 0o755)
    os.symlink(where + "-real", where)
elif how == "own":           # its own folder, made first under the name the clients use
    os.mkdir(where, 0o755)
path = os.path.join(where, "kvelastic.sock")
ctx = zmq.Context()
router = ctx.socket(zmq.ROUTER)
router.setsockopt(zmq.LINGER, 0)
router.bind("ipc://" + path)
listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
listener.bind(path + ".fd")
listener.listen(16)
for name in (path, path + ".fd"):
    os.chmod(name, 0o777)                 # any victim may connect
poller = zmq.Poller()
poller.register(router, zmq.POLLIN)
poller.register(listener.fileno(), zmq.POLLIN)
poller.register(sys.stdin.fileno(), zmq.POLLIN)
got = {"uid": os.geteuid(), "connections": 0, "lifeline_bytes": "", "zmq": []}
conns = {}
print("ready", flush=True)
while True:
    events = dict(poller.poll(1000))
    if sys.stdin.fileno() in events:      # the test closed our stdin: report
        break
    if listener.fileno() in events:
        conn, _ = listener.accept()
        conns[conn.fileno()] = conn
        poller.register(conn.fileno(), zmq.POLLIN)
        got["connections"] += 1
    for fd, conn in list(conns.items()):
        if fd in events:
            data = conn.recv(65536)
            got["lifeline_bytes"] += data.hex()
            if not data:
                poller.unregister(fd)
                conns.pop(fd).close()
    if router in events:
        while router.poll(0):
            got["zmq"].append(router.recv_multipart()[-1].hex())
print(json.dumps(got), flush=True)
"""


class FakeDaemon:
    """A process of uid 65534 listening where a client looks for the daemon:
    a ZMQ ROUTER on ``<socket>`` and an AF_UNIX listener on ``<socket>.fd``."""

    def __init__(self, where: pathlib.Path, how: str) -> None:
        self.socket = str(where / "kvelastic.sock")
        self.proc = subprocess.Popen([sys.executable, "-c", FAKE, str(where), how], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, cwd="/")
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.strip() == "ready", f"the fake daemon did not start: {line!r}"

    def report(self) -> dict:
        """What it was sent, everything: it stops."""
        out, _ = self.proc.communicate(timeout=10)
        got = json.loads(out.strip().splitlines()[-1])
        got["messages"] = [type(p.decode(bytes.fromhex(frame))).__name__ for frame in got["zmq"]]
        return got

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def place(shared: pathlib.Path, how: str) -> pathlib.Path:
    """Where the fake listens, and the folder the clients are told to use.

    - ``link``: the finding itself. In a folder anyone may write (like /tmp),
      the fake made ``kvelastic-0`` a link to a folder of its own.
    - ``own``: in the same place, the fake made ``kvelastic-0`` a real folder
      of its own first (the predictable per-user default): its owner is the
      fake, so owning the folder proves nothing.
    - ``group``: a sound folder of root's that the fake's group may write; the
      fake's sockets are the ones there."""
    if how in ("link", "own"):
        tmp = shared / "tmp"
        tmp.mkdir()
        os.chmod(tmp, 0o1777)
        return tmp / "kvelastic-0"
    run = shared / "run"
    run.mkdir()
    os.chown(run, 0, NOBODY)
    os.chmod(run, 0o770)
    return run


@needs_root
@pytest.mark.parametrize("how", ["link", "own", "group"])
def test_clients_refuse_a_daemon_of_another_user_and_tell_it_nothing(shared, how):
    where = place(shared, how)
    fake = FakeDaemon(where, how)
    try:
        socket_path = fake.socket
        expected = {"link": "a symbolic link", "own": "is writable by every user",
                    "group": f"runs as uid {NOBODY}; expected root, this user (uid 0) or the owner"}[how]

        engine = engine_client(socket_path, "victim")
        with pytest.raises(UntrustedDaemon) as info:
            engine.start(timeout=3.0)
        assert info.value.uid == NOBODY and 0 in info.value.expected, info.value
        assert f"uid {NOBODY}" in str(info.value) and expected in str(info.value), str(info.value)
        assert info.value.reason == "untrusted_daemon"

        def register_worker(conn: Connection) -> None:
            conn.call(p.RegisterWorker(version=p.PROTOCOL_VERSION, engine_id="victim", rank=0, pid=os.getpid(),
                                       token=conn.token))

        worker = Connection(socket_path, "victim", 0, name="victim-worker", on_command=lambda msg: None,
                            handshake=register_worker)
        worker.token = b"the engine's secret"
        with pytest.raises(UntrustedDaemon, match=f"uid {NOBODY}"):
            worker.start(timeout=3.0)

        with pytest.raises(UntrustedDaemon, match=f"uid {NOBODY}"):
            ctl.get_status(socket_path, timeout=1.0)
        env = dict(os.environ, KVELASTIC_SOCKET=socket_path)
        for args in (("status",), ("limit", "victim", "0", "8MiB")):
            out = kvelastic(env, *args)
            assert out.returncode == 1 and out.stdout == "", out
            assert out.stderr.startswith(f"kvelastic {args[0]}: refused: ") and f"uid {NOBODY}" in out.stderr, out
            assert expected in out.stderr and "KVELASTIC_SOCKET" in out.stderr, out.stderr
    finally:
        got = fake.report() if fake.proc.poll() is None else {}
        fake.kill()
    assert got["uid"] == NOBODY
    assert got["connections"] >= 2, got              # engine and worker did reach it...
    assert got["lifeline_bytes"] == "", got          # ...and sent no hello (engine id, secret)
    assert got["messages"] == [], got                # no RegisterEngine, RegisterWorker or request


# --------------------------------------------------- (c) what still works
def check_engine_and_commands(socket_path: str, env: dict) -> None:
    engine = engine_client(socket_path).start()
    worker = WorkerClient(get_backend("host"), socket_path=socket_path, engine_id="e1", rank=0,
                          token=engine.token).start()
    try:
        assert engine.ensure(16)
        (entry,) = ctl.get_status(socket_path)["engines"]
        assert entry["engine_id"].split("@")[0] == "e1" and entry["slabs"] == 2
        out = kvelastic(dict(env, KVELASTIC_SOCKET=socket_path), "status", "--json")
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["engines"][0]["engine_id"].split("@")[0] == "e1"
    finally:
        engine.close()
        worker.close()


def test_a_daemon_of_the_same_user_is_trusted(daemon):
    check_engine_and_commands(daemon.socket, daemon.env)


CLIENT_AS_NOBODY = r"""
import json, os, sys
sys.path.insert(0, sys.argv[2])
from kvelastic import ctl
from kvelastic.client.engine import EngineClient
from kvelastic.core.pool import SlabPool
os.setgroups([]); os.setgid(65534); os.setuid(65534)       # everything imported: the interpreter is root's
engine = EngineClient(SlabPool(8), socket_path=sys.argv[1], engine_id="nobody", namespace="m1", page_size=2 << 20,
                      pages_per_worker=1, num_workers=0, block_bytes=(2 << 20) // 8, low_watermark=0).start(10)
try:
    status = ctl.get_status(sys.argv[1])
finally:
    engine.close()
print(json.dumps({"token": len(engine.token), "engines": [e["engine_id"] for e in status["engines"]]}))
"""


@needs_root
def test_a_daemon_running_as_root_is_trusted_by_another_user(shared):
    run = shared / "run"
    run.mkdir()
    os.chown(run, 0, NOBODY)
    os.chmod(run, 0o750)                               # the kvelastic group (here 65534) may enter
    daemon = DaemonProcess(run, metrics=False, KVELASTIC_SOCKET_GROUP=str(NOBODY)).start()
    try:
        out = subprocess.run([sys.executable, "-c", CLIENT_AS_NOBODY, daemon.socket, str(ROOT)], capture_output=True,
                             text=True, timeout=60, cwd="/")
        assert out.returncode == 0, out.stdout + out.stderr
        got = json.loads(out.stdout.splitlines()[-1])
        assert got["token"] == 32 and [e.split("@")[0] for e in got["engines"]] == ["nobody"], out.stdout
    finally:
        daemon.stop()


DAEMON_AS_NOBODY = r"""
import os, sys
import grp, resource, prometheus_client
import kvelastic.vmm.cuda, kvelastic.vmm.host
from kvelastic.daemon.main import main
os.setgroups([]); os.setgid(65534); os.setuid(65534)       # everything imported: the interpreter is root's
sys.exit(main())
"""


@needs_root
def test_a_daemon_run_as_the_owner_of_its_folder_is_trusted(shared):
    """A service user's daemon in its own folder (``/run/kvelastic`` made by
    systemd for ``User=kvelastic``), which only root could have made: its
    clients of other users trust the folder's owner."""
    svc = shared / "svc"
    svc.mkdir(mode=0o750)
    os.chown(svc, NOBODY, NOBODY)
    daemon = DaemonProcess(svc, metrics=False)
    daemon._log = open(daemon.log_path, "ab")
    daemon.proc = subprocess.Popen([sys.executable, "-c", DAEMON_AS_NOBODY], env=daemon.env, cwd=ROOT,
                                   stdout=daemon._log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 15
        while not os.path.exists(p.fd_socket_path(daemon.socket)) or not os.path.exists(daemon.socket):
            assert daemon.proc.poll() is None and time.monotonic() < deadline, daemon.log()
            time.sleep(0.05)
        assert os.stat(daemon.socket).st_uid == NOBODY
        check_engine_and_commands(daemon.socket, daemon.env)
    finally:
        daemon.stop()

