"""Dynamo's standalone KV indexer (``python -m dynamo.indexer``), run for tests and ``bench route``.

The indexer binds its HTTP port on 0.0.0.0 and has no option to bind
elsewhere, so it runs in a network namespace of its own (``unshare -n``, with
only loopback up): nothing outside this machine's tests can reach it. It
subscribes to engines through ZMQ ``ipc://`` endpoints, which are unix
sockets in the file system and so work across network namespaces. Its HTTP
API is reached from a thread that joins the indexer's namespace
(``setns(2)``) just long enough to open a TCP connection: a socket keeps the
namespace it was created in, so the rest of the exchange runs anywhere.
``loopback_url`` relays a port on this namespace's 127.0.0.1 to it, for a
process (``kvelastic router``) that takes a URL.
"""

from __future__ import annotations

import ctypes
import http.client
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Any

CLONE_NEWNET = 0x40000000
PORT = 8090   # the namespace is the indexer's own: any port is free


def available() -> str | None:
    """Why the indexer cannot run here, or None."""
    try:
        import dynamo.llm  # noqa: F401
    except ImportError as exc:
        return f"ai-dynamo-runtime not installed ({exc})"
    for tool in ("unshare", "ip"):
        if shutil.which(tool) is None:
            return f"{tool} not found"
    probe = subprocess.run(["unshare", "-n", "ip", "link", "set", "lo", "up"], capture_output=True, text=True)
    if probe.returncode:
        return f"cannot make a network namespace: {probe.stderr.strip()}"
    return None


def _connect_in(netns: str, port: int, timeout: float) -> Any:
    """A TCP connection to 127.0.0.1:port inside the namespace ``netns`` (a path)."""
    import socket

    out: dict[str, Any] = {}

    def run() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = os.open(netns, os.O_RDONLY)
            try:
                if libc.setns(fd, CLONE_NEWNET):
                    raise OSError(ctypes.get_errno(), "setns")
            finally:
                os.close(fd)
            out["sock"] = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        except OSError as exc:
            out["error"] = exc

    # A thread of its own: setns changes the calling thread only, and this one ends here.
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["sock"]


class _NsConnection(http.client.HTTPConnection):
    def __init__(self, netns: str, port: int, timeout: float) -> None:
        super().__init__("127.0.0.1", port, timeout=timeout)
        self.netns = netns

    def connect(self) -> None:
        self.sock = _connect_in(self.netns, self.port, self.timeout or 10.0)


class DynamoIndexer:
    def __init__(self, log_path: pathlib.Path, threads: int = 1) -> None:
        self.log_path = log_path
        self.threads = threads
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0) -> DynamoIndexer:
        self._log = open(self.log_path, "ab")
        # unshare -n makes the namespace and execs sh (no fork): the pid is the indexer's.
        cmd = ["unshare", "-n", "sh", "-c",
               f'ip link set lo up && exec "$0" -m dynamo.indexer --port {PORT} --threads {self.threads}',
               sys.executable]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "info")})
        self.netns = f"/proc/{self.proc.pid}/ns/net"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"indexer exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            try:
                if self.request("GET", "/health", timeout=1.0)[0] == 200:
                    return self
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"indexer not ready in {timeout:.0f} s:\n{self.log()[-3000:]}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def request(self, method: str, path: str, body: Any = None, timeout: float = 10.0) -> tuple[int, Any]:
        conn = _NsConnection(self.netns, PORT, timeout)
        try:
            data = None if body is None else json.dumps(body).encode()
            conn.request(method, path, data, {"Content-Type": "application/json"} if data else {})
            resp = conn.getresponse()
            raw = resp.read()
            try:
                return resp.status, json.loads(raw) if raw else None
            except json.JSONDecodeError:
                return resp.status, raw.decode(errors="replace")
        finally:
            conn.close()

    # ----------------------------------------------------------------- API
    def register(self, instance_id: int, endpoint: str, model_name: str, block_size: int,
                 replay_endpoint: str | None = None) -> None:
        body = {"instance_id": instance_id, "endpoint": endpoint, "model_name": model_name,
                "block_size": block_size}
        if replay_endpoint:
            body["replay_endpoint"] = replay_endpoint
        status, reply = self.request("POST", "/register", body)
        if status != 201:
            raise RuntimeError(f"/register: {status} {reply}")

    def query(self, model_name: str, token_ids: list[int]) -> dict[int, int]:
        """Matched tokens (a multiple of the block size) per instance (dp rank 0)."""
        status, reply = self.request("POST", "/query", {"model_name": model_name, "token_ids": token_ids})
        if status != 200:
            raise RuntimeError(f"/query: {status} {reply}")
        return {int(w): ranks.get("0", 0) for w, ranks in reply["scores"].items()}

    def query_raw(self, path: str, body: dict) -> tuple[int, Any]:
        return self.request("POST", path, body)

    def dump(self) -> Any:
        status, reply = self.request("GET", "/dump")
        if status != 200:
            raise RuntimeError(f"/dump: {status} {reply}")
        return reply

    def loopback_url(self) -> str:
        """An http:// URL on 127.0.0.1 that reaches the indexer (a relay thread per connection)."""
        import socket

        listener = socket.create_server(("127.0.0.1", 0))
        self._relay = listener

        def pipe(src: socket.socket, dst: socket.socket) -> None:
            try:
                while data := src.recv(65536):
                    dst.sendall(data)
            except OSError:
                pass
            finally:
                for s in (src, dst):
                    try:
                        s.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass

        def accept() -> None:
            while True:
                try:
                    client, _ = listener.accept()
                except OSError:
                    return          # closed by stop()
                try:
                    upstream = _connect_in(self.netns, PORT, 10.0)
                    upstream.settimeout(None)
                except OSError:
                    client.close()
                    continue
                for a, b in ((client, upstream), (upstream, client)):
                    threading.Thread(target=pipe, args=(a, b), daemon=True).start()

        threading.Thread(target=accept, daemon=True).start()
        return f"http://127.0.0.1:{listener.getsockname()[1]}"

    def workers(self) -> Any:
        return self.request("GET", "/workers")[1]

    def stop(self) -> None:
        relay = getattr(self, "_relay", None)
        if relay is not None:
            relay.close()
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()
