"""Invariant 5: no page is unmapped while a step that may read it is in flight."""

import time

import torch

from kvelastic.client.engine import EngineClient
from kvelastic.client.worker import WorkerClient
from kvelastic.core.pool import SlabPool
from kvelastic.vmm import get_backend
from tests.backend import TEST_BACKEND
from tests.daemon_proc import MiB, wait_for


def test_unmap_waits_for_the_step_to_end(daemon):
    pool = SlabPool(4)
    engine = EngineClient(pool, socket_path=daemon.socket, engine_id="e1", namespace="ns",
                          page_size=2 * MiB, pages_per_worker=1, num_workers=1, block_bytes=MiB // 2,
                          low_watermark=0, keep_idle_slabs=0, shrink_grace=0.1).start()
    worker = WorkerClient(get_backend(TEST_BACKEND), socket_path=daemon.socket, engine_id="e1", rank=0,
                          token=engine.token).start()
    try:
        assert engine.ensure(8)
        view = worker.arena.tensor(torch.uint8, (worker.arena.size,))
        with worker.step():
            offsets = sorted(o for offs in worker.slabs.values() for o in offs)
            for o in offsets:
                view[o] = 1
            # the pool goes idle: the engine returns both slabs, the daemon asks for unmaps
            wait_for(lambda: not pool.slab_ids(), what="slabs returned by the pool")
            time.sleep(0.3)
            assert len(worker.arena.mapped()) == 2          # still mapped: the step reads them
            assert [int(view[o]) for o in offsets] == [1, 1]
            assert daemon.status()["memory"]["free"] == 0   # the daemon has not reused them
        wait_for(lambda: not worker.arena.mapped(), what="unmap at the step's end")
        wait_for(lambda: daemon.status()["memory"]["free"] == 4 * MiB, what="pages free in the daemon")
    finally:
        engine.close()
        worker.close()
