"""A daemon subprocess for the benchmarks that need one."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import IO

from kvelastic import protocol as p


@contextlib.contextmanager
def daemon_process(folder: str, memory: str, backend: str = "host", *, log_level: str = "warning",
                   log: IO[bytes] | None = None, metrics_port: int = 0,
                   orphan_ttl: str | None = "0") -> Iterator[subprocess.Popen]:
    """Start ``kvelastic daemon`` with its socket at ``folder``/kvelastic.sock;
    yields the process (benchmarks that watch its memory and descriptors need
    its PID). ``log``: where its output goes (default: inherited). By default
    it keeps no departed engine's cache: each engine a benchmark starts starts
    cold (``bench warm`` runs its own daemon, which does). ``orphan_ttl=None``:
    the daemon's own default, for figures of what an engine pays when its
    cache may be kept (the seal before each step that dropped a key)."""
    sock = os.path.join(folder, "kvelastic.sock")
    env = dict(os.environ, KVELASTIC_SOCKET=sock, KVELASTIC_MEMORY=memory, KVELASTIC_BACKEND=backend,
               KVELASTIC_METRICS_PORT=str(metrics_port), KVELASTIC_METRICS_ADDR="127.0.0.1",
               KVELASTIC_LOG_LEVEL=log_level)
    if orphan_ttl is not None:
        env["KVELASTIC_ORPHAN_CACHE_TTL"] = orphan_ttl
    else:
        env.pop("KVELASTIC_ORPHAN_CACHE_TTL", None)
    proc = subprocess.Popen([sys.executable, "-m", "kvelastic", "daemon"], env=env, stdout=log,
                            stderr=subprocess.STDOUT if log is not None else None)
    try:
        deadline = time.monotonic() + 20
        while not os.path.exists(p.fd_socket_path(sock)):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the benchmark's daemon did not start")
            time.sleep(0.02)
        yield proc
    finally:
        proc.terminate()
        proc.wait(10)


@contextlib.contextmanager
def running_daemon(folder: str, memory: str, backend: str = "host", orphan_ttl: str | None = "0") -> Iterator[str]:
    """Start ``kvelastic daemon`` with its socket in ``folder``; yields the socket path."""
    with daemon_process(folder, memory, backend, orphan_ttl=orphan_ttl):
        yield os.path.join(folder, "kvelastic.sock")


# What a benchmark watches of the daemon's process (Linux /proc).
def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads): what a frame
    costs the daemon, whatever else competes for the machine's cores."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
