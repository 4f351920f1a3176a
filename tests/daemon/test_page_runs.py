"""Slabs of several consecutive pages per region, and the warm-up scratch.

A block whose size divides no page (MLA's 576-wide latents: 36,864 bytes)
needs a run of pages per region before whole blocks fit; the daemon places a
slab's run at the same place in every region of a worker's arena. Before any
slab arrives, vLLM's warm-up and CUDA-graph capture read and write blocks:
``WorkerClient.warm_up`` backs every empty slot with a scratch page meanwhile.
A real daemon (host pages), a real engine client and worker in this process.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from kvelastic.client.engine import EngineClient
from kvelastic.client.worker import WorkerClient
from kvelastic.core.pool import SlabPool
from kvelastic.errors import KvelasticError
from kvelastic.vmm import get_backend

PAGE = 2 << 20
STRIDE = 3 * 4096        # a block per region: 3 pages hold 512 of them, 1 or 2 pages no whole number
RUN, REGIONS = 3, 2


@contextlib.contextmanager
def engine_and_worker(socket: str, name: str, *, run: int, regions: int, bps: int,
                      block_bytes: int) -> Iterator[tuple[EngineClient, WorkerClient]]:
    pool = SlabPool(bps)
    engine = EngineClient(pool, socket_path=socket, engine_id=name, namespace=name, page_size=PAGE,
                          pages_per_worker=run * regions, pages_per_region=run, num_workers=1,
                          block_bytes=block_bytes, low_watermark=0, keep_idle_slabs=0, shrink_grace=3600).start()
    worker = WorkerClient(get_backend("host", PAGE), socket_path=socket, engine_id=name, rank=0,
                          token=engine.token).start()
    try:
        yield engine, worker
    finally:
        engine.close()
        worker.close()


def test_a_slab_takes_a_run_of_pages_in_every_region_and_blocks_cross_pages(daemon):
    bps = RUN * PAGE // STRIDE
    with engine_and_worker(daemon.socket, "mla", run=RUN, regions=REGIONS, bps=bps,
                           block_bytes=REGIONS * STRIDE) as (engine, worker):
        assert engine.ensure(2 * bps, timeout=10.0)
        arena = worker.reserved_arena()
        region = engine.max_slabs * RUN * PAGE
        assert arena.size == REGIONS * region
        for slab in (0, 1):
            assert sorted(worker.slabs[slab]) == [r * region + (slab * RUN + j) * PAGE
                                                  for r in range(REGIONS) for j in range(RUN)]
        status = next(e for e in daemon.status()["engines"] if e["engine_id"] == "mla")
        assert status["slab_bytes"] == RUN * REGIONS * PAGE
        # Every block of both slabs, in both regions, holds its own bytes,
        # those that straddle a page boundary (block 170: bytes 2,088,960-2,101,247) too.
        blocks = torch.arange(2 * bps)
        kv = arena.tensor(torch.int32, (REGIONS, arena.size // REGIONS // 4))
        per_block = STRIDE // 4
        for r in range(REGIONS):
            kv[r, :2 * bps * per_block] = (blocks * 10 + r).repeat_interleave(per_block).to(torch.int32)
        for r in range(REGIONS):
            got = kv[r, :2 * bps * per_block].view(2 * bps, per_block)
            assert torch.equal(got, (blocks * 10 + r).to(torch.int32)[:, None].expand(-1, per_block))
        assert (170 * STRIDE) // PAGE != (171 * STRIDE - 1) // PAGE   # the check above crossed a page
        del kv, got


def test_a_run_that_does_not_divide_a_workers_pages_is_refused(daemon):
    engine = EngineClient(SlabPool(1), socket_path=daemon.socket, engine_id="odd", namespace="odd", page_size=PAGE,
                          pages_per_worker=4, pages_per_region=3, num_workers=1, block_bytes=PAGE, low_watermark=0)
    with pytest.raises(KvelasticError, match="pages_per_region must divide pages_per_worker"):
        engine.start()
    engine.close()
    assert all(e["engine_id"] != "odd" for e in daemon.status()["engines"])


def test_warm_up_backs_every_empty_slot_and_a_granted_slab_replaces_its_scratch(daemon):
    with engine_and_worker(daemon.socket, "warm", run=1, regions=2, bps=64,
                           block_bytes=2 * PAGE // 64) as (engine, worker):
        arena = worker.reserved_arena()
        slots = arena.size // PAGE
        with worker.warm_up() as backed:
            assert backed == slots and len(arena.mapped()) == slots
            view = arena.tensor(torch.uint8, (arena.size,))
            assert int(view.count_nonzero()) == 0            # the scratch page starts zeroed
            view.fill_(7)                                    # what a warm-up writes is thrown away
            assert engine.ensure(64, timeout=10.0)           # slab 0 arrives during the warm-up
            real = set(worker.slabs[0])
            for offset in range(0, arena.size, PAGE):
                page = view[offset:offset + PAGE]
                if offset in real:                           # the daemon's page: zero, not the scratch's 7s
                    assert int(page.count_nonzero()) == 0
                else:
                    assert int(page.min()) == 7
            del view, page
        assert set(arena.mapped()) == real                   # only the slab stays mapped
        slab = arena.tensor(torch.uint8, (arena.size,))
        assert all(int(slab[o:o + PAGE].count_nonzero()) == 0 for o in real)
        del slab
