"""A real daemon in a subprocess, for tests that need one (the tests' backend:
host pages unless ``KVELASTIC_TEST_BACKEND=cuda``, see ``tests/backend.py``)."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

import msgspec
import zmq

from kvelastic import protocol as p
from kvelastic_tools.ports import free_port as free_port  # re-exported: callers name it here
from tests.backend import TEST_BACKEND

MiB = 1 << 20


# A Unix socket path holds at most 107 bytes; the daemon's longest is the
# socket's plus ".kv-events-replay". pytest-xdist's temporary folders
# (.../popen-gw0/test_a_long_name0/) can pass that.
MAX_SOCKET_DIR = 107 - len("/kvelastic.sock.kv-events-replay")


def short_dir(tmp: pathlib.Path) -> pathlib.Path:
    """``tmp``, or a folder under /tmp of its own when ``tmp`` is too long for a socket."""
    if len(str(tmp)) <= MAX_SOCKET_DIR:
        return tmp
    return pathlib.Path(tempfile.mkdtemp(prefix="kve-"))


class DaemonProcess:
    def __init__(self, tmp: pathlib.Path, memory: str = "64MiB", metrics: bool = True, nofile: int = 0,
                 **env: str) -> None:
        """``nofile``: the daemon's descriptor limit (soft and hard), 0: as inherited."""
        self.nofile = nofile
        self.socket = str(short_dir(tmp) / "kvelastic.sock")
        self.metrics_port = free_port() if metrics else 0
        self.log_path = tmp / "daemon.log"
        self.env = dict(os.environ, KVELASTIC_SOCKET=self.socket, KVELASTIC_MEMORY=memory,
                        KVELASTIC_BACKEND=TEST_BACKEND, KVELASTIC_METRICS_PORT=str(self.metrics_port),
                        KVELASTIC_METRICS_ADDR="127.0.0.1", KVELASTIC_LOG_LEVEL="info", **env)
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 15.0) -> DaemonProcess:
        for _ in range(4):
            started = self.log_path.stat().st_size if self.log_path.exists() else 0
            if self._start(timeout):
                return self
            # The free port it was given was taken before the daemon bound it
            # (another test's process, under pytest-xdist): another port.
            if b"Address already in use" not in self.log_path.read_bytes()[started:] or not self.metrics_port:
                break
            self.metrics_port = free_port()
            self.env["KVELASTIC_METRICS_PORT"] = str(self.metrics_port)
        raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.log()}")

    def _start(self, timeout: float) -> bool:
        """Whether the daemon came up (False: it exited)."""
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "kvelastic", "daemon"], env=self.env,
                                     stdout=self._log, stderr=subprocess.STDOUT, preexec_fn=self._limits)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._log.close()
                return False
            try:
                self.request(p.Status(), timeout=0.5)
                return True
            except TimeoutError:
                pass
        raise RuntimeError(f"daemon did not come up:\n{self.log()}")

    def _limits(self) -> None:   # in the child, before exec
        if self.nofile:
            import resource

            resource.setrlimit(resource.RLIMIT_NOFILE, (self.nofile, self.nofile))

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def request(self, msg: p.Msg, timeout: float = 5.0) -> p.Msg:
        """One request on a fresh DEALER (what the CLI does)."""
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(f"ipc://{self.socket}")
            msg.req_id = 1
            sock.send(p.encode(msg))
            if not sock.poll(int(timeout * 1000)):
                raise TimeoutError("no reply")
            return p.decode(sock.recv())
        finally:
            sock.close(0)

    def send_raw(self, frames: list[bytes], timeout: float = 5.0) -> p.Msg:
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(f"ipc://{self.socket}")
            sock.send_multipart(frames)
            if not sock.poll(int(timeout * 1000)):
                raise TimeoutError("no reply")
            return p.decode(sock.recv())
        finally:
            sock.close(0)

    def status(self) -> dict:
        return msgspec.to_builtins(self.request(p.Status()).status)

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            return r.read().decode()

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(10)

    def stop(self) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def wait_for(predicate, timeout: float = 5.0, interval: float = 0.02, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def status_json(daemon: DaemonProcess) -> str:
    return json.dumps(daemon.status(), sort_keys=True)
