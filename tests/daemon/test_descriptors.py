"""Page channels are capped: a local process cannot exhaust the daemon's file
descriptors, and running out of them does not crash it (finding 5)."""

import socket
import time

from kvelastic import protocol as p
from tests.daemon.hostile import Driver, open_lifeline
from tests.daemon_proc import DaemonProcess, wait_for


def connect_patiently(socket_path: str, engine_id: str):
    """A client backs off while the daemon's accept backlog is full (it caps
    how many connections may be greeting at once)."""
    deadline = time.monotonic() + 10
    while True:
        try:
            return open_lifeline(socket_path, engine_id)
        except BlockingIOError:
            assert time.monotonic() < deadline, "the daemon never took the connection"
            time.sleep(0.02)


def test_channels_of_engines_that_never_register_are_closed(tmp_path):
    daemon = DaemonProcess(tmp_path).start()
    try:
        socks = [connect_patiently(daemon.socket, f"nobody-{i}") for i in range(300)]
        a = Driver(daemon.socket, "a", grace=60)                          # a real engine meanwhile
        assert a.do("ensure", n=4)["ok"]

        def all_closed() -> bool:
            for s in socks:
                s.settimeout(0.01)
                try:
                    if s.recv(1) != b"":
                        return False
                except TimeoutError:
                    return False
            return True

        wait_for(all_closed, timeout=p.REGISTER_TIMEOUT + 10, interval=0.5, what="unclaimed channels closed")
        assert a.do("ensure", n=8)["ok"]                                 # the real engine is untouched
        for s in socks:
            s.close()
        a.close()
    finally:
        daemon.stop()


def test_running_out_of_descriptors_does_not_kill_the_daemon(tmp_path):
    daemon = DaemonProcess(tmp_path)
    daemon.start()
    try:
        import resource
        # the daemon's limit is what it inherits: lower it by prlimit on the running process
        soft, hard = resource.prlimit(daemon.proc.pid, resource.RLIMIT_NOFILE)
        resource.prlimit(daemon.proc.pid, resource.RLIMIT_NOFILE, (100, hard))
        socks = []
        for i in range(150):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(1.0)
            try:
                s.connect(p.fd_socket_path(daemon.socket))
                p.write_hello(s, f"flood-{i}", -1)
            except OSError:
                s.close()
                continue
            socks.append(s)
        time.sleep(1.0)
        assert daemon.proc.poll() is None, daemon.log()[-2000:]
        for s in socks:
            s.close()
        resource.prlimit(daemon.proc.pid, resource.RLIMIT_NOFILE, (soft, hard))
        wait_for(lambda: isinstance(daemon.request(p.Status(), timeout=2), p.StatusReply), timeout=10,
                 what="the daemon answering again")
        a = Driver(daemon.socket, "a", grace=60)
        assert a.do("ensure", n=4)["ok"]
        a.close()
    finally:
        daemon.stop()
