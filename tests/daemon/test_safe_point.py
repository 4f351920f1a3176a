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


def _two_engines(daemon):
    """e1 holds the whole budget (4 slabs of one 2 MiB page), e2 none yet."""
    made = []
    for name in ("e1", "e2"):
        pool = SlabPool(4)
        engine = EngineClient(pool, socket_path=daemon.socket, engine_id=name, namespace=name,
                              page_size=2 * MiB, pages_per_worker=1, num_workers=1, block_bytes=MiB // 2,
                              low_watermark=0, keep_idle_slabs=4, shrink_grace=60).start()
        worker = WorkerClient(get_backend(TEST_BACKEND), socket_path=daemon.socket, engine_id=name, rank=0,
                              token=engine.token).start()
        made.append((pool, engine, worker))
    return made


def _cache_all(pool, engine, tag: bytes, *, end_step: bool) -> None:
    """A numbered step allocates, keys and frees every block (all cached
    after it); ``end_step``: the step finished (its output came back)."""
    with engine.lock:
        step = pool.begin_step()
        blocks = pool.allocate(pool.num_free)
        pool.cache(blocks, [tag + bytes([i]) for i in range(len(blocks))])
        pool.free(blocks)
        if end_step:
            pool.end_step(step)


def test_a_reclaimed_settled_slab_goes_during_the_givers_step(daemon_factory):
    """The slabs' last step finished: the giver's worker unmaps them while
    its next step runs, and the demand behind the reclaim is met then."""
    daemon = daemon_factory(memory="8MiB")
    (pool1, e1, w1), (pool2, e2, w2) = made = _two_engines(daemon)
    try:
        assert e1.ensure(16)
        _cache_all(pool1, e1, b"a", end_step=True)
        with e1.lock:
            pool1.begin_step()                      # the next step, which writes none of them
        with w1.step():
            assert e2.ensure(4, timeout=30.0)       # granted while e1's worker is in its step
            assert pool2.num_slabs == 1 and len(w1.arena.mapped()) == 3
        assert sum(e["reclaims"] for e in daemon.status()["engines"]) == 1
    finally:
        for _, engine, worker in made:
            engine.close()
            worker.close()


def test_a_slab_freed_in_the_running_step_waits_for_its_end(daemon_factory):
    """vLLM frees a request's blocks while a step scheduled before it knew
    the request was done still writes them: that slab is not settled, and
    its unmap waits for the step's end, as any unmap did before."""
    daemon = daemon_factory(memory="8MiB")
    (pool1, e1, w1), (pool2, e2, w2) = made = _two_engines(daemon)
    try:
        assert e1.ensure(16)
        _cache_all(pool1, e1, b"a", end_step=False)     # step 1 still runs
        with w1.step():
            assert not e2.ensure(4, timeout=0.5)        # the reclaim's unmap waits for the step
            assert len(w1.arena.mapped()) == 4
        wait_for(lambda: len(w1.arena.mapped()) == 3, what="unmap at the step's end")
        assert e2.ensure(4, timeout=30.0)
    finally:
        for _, engine, worker in made:
            engine.close()
            worker.close()


def test_an_answer_calling_settled_a_slab_not_given_is_refused(daemon_factory, monkeypatch):
    """A ``ReclaimDone`` whose ``settled`` names a slab it did not give up:
    a typed error, counted, and the reclaim's state unchanged (still
    pending, the slabs still the giver's, nothing unmapped)."""
    from kvelastic import protocol as p
    from kvelastic.client import engine as engine_module
    from tests.daemon.books import held, rejected

    def bad_answer(pool, engine_id, msg):
        return p.ReclaimDone(req_id=msg.req_id, engine_id=engine_id, given=[], refused=msg.slabs, settled=msg.slabs)

    daemon = daemon_factory(memory="8MiB")
    (pool1, e1, w1), (pool2, e2, w2) = made = _two_engines(daemon)
    try:
        assert e1.ensure(16)
        _cache_all(pool1, e1, b"a", end_step=True)
        monkeypatch.setattr(engine_module, "give_up", bad_answer)
        counted = rejected(daemon).get("bad_request", 0)
        assert not e2.ensure(4, timeout=0.2, wait=0.2)
        wait_for(lambda: rejected(daemon).get("bad_request", 0) == counted + 1, what="the answer refused")
        assert "settled a slab it did not give up" in daemon.log()
        assert held(daemon, "e1") == 8 * MiB and len(w1.arena.mapped()) == 4 and pool1.num_slabs == 4
    finally:
        for _, engine, worker in made:
            engine.close()
            worker.close()
