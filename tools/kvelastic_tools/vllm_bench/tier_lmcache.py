"""LMCache's multi-process server for ``kvelastic bench tier``'s ``lmcache_mp`` mode.

LMCache (0.5.x) shares one KV store among the engines of a node through an
``lmcache server`` process that every vLLM engine connects to with its
``LMCacheMPConnector``: the peer a user would pick instead of kvelastic's
tier. It lives in a virtual environment of its own (``make lmcache``:
``.venv-vllm-lmcache``, the same torch and vLLM lock as ``.venv``), so its
engines are forked from a fork server running that environment's Python.

The server gets the tier's budget as its memory (``--l1-size-gb``) and
chunks of one vLLM block (32 tokens: the granularity kvelastic's tier hits
at; LMCache's default is 256), engine-driven transfers through shared memory
(what the CPU build resolves ``auto`` to). ``chunk`` is configurable with
``KVELASTIC_BENCH_LMCACHE_CHUNK``.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator

from kvelastic_tools.ports import free_port

ROOT = pathlib.Path(__file__).resolve().parents[3]
VENV = ROOT / ".venv-vllm-lmcache"
PYTHON = VENV / "bin" / "python"
CHUNK = 32
START_TIMEOUT = 90.0


def installed() -> str | None:
    """None if LMCache's environment is there, else what to do."""
    if not (VENV / ".kvelastic-setup").exists() or not PYTHON.exists():
        return f"LMCache is not installed: run `make lmcache` (it builds {VENV.name})"
    return None


def engine_path() -> str:
    """PYTHONPATH for processes of LMCache's environment: the bench's own code, not installed there."""
    return os.pathsep.join([str(ROOT), str(ROOT / "tools"), str(ROOT / "patches" / "vllm")])


def _healthy(http_port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/healthcheck", timeout=2) as answer:
            return bool(answer.status == 200)
    except OSError:
        return False


class LMCacheServer:
    """``lmcache server`` with ``size_bytes`` of memory, healthy once built;
    ``kill_and_restart`` is the restart round's ``kill -9`` (same ports)."""

    def __init__(self, folder: pathlib.Path, size_bytes: int) -> None:
        self.port, self.http_port = free_port(), free_port()
        self.log = folder / "lmcache-server.log"
        chunk = int(os.environ.get("KVELASTIC_BENCH_LMCACHE_CHUNK", CHUNK))
        self.argv = [str(VENV / "bin" / "lmcache"), "server", "--transport", "zmq", "--host", "localhost",
                     "--port", str(self.port), "--http-port", str(self.http_port),
                     "--l1-size-gb", f"{size_bytes / 2**30:g}", "--eviction-policy", "LRU",
                     "--chunk-size", str(chunk), "--supported-transfer-mode", "auto",
                     "--shm-name", f"kvbench{os.getpid()}"]
        self.proc = self._start()

    def _start(self) -> subprocess.Popen[bytes]:
        with open(self.log, "ab") as log:
            proc = subprocess.Popen(self.argv, env={**os.environ, "LMCACHE_DISABLE_BANNER": "1"}, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT
        while not _healthy(self.http_port):
            if proc.poll() is not None or time.monotonic() > deadline:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                raise RuntimeError(f"lmcache server did not start (exit {proc.poll()}): "
                                   f"{self.log.read_text(errors='replace')[-1500:]}")
            time.sleep(0.3)
        return proc

    def kill_and_restart(self) -> float:
        """``kill -9`` of the server (its process group), then a new one; seconds until it is healthy."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        started = time.monotonic()
        self.proc = self._start()
        return time.monotonic() - started

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


@contextlib.contextmanager
def lmcache_server(folder: pathlib.Path, size_bytes: int) -> Iterator[LMCacheServer]:
    server = LMCacheServer(folder, size_bytes)
    try:
        yield server
    finally:
        server.stop()
