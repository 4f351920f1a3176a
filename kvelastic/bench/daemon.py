"""A daemon subprocess for the benchmarks that need one."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator

from kvelastic import protocol as p


@contextlib.contextmanager
def running_daemon(folder: str, memory: str, backend: str = "host") -> Iterator[str]:
    """Start ``kvelastic daemon`` with its socket in ``folder``; yields the socket path."""
    sock = os.path.join(folder, "kvelastic.sock")
    env = dict(os.environ, KVELASTIC_SOCKET=sock, KVELASTIC_MEMORY=memory, KVELASTIC_BACKEND=backend,
               KVELASTIC_METRICS_PORT="0", KVELASTIC_LOG_LEVEL="warning")
    proc = subprocess.Popen([sys.executable, "-m", "kvelastic", "daemon"], env=env)
    try:
        deadline = time.monotonic() + 20
        while not os.path.exists(p.fd_socket_path(sock)):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the benchmark's daemon did not start")
            time.sleep(0.02)
        yield sock
    finally:
        proc.terminate()
        proc.wait(10)
