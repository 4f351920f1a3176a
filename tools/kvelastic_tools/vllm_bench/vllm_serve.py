"""Run ``vllm serve`` on the tiny model (loopback only) and ``vllm bench serve`` against it.

Shared by ``kvelastic bench vllm`` and the vLLM tests. The server runs in its
own process group so that stopping it takes the EngineCore and the workers
along. Everything is bounded in time.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from typing import Any

from kvelastic_tools.ports import free_port as free_port  # re-exported: callers name it here

# What vLLM needs on a CPU-only, offline machine shared by other work.
VLLM_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
# The CPU attention backend needs block sizes that are multiples of 32.
SERVE_FLAGS = ["--dtype", "float32", "--max-model-len", "1024", "--enforce-eager", "--enable-prefix-caching",
               "--block-size", "32", "--max-num-seqs", "8", "--kv-cache-memory-bytes", "64M",
               "--served-model-name", "tiny"]
# The `vllm` command as users run it (the plugin's package installs it next to
# the interpreter: kvelastic_vllm/cli.py), else the same CLI through the module.
_VLLM_SCRIPT = pathlib.Path(sys.executable).with_name("vllm")
VLLM = [str(_VLLM_SCRIPT)] if _VLLM_SCRIPT.exists() else [sys.executable, "-m", "kvelastic_vllm.cli"]


def http_get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def counter(metrics: str, name: str) -> float:
    """Sum of a metric's samples in Prometheus text (0 if absent)."""
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", metrics, re.M))


def wait_or_kill(proc: Any, timeout: float) -> int:
    """``proc``'s exit status within ``timeout``; past it, ``proc`` is killed
    (and reaped) and ``subprocess.TimeoutExpired`` raised."""
    try:
        return int(proc.wait(timeout=timeout))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=60)
        raise


