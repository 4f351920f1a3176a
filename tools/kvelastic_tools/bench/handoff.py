"""``kvelastic bench handoff``: grant latency when the page must first be
taken back from another engine (the elastic path), through a real daemon.

Why: ``bench grant`` times a grow served from free memory. When the device is
full, a demand grow waits for the daemon to reclaim an idle cached slab from
another engine -- a Reclaim round trip to that engine, its worker's unmap,
release of the old page and creation of a fresh one (a page never moves
between engines as is: DESIGN invariant 6), then the requester's worker maps
it -- and that is the latency a starved engine sees.

Setup: a daemon whose budget is exactly one page (one slab of one 2 MiB page)
and two engines of different namespaces (nothing can be handed on as cache),
each a real ``EngineClient`` plus ``WorkerClient``. Each round:

1. A demands a slab (``ensure``) -- the page B returned is another owner's,
   so it too is replaced by a fresh one: timed as ``regrant``;
2. A fills every block, caches and frees them all (an idle cached slab, the
   reclaim candidate) and flushes its journal synchronously, so the daemon's
   mirror knows the slab holds no live block before B asks;
3. B sends a demand ``Grow`` for one slab: the only way to serve it is to
   reclaim A's slab. Timed from ``Grow`` to ``Granted`` (B's worker mapped the
   fresh page): ``handoff``;
4. B returns the slab.

One pair only: with several pairs on one daemon, B's demand may take another
B's empty slab as it is being returned (empty slabs are reclaimed before
cached ones), which measures a race, not the hand-off.
"""

from __future__ import annotations

import tempfile
import time
from typing import Any

from kvelastic import protocol as p
from kvelastic.vmm.base import DEFAULT_PAGE_SIZE as PAGE
from kvelastic_tools.bench.daemon import running_daemon
from kvelastic_tools.figures import percentile

BLOCKS_PER_SLAB = 8
WARMUP = 2
ONE_PAIR_WHY = ("one engine pair: with several pairs on one daemon a demand may reclaim another pair's empty "
                "slab while it is being returned (empty slabs go before cached ones), a race, not the hand-off")


def handoff_loop(socket_path: str, rounds: int, backend: str) -> dict[str, list[float]]:
    """``rounds`` hand-offs of one slab from engine A to engine B (microseconds)."""
    from kvelastic.client.connection import expect
    from kvelastic.client.engine import EngineClient
    from kvelastic.client.worker import WorkerClient
    from kvelastic.core.pool import SlabPool
    from kvelastic.vmm import get_backend

    engines: list[EngineClient] = []
    workers: list[WorkerClient] = []
    try:
        for name in ("handoff-a", "handoff-b"):
            # No reserve (low_watermark 0) and no idle-slab return for an hour:
            # slabs move only when this loop says so.
            engine = EngineClient(SlabPool(BLOCKS_PER_SLAB), socket_path=socket_path, engine_id=name,
                                  namespace=name, page_size=PAGE, pages_per_worker=1, num_workers=1,
                                  block_bytes=PAGE // BLOCKS_PER_SLAB, low_watermark=0, keep_idle_slabs=0,
                                  shrink_grace=3600).start()
            engines.append(engine)
            workers.append(WorkerClient(get_backend(backend), socket_path=socket_path, engine_id=name, rank=0,
                                        token=engine.token).start())
        a, b = engines
        regrants: list[float] = []
        handoffs: list[float] = []
        for i in range(rounds + WARMUP):
            t0 = time.perf_counter()
            if not a.ensure(BLOCKS_PER_SLAB, timeout=20.0):
                raise RuntimeError(f"round {i}: engine A got no slab back after B returned it")
            t1 = time.perf_counter()
            with a.lock:
                blocks = a.pool.allocate(BLOCKS_PER_SLAB)
                a.pool.cache(blocks, [f"r{i}-b{blk.block_id}".encode() for blk in blocks])
                a.pool.free(blocks)
                a.flush_journal(sync=True)   # B's grow goes on another connection: the mirror first
            t2 = time.perf_counter()
            reply = expect(b.conn.call(p.Grow(engine_id=b.engine_id, slabs=1, demand=True), 20.0), p.Granted)
            t3 = time.perf_counter()
            if len(reply.slabs) != 1:
                raise RuntimeError(f"round {i}: B's demand for one slab was granted {reply.slabs}")
            if a.pool.num_slabs:   # the only page was A's: a grant without a reclaim is not a hand-off
                raise RuntimeError(f"round {i}: B was granted a slab while A still holds {a.pool.slab_ids()}")
            b.conn.call(p.Return(engine_id=b.engine_id, slabs=reply.slabs))
            if i >= WARMUP:
                regrants.append((t1 - t0) * 1e6)
                handoffs.append((t3 - t2) * 1e6)
    finally:
        for engine in engines:
            engine.close()
        for worker in workers:
            worker.close()
    return {"handoff": handoffs, "regrant": regrants}


def measure(backend: str, rounds: int) -> dict[str, Any]:
    """Figures of ``rounds`` hand-offs on a daemon of its own (a one-page budget)."""
    with tempfile.TemporaryDirectory(prefix="kvelastic-handoff-") as tmp, \
            running_daemon(tmp, f"{PAGE}", backend) as sock:
        data = handoff_loop(sock, rounds, backend)
    out: dict[str, Any] = {"backend": backend, "rounds": rounds, "pairs": 1, "pairs_why": ONE_PAIR_WHY,
                           "pages_per_slab": 1, "page_size": PAGE}
    for kind in ("handoff", "regrant"):
        out[f"{kind}_p50_us"] = round(percentile(data[kind], 0.5), 1)
        out[f"{kind}_p99_us"] = round(percentile(data[kind], 0.99), 1)
    return out


def with_raw(figures: dict[str, Any], raw_map_p50_us: float) -> dict[str, Any]:
    """``figures`` with the raw page map of the same run beside it, and the ratio."""
    figures["raw_map_p50_us"] = raw_map_p50_us
    figures["handoff_over_raw_map_p50"] = round(figures["handoff_p50_us"] / raw_map_p50_us, 1)
    return figures


def run(quick: bool = False) -> dict[str, Any]:
    from kvelastic.vmm import cuda_usable
    from kvelastic_tools.bench import vmm

    backend = "cuda" if cuda_usable()[0] else "host"
    raw = vmm.run(quick=True, backend=backend)
    out = with_raw(measure(backend, 20 if quick else 200), raw["raw_map_p50_us"])
    return {"benchmark": "handoff", **out}
