"""A real daemon with its loop on a thread of the test, and one engine
client and its worker over real sockets (host pages): for tests that drive
the client step by step and read the daemon's books directly."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from kvelastic.client.engine import EngineClient
from kvelastic.client.worker import WorkerClient
from kvelastic.core.pool import SlabPool
from kvelastic.daemon.devices import Device
from kvelastic.daemon.server import Daemon
from kvelastic.vmm import get_backend

MiB = 1 << 20


@contextlib.contextmanager
def served(tmp_path, **engine: Any) -> Iterator[tuple[Daemon, EngineClient, WorkerClient]]:
    """A 16 MiB daemon, engine ``e`` of namespace ``n`` (slabs of one 2 MiB
    page, 4 blocks; ``engine``: more of ``EngineClient``'s settings) and its
    one worker."""
    daemon = Daemon([Device("0", get_backend("host"), 16 * MiB)], str(tmp_path / "k.sock"))
    stop = threading.Event()
    thread = threading.Thread(target=daemon.serve, args=(stop.is_set,), daemon=True)
    thread.start()
    client = EngineClient(SlabPool(4), socket_path=daemon.socket_path, engine_id="e", namespace="n",
                          page_size=2 * MiB, pages_per_worker=1, num_workers=1, block_bytes=MiB // 2,
                          low_watermark=0, **engine).start()
    worker = WorkerClient(get_backend("host"), socket_path=daemon.socket_path, engine_id="e", rank=0,
                          token=client.token).start()
    try:
        yield daemon, client, worker
    finally:
        client.close()
        worker.close()
        stop.set()
        thread.join(5)
        daemon.close()
