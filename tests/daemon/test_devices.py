"""One pool per device: budgets, pages and reclaim stay within a device.

Two host-memory devices stand in for two GPUs (no GPU here): the daemon runs
in-process on a thread with real sockets, real memfd pages and real workers.
"""

import threading
import time

import msgspec
import pytest

from kvelastic.client.connection import DaemonError
from kvelastic.client.engine import EngineClient
from kvelastic.client.worker import WorkerClient
from kvelastic.core.pool import SlabPool
from kvelastic.daemon.devices import Device
from kvelastic.daemon.server import Daemon
from kvelastic.vmm import get_backend

MiB = 1 << 20


@pytest.fixture
def two_devices(tmp_path):
    devices = [Device("0", get_backend("host"), 8 * MiB), Device("1", get_backend("host"), 8 * MiB)]
    daemon = Daemon(devices, str(tmp_path / "k.sock"))
    stop = threading.Event()
    thread = threading.Thread(target=daemon.serve, args=(stop.is_set,), daemon=True)
    thread.start()
    yield daemon
    stop.set()
    thread.join(5)
    daemon.close()


def engine(daemon, engine_id, device):
    pool = SlabPool(4)
    client = EngineClient(pool, socket_path=daemon.socket_path, engine_id=engine_id, namespace="n",
                          page_size=2 * MiB, pages_per_worker=1, num_workers=1, block_bytes=MiB // 2,
                          low_watermark=0, shrink_grace=60, device=device).start()
    worker = WorkerClient(get_backend("host"), socket_path=daemon.socket_path, engine_id=engine_id, rank=0,
                          device=device, token=client.token).start()
    return client, worker


def test_engines_draw_from_their_own_device(two_devices):
    daemon = two_devices
    a, wa = engine(daemon, "a", "0")
    b, wb = engine(daemon, "b", "1")
    try:
        assert a.ensure(16) and not a.ensure(20, timeout=2)       # device 0: 4 pages, all a's
        assert b.ensure(16)                                        # device 1 is untouched by a
        a.pool.take_slab_back(a.pool.slab_ids()[0])                # (pool side only: a keeps it held)
        time.sleep(0.3)                                            # a tick: the snapshot is fresh
        status = msgspec.to_builtins(daemon.status())
        by_device = {d["device"]: d for d in status["devices"]}
        assert by_device["0"]["memory"]["held"] == 8 * MiB == by_device["1"]["memory"]["held"]
        assert status["budget_bytes"] == 16 * MiB
        assert {e["engine_id"]: e["device"] for e in status["engines"]} == {"a": "0", "b": "1"}
        daemon.check()
        text = daemon.metrics.registry.get_sample_value
        assert text("kvelastic_budget_bytes", {"device": "1"}) == 8 * MiB
        assert text("kvelastic_engines_connected", {"device": "0"}) == 1
    finally:
        for c in (a, b):
            c.close()
        for w in (wa, wb):
            w.close()


def test_unknown_device_is_rejected(two_devices):
    pool = SlabPool(4)
    client = EngineClient(pool, socket_path=two_devices.socket_path, engine_id="x", namespace="n",
                          page_size=2 * MiB, pages_per_worker=1, num_workers=0, block_bytes=MiB // 2,
                          device="7")
    with pytest.raises(DaemonError, match="device '7'; this daemon has 0, 1") as err:
        client.start(timeout=5)     # refused at once, with the daemon's reason
    assert err.value.reason == "unknown_device"
    assert two_devices.metrics.registry.get_sample_value(
        "kvelastic_rejected_messages_total", {"reason": "unknown_device"}) == 1
