"""/metrics never reads the daemon's books from its own thread (fault 10).

The metrics endpoint runs on prometheus_client's HTTP thread while the loop
thread changes the books. The loop publishes an immutable status snapshot
each tick; the collector reads only that. Shown here by poisoning the books:
a scrape must still succeed, and must show the last snapshot.
"""

import threading
import time

from prometheus_client import generate_latest

from kvelastic.client.engine import EngineClient
from kvelastic.core.pool import SlabPool
from kvelastic.daemon.devices import Device
from kvelastic.daemon.server import Daemon
from kvelastic.vmm import get_backend

MiB = 1 << 20


class Poison(dict):
    """Books that fail on any read: a scrape that touched them would raise."""

    def _boom(self, *args, **kwargs):
        raise AssertionError("the metrics thread read the allocator's books")

    __iter__ = __getitem__ = __len__ = values = items = keys = get = _boom


def test_a_scrape_reads_only_the_published_snapshot(tmp_path):
    daemon = Daemon([Device("0", get_backend("host"), 8 * MiB)], str(tmp_path / "k.sock"))
    stop = threading.Event()
    thread = threading.Thread(target=daemon.serve, args=(stop.is_set,), daemon=True)
    thread.start()
    client = EngineClient(SlabPool(4), socket_path=daemon.socket_path, engine_id="a", namespace="n",
                          page_size=2 * MiB, pages_per_worker=1, num_workers=0, block_bytes=MiB // 2,
                          low_watermark=0).start()
    try:
        assert client.ensure(8)                                    # 2 slabs held
        time.sleep(0.3)                                            # a tick publishes them
        stop.set()
        thread.join(5)                                             # the loop is quiet now
        books = daemon.allocator.books
        saved = books.engines, books.departing, books.pools
        books.engines = books.departing = Poison()
        books.pools = Poison()
        try:
            text = generate_latest(daemon.metrics.registry).decode()
        finally:
            books.engines, books.departing, books.pools = saved
        held = [ln for ln in text.splitlines() if ln.startswith("kvelastic_engine_held_bytes{")]
        assert held == ['kvelastic_engine_held_bytes{device="0",engine="a",namespace="n"} 4.194304e+06'], held
    finally:
        client.close(unregister=False)
        daemon.close()
