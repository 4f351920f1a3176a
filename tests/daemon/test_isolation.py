"""No tenant sees another tenant's memory, even through a worker that lies.

A page that moves to another engine is a fresh physical page (invariant 6):
a worker that acknowledges an unmap but keeps the mapping sees only what its
own engine wrote, and the engine that gets the memory next starts from zeros.
(Found on an earlier daemon, which zeroed pages and lent the same memory on:
the stale mapping read the next tenant's data, and could write into it.)
"""

from tests.daemon.books import held
from tests.daemon.hostile import Driver
from tests.daemon_proc import wait_for


def test_a_stale_mapping_never_shows_the_next_tenants_data(daemon_factory, tmp_path):
    daemon = daemon_factory(memory="8MiB")                                # 4 pages
    a = Driver(daemon.socket, "a", namespace="tenant-a", keep_mappings=True, grace=0.2)
    b = Driver(daemon.socket, "b", namespace="tenant-b", grace=60)
    try:
        assert a.do("ensure", n=16)["ok"]                                 # the whole budget
        assert a.do("write", value=0xA1)["values"] == [0xA1] * 4
        wait_for(lambda: held(daemon, "a") == 0, timeout=5, what="a's idle slabs returned")
        assert b.do("ensure", n=16)["ok"]                                 # the same budget, now b's
        assert b.do("read")["values"] == [0] * 4                          # nothing of a's KV
        assert b.do("write", value=0xB2)["values"] == [0xB2] * 4          # b's secret
        assert a.do("read_stale")["values"] == [0xA1] * 4                 # a still sees only its own bytes
        assert b.do("read")["values"] == [0xB2] * 4
    finally:
        a.close()
        b.close()


def test_an_impostors_page_channel_never_gets_another_engines_pages(daemon_factory):
    """A local process greets the page channel as engine a's worker 0 before
    a grows: without a's secret it gets no descriptor, and a's own worker maps
    every page (identity)."""
    import socket

    from kvelastic import protocol as p

    daemon = daemon_factory(memory="8MiB")
    a = Driver(daemon.socket, "a", grace=60)
    impostor = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    impostor.connect(p.fd_socket_path(daemon.socket))
    p.write_hello(impostor, "a", 0, b"guessed-secret")
    try:
        assert a.do("ensure", n=16)["ok"]                                 # 4 slabs, mapped by a's worker
        assert a.do("write", value=7)["values"] == [7] * 4
        impostor.settimeout(0.5)
        try:
            got = impostor.recv(64)
        except TimeoutError:
            got = None
        assert got is None, f"the impostor received {got!r}"
    finally:
        impostor.close()
        a.close()


def test_a_user_outside_the_daemons_user_and_group_cannot_connect():
    """``SO_PEERCRED`` (page channel) and libzmq's IPC filter (control socket):
    even with the sockets opened to everyone, another user is refused."""
    import os
    import shutil
    import stat
    import subprocess
    import sys
    import tempfile

    import pytest

    from kvelastic import protocol as p
    from tests.daemon.books import rejected
    from tests.daemon_proc import DaemonProcess

    if os.geteuid() != 0:
        pytest.skip("needs root to run a client as another user")
    folder = tempfile.mkdtemp(prefix="kvelastic-perm-")     # a path another user can reach
    os.chmod(folder, 0o755)
    daemon = DaemonProcess(__import__("pathlib").Path(folder)).start()
    try:
        check_refused(daemon, p, rejected, subprocess, sys, stat)
    finally:
        daemon.stop()
        shutil.rmtree(folder, ignore_errors=True)


def check_refused(daemon, p, rejected, subprocess, sys, stat):
    import os

    for path in (daemon.socket, p.fd_socket_path(daemon.socket)):
        os.chmod(path, 0o666)
    probe = f"""
import os, socket, sys, zmq
sys.path.insert(0, {str(pathlib_root())!r})
from kvelastic import protocol as p
os.setgid(65534); os.setuid(65534)
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(p.fd_socket_path({daemon.socket!r}))
s.settimeout(3)
try:                                   # the daemon closes it at once (the hello may not even go out)
    p.write_hello(s, "intruder", -1)
    closed = s.recv(1) == b""
except (ConnectionResetError, BrokenPipeError):
    closed = True
d = zmq.Context().socket(zmq.DEALER); d.setsockopt(zmq.LINGER, 0)
d.connect("ipc://" + {daemon.socket!r}); d.send(p.encode(p.Status(req_id=1)))
answered = bool(d.poll(1500))
print(closed, answered)
"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=30)
    assert out.stdout.split() == ["True", "False"], out.stdout + out.stderr
    assert rejected(daemon).get("not_allowed") == 1
    assert stat.S_IMODE(os.stat(daemon.socket).st_mode) == 0o666


def pathlib_root():
    import pathlib

    return pathlib.Path(__file__).resolve().parents[2]