class VllmServer:
    def __init__(self, model: pathlib.Path, log_path: pathlib.Path, env: dict[str, str] | None = None,
                 flags: list[str] | None = None, command: list[str] | None = None,
                 popen: Callable[..., Any] = subprocess.Popen) -> None:
        self.model = model
        self.command = command or VLLM           # the `vllm` command (the tests may start it another way)
        self.popen = popen                       # how it is started (the tests' fork server, for one)
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.env = {**os.environ, **VLLM_ENV, **(env or {})}
        self.log_path = log_path
        self.flags = flags or []
        self.proc: subprocess.Popen | None = None
        self._started = False                    # once: a restart keeps its port

    def start(self, timeout: float = 240.0) -> VllmServer:
        self._log = open(self.log_path, "ab")
        deadline = time.monotonic() + timeout
        for attempt in range(3):
            logged = self._log.tell()
            cmd = [*self.command, "serve", str(self.model), "--host", "127.0.0.1", "--port", str(self.port),
                   *SERVE_FLAGS, *self.flags]
            self.proc = self.popen(cmd, env=self.env, stdout=self._log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
            if self._wait_ready(deadline):
                self._started = True
                return self
            # Another process took the port between its pick and vLLM's bind
            # (``ports.py``): a first start moves to another port; a restart
            # keeps its port (its callers know it), so it fails.
            if self._started or attempt == 2 or b"Address already in use" not in self.log_path.read_bytes()[logged:]:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            self.port = free_port()
            self.base = f"http://127.0.0.1:{self.port}"
        raise AssertionError("unreachable")

    def _wait_ready(self, deadline: float) -> bool:
        """True once the server answers ``/health``; False if it exited first.
        Past ``deadline`` it is stopped and ``RuntimeError`` raised."""
        proc = self.process()
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return False
            try:
                http_get(self.base + "/health", 1.0)
                return True
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"vllm serve not ready in time:\n{self.log()[-3000:]}")

    def process(self) -> subprocess.Popen[bytes]:
        """The server's process (``start`` ran)."""
        if self.proc is None:
            raise RuntimeError("vllm serve was not started")
        return self.proc

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def complete(self, prompt: str, max_tokens: int = 16, timeout: float = 120.0, model: str = "tiny",
                 **extra: Any) -> dict[str, Any]:
        """A greedy completion of ``max_tokens`` (``extra``: more fields of the request's body)."""
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                **extra}
        return json.loads(self.post("/v1/completions", body, timeout))

    def post(self, path: str, body: dict[str, Any], timeout: float = 120.0) -> bytes:
        """POST ``body`` as JSON to the server's ``path``; the reply's bytes."""
        req = urllib.request.Request(self.base + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.read()

    def token_ids(self, prompt: str, model: str = "tiny", max_tokens: int = 16) -> list[int]:
        """The greedy completion's token ids: what ``LLM.generate`` returns for the same prompt."""
        return self.complete(prompt, max_tokens, model=model, return_token_ids=True)["choices"][0]["token_ids"]

    def metrics(self) -> str:
        return http_get(self.base + "/metrics")

    def prefix_cache(self) -> tuple[float, float]:
        text = self.metrics()
        return counter(text, "vllm:prefix_cache_queries_total"), counter(text, "vllm:prefix_cache_hits_total")

    def bench(self, dataset: list[str], num_prompts: int, concurrency: int = 4, timeout: float = 600,
              seed: int = 0) -> dict:
        """``vllm bench serve`` against this server; its saved JSON result."""
        with tempfile.TemporaryDirectory() as tmp:
            # The client through the server's command: `vllm`, or the tests' forked.py (which
            # ends it without the interpreter's teardown, quick_exit.py).
            cmd = [*self.command, "bench", "serve", "--backend", "vllm", "--base-url", self.base, "--model", "tiny",
                   "--tokenizer", str(self.model), *dataset, "--num-prompts", str(num_prompts),
                   "--max-concurrency", str(concurrency), "--request-rate", "inf", "--temperature", "0",
                   "--ignore-eos", "--seed", str(seed), "--percentile-metrics", "ttft,tpot,e2el",
                   "--metric-percentiles", "50,99", "--save-result", "--result-dir", tmp,
                   "--result-filename", "result.json"]
            with open(pathlib.Path(tmp, "bench.log"), "w+") as log:
                proc = self.popen(cmd, env=self.env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
                code = wait_or_kill(proc, timeout)
                log.seek(0)
                if code:
                    raise RuntimeError(f"vllm bench serve failed ({code}):\n{log.read()[-4000:]}")
            return json.loads(pathlib.Path(tmp, "result.json").read_text())

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            self.proc.wait(30)
            self._wait_port_free()

    def _wait_port_free(self, timeout: float = 30.0) -> None:
        """Until the server's port can be bound again: a forked EngineCore
        inherits the listening socket and may outlive the front end by a
        moment, and a server restarted on the same port would fail to bind."""
        deadline = time.monotonic() + timeout
        while True:
            with socket.socket() as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as vLLM binds it
                try:
                    s.bind(("127.0.0.1", self.port))
                    return
                except OSError:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"port {self.port} still bound {timeout:g} s after the server was "
                                           "killed") from None
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        except ProcessLookupError:
            pass
        self._log.close()


PREFIX_REPETITION = ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "256",
                     "--prefix-repetition-suffix-len", "32", "--prefix-repetition-num-prefixes", "4",
                     "--prefix-repetition-output-len", "16"]
RANDOM = ["--dataset-name", "random", "--random-input-len", "256", "--random-output-len", "16"]


def start_daemon(env: dict[str, str], log_path: pathlib.Path, timeout: float = 30.0) -> subprocess.Popen[bytes]:
    """``kvelastic daemon`` with ``env`` (its socket: ``KVELASTIC_SOCKET``),
    its output appended to ``log_path``, once it answers ``status``."""
    from kvelastic.ctl import get_status

    with open(log_path, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "kvelastic", "daemon"], env=env, stdout=log,
                                stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the daemon did not start:\n{log_path.read_text()[-2000:]}")
        try:
            get_status(env["KVELASTIC_SOCKET"], timeout=0.5)
            return proc
        except Exception:   # noqa: BLE001 - not up yet
            time.sleep(0.1)


def stop_daemon(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM (a graceful stop), then SIGKILL past 10 s."""
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)
