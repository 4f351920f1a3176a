"""Handoff time of ``kvelastic bench elastic``: how long one slab takes to move
from an idle engine that holds the whole budget in cached blocks to a busy
engine that demands it, on the host backend, with real processes.

A real daemon and two engine processes (``python -m
kvelastic_tools.vllm_bench.elastic_handoff``: an ``EngineClient`` with its ``SlabPool``
and a ``WorkerClient`` that maps real pages, the tiny model's slab geometry)
driven by JSON lines on stdin. Engine A fills the budget with cached blocks
and goes idle (the daemon says so); engine B then asks for one slab at a time
(``ensure(..., keep_cache=True)``, a demand grow) and takes its blocks live,
so that each ask is one handoff: the daemon reclaims an idle cached slab of
A (A's worker unmaps it), creates a fresh page for B, B's worker maps it, the
grant comes back. B times each ``ensure`` in its own process. Then B gives
everything back, A fills up again, and so on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

from kvelastic.vmm.base import DEFAULT_PAGE_SIZE as PAGE

PAGES_PER_SLAB = 2          # the tiny model: one page per layer (layer-outer), one worker
BLOCKS_PER_SLAB = 128       # 32 KiB blocks (2 layers x K,V x 32 tokens x 2 heads x 32 x fp32)


def engine_main(socket_path: str, engine_id: str) -> None:
    from kvelastic import protocol as p
    from kvelastic.client.engine import EngineClient
    from kvelastic.client.worker import WorkerClient
    from kvelastic.core.pool import SlabPool
    from kvelastic.vmm import get_backend

    pool = SlabPool(BLOCKS_PER_SLAB)
    engine = EngineClient(pool, socket_path=socket_path, engine_id=engine_id, namespace="bench-handoff",
                          page_size=PAGE, pages_per_worker=PAGES_PER_SLAB, num_workers=1,
                          block_bytes=PAGE * PAGES_PER_SLAB // BLOCKS_PER_SLAB, low_watermark=0,
                          keep_idle_slabs=0, shrink_grace=3600).start()
    worker = WorkerClient(get_backend("host"), socket_path=socket_path, engine_id=engine_id, rank=0,
                          token=engine.token).start()
    live: list = []
    filled = 0
    print(json.dumps({"ready": True}), flush=True)
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            out: dict[str, Any] = {}
            if cmd["op"] == "fill":          # hold `slabs` slabs of cached blocks (demand grows)
                want = cmd["slabs"] * BLOCKS_PER_SLAB
                out["ok"] = engine.ensure(want, timeout=10.0)
                with engine.lock:
                    n = pool.num_free
                    blocks = pool.allocate(n)
                    pool.cache(blocks, [f"{engine_id}-{filled + i}".encode() for i in range(n)])
                    pool.free(blocks[::-1])
                filled += n
            elif cmd["op"] == "grab":        # one more slab, by demand; its blocks taken live
                with engine.lock:
                    need = pool.num_free + BLOCKS_PER_SLAB
                t0 = time.perf_counter()
                ok = engine.ensure(need, timeout=5.0, keep_cache=True)
                out["seconds"] = time.perf_counter() - t0
                out["ok"] = ok
                if ok:
                    with engine.lock:
                        live += pool.allocate(BLOCKS_PER_SLAB)
            elif cmd["op"] == "release":     # everything back to the daemon
                with engine.lock:
                    pool.free(live[::-1])
                    live.clear()
                    slabs = pool.slab_ids()
                    for slab_id in slabs:
                        pool.take_slab_back(slab_id, reason="return")
                if slabs:
                    engine.conn.call(p.Return(engine_id=engine_id, slabs=slabs), 5.0)
            with engine.lock:
                out["slabs"] = pool.num_slabs
            print(json.dumps(out), flush=True)
    finally:
        engine.close()
        worker.close()


class _Engine:
    def __init__(self, socket_path: str, engine_id: str, env: dict[str, str]) -> None:
        proc = subprocess.Popen([sys.executable, "-m", "kvelastic_tools.vllm_bench.elastic_handoff", socket_path,
                                 engine_id], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        if proc.stdin is None or proc.stdout is None:      # both piped above
            raise RuntimeError("handoff engine started without its pipes")
        self.proc, self.stdin, self.stdout = proc, proc.stdin, proc.stdout
        self.call(None)

    def call(self, cmd: dict | None, timeout: float = 30.0) -> dict:
        import select

        if cmd is not None:
            self.stdin.write(json.dumps(cmd) + "\n")
            self.stdin.flush()
        ready, _, _ = select.select([self.stdout], [], [], timeout)
        line = self.stdout.readline() if ready else ""
        if not line:
            raise RuntimeError(f"handoff engine gave no answer to {cmd} (exit {self.proc.poll()})")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"handoff: timed out waiting for {what}")
        time.sleep(0.05)


def measure(socket_path: str, budget_slabs: int, cycles: int) -> dict[str, Any]:
    """``cycles`` x (``budget_slabs`` - 1) one-slab handoffs from idle A to busy B
    (a daemon with that budget must be running at ``socket_path``)."""
    from kvelastic.ctl import get_status

    env = dict(os.environ, KVELASTIC_LOG_LEVEL="warning")
    seconds: list[float] = []
    refused = 0
    a = b = None
    try:
        a = _Engine(socket_path, "handoff-a", env)
        b = _Engine(socket_path, "handoff-b", env)

        def engine(status: dict, engine_id: str) -> dict:
            return next(e for e in status["engines"] if e["engine_id"] == engine_id)

        for _ in range(cycles):
            a.call({"op": "fill", "slabs": budget_slabs})
            # A holds the whole budget, all of it cached, and the daemon sees it idle
            _wait(lambda: (lambda e: e["idle"] and e["cached_blocks"] >= (budget_slabs - 1) * BLOCKS_PER_SLAB
                           and e["slabs"] == budget_slabs)(engine(get_status(socket_path), "handoff-a")),
                  15.0, "engine A idle with the whole budget cached")
            for _ in range(budget_slabs - 1):
                out = b.call({"op": "grab"})
                if out["ok"]:
                    seconds.append(out["seconds"])
                else:
                    refused += 1
            b.call({"op": "release"})
        status = get_status(socket_path)
    finally:
        for eng in (b, a):
            if eng is not None:
                eng.close()
    return {"samples": seconds, "refused": refused, "slab_moves": status["devices"][0]["slab_moves"],
            "thrash": status["devices"][0]["thrash"]}


if __name__ == "__main__":
    engine_main(sys.argv[1], sys.argv[2])
