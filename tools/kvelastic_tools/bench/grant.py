"""``kvelastic bench grant``: slab grant and return latency through a real daemon.

A daemon subprocess (host backend unless a GPU is usable) serves engines that
each run an ``EngineClient`` and a ``WorkerClient`` (one rank, one 2 MiB page
per slab). A grant is timed from the engine's ``Grow`` to the ``Granted``
reply, which the daemon sends only after the worker mapped the page and
acknowledged; a return from ``Return`` to its reply, sent once the worker
unmapped. Runs with one engine and with 8 engine processes at once (they
start measuring together, after every one connected and warmed up, and
close only once every one is done: barriers, so the figures are of 8
engines, not of start-ups or of the first to finish tearing down). The
baseline, in the same run, is the raw cost of mapping and unmapping the same
page size with bare system calls (``kvelastic bench vmm``'s raw path).

``handoff_*``: the same grant when the device is full and the page must first
be reclaimed from another engine's idle cached slab (``bench/handoff.py``, on
a daemon of its own with a one-page budget; one engine pair).
"""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

from kvelastic import protocol as p
from kvelastic.vmm.base import DEFAULT_PAGE_SIZE as PAGE
from kvelastic_tools.bench.daemon import running_daemon
from kvelastic_tools.figures import percentile


def engine_loop(socket_path: str, engine_id: str, rounds: int, backend: str,
                barrier: str = "") -> dict[str, list[float]]:
    """One engine: grow by one slab, return it, ``rounds`` times (microseconds).
    ``barrier``: a folder; after the warm-up the engine writes ``ready-ID``
    there and waits for ``go``, after its rounds ``done-ID`` and waits for ``end``."""
    from kvelastic.client.connection import expect
    from kvelastic.client.engine import EngineClient
    from kvelastic.client.worker import WorkerClient
    from kvelastic.core.pool import SlabPool
    from kvelastic.vmm import get_backend

    pool = SlabPool(8)
    engine = EngineClient(pool, socket_path=socket_path, engine_id=engine_id, namespace="bench",
                          page_size=PAGE, pages_per_worker=1, num_workers=1, block_bytes=PAGE // 8,
                          low_watermark=0, shrink_grace=3600).start()
    worker = WorkerClient(get_backend(backend), socket_path=socket_path, engine_id=engine_id, rank=0,
                          token=engine.token).start()
    grants: list[float] = []
    returns: list[float] = []
    try:
        for i in range(rounds + 5):
            if i == 5 and barrier:
                _wait_at(barrier, engine_id)
            t0 = time.perf_counter()
            reply = expect(engine.conn.call(p.Grow(engine_id=engine_id, slabs=1)), p.Granted)
            t1 = time.perf_counter()
            if len(reply.slabs) != 1:
                raise RuntimeError(f"engine {engine_id}: asked for one slab, granted {reply.slabs}")
            engine.conn.call(p.Return(engine_id=engine_id, slabs=reply.slabs))
            t2 = time.perf_counter()
            if i >= 5:  # warm-up: first pages are created, later ones reused
                grants.append((t1 - t0) * 1e6)
                returns.append((t2 - t1) * 1e6)
        if barrier:
            _wait_at(barrier, engine_id, "done", "end")
    finally:
        engine.close()
        worker.close()
    return {"grant": grants, "return": returns}


def _wait_at(barrier: str, engine_id: str, mark: str = "ready", go: str = "go", timeout: float = 120.0) -> None:
    pathlib.Path(barrier, f"{mark}-{engine_id}").touch()
    signal = pathlib.Path(barrier, go)
    deadline = time.monotonic() + timeout
    while not signal.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"engine {engine_id}: the other engines never got to '{go}'")
        time.sleep(0.005)


def _release(barrier: str, procs: list[subprocess.Popen], mark: str, go: str, timeout: float = 120.0) -> None:
    """Once every engine wrote ``mark-ID`` (or one exited), let them all on (``go``)."""
    deadline = time.monotonic() + timeout
    while len(list(pathlib.Path(barrier).glob(f"{mark}-*"))) < len(procs) and time.monotonic() < deadline \
            and all(proc.poll() is None for proc in procs):
        time.sleep(0.01)
    pathlib.Path(barrier, go).touch()


def _parallel(sock: str, engines: int, rounds: int, backend: str) -> dict[str, list[float]]:
    barrier = tempfile.mkdtemp(prefix="kvgrant-")
    procs = [subprocess.Popen([sys.executable, "-m", "kvelastic_tools.bench.grant", sock, f"bench-{i}", str(rounds),
                               backend, barrier], stdout=subprocess.PIPE, text=True) for i in range(engines)]
    _release(barrier, procs, "ready", "go")
    _release(barrier, procs, "done", "end", timeout=600)
    merged: dict[str, list[float]] = {"grant": [], "return": []}
    for proc in procs:
        out, _ = proc.communicate(timeout=600)
        if proc.returncode:
            raise RuntimeError(f"a benchmark engine failed ({proc.returncode})")
        for key, values in json.loads(out.strip().splitlines()[-1]).items():
            merged[key].extend(values)
    shutil.rmtree(barrier, ignore_errors=True)
    return merged


def run(quick: bool = False) -> dict[str, Any]:
    from kvelastic.vmm import cuda_usable
    from kvelastic_tools.bench import handoff, vmm

    backend = "cuda" if cuda_usable()[0] else "host"
    rounds = 50 if quick else 400
    raw = vmm.run(quick=quick, backend=backend)
    with tempfile.TemporaryDirectory() as tmp, running_daemon(tmp, "256MiB", backend) as sock:
        one = engine_loop(sock, "bench-solo", rounds, backend)
        eight = _parallel(sock, 8, rounds, backend)
    moved = handoff.measure(backend, 20 if quick else 200)
    out: dict[str, Any] = {"benchmark": "grant", "backend": backend, "page_size": PAGE,
                           "pages_per_slab": 1, "rounds": rounds,
                           "raw_map_p50_us": raw["raw_map_p50_us"], "raw_unmap_p50_us": raw["raw_unmap_p50_us"]}
    for label, data in (("1_engine", one), ("8_engines", eight)):
        for kind in ("grant", "return"):
            out[f"{kind}_p50_us_{label}"] = round(percentile(data[kind], 0.5), 1)
            out[f"{kind}_p99_us_{label}"] = round(percentile(data[kind], 0.99), 1)
            out[f"{kind}_p999_us_{label}"] = round(percentile(data[kind], 0.999), 1)
        out[f"samples_{label}"] = len(data["grant"])
    out["grant_over_raw_map_p50"] = round(out["grant_p50_us_1_engine"] / raw["raw_map_p50_us"], 1)
    out["return_over_raw_unmap_p50"] = round(out["return_p50_us_1_engine"] / raw["raw_unmap_p50_us"], 1)
    out["grant_over_raw_map_p50_8_engines"] = round(out["grant_p50_us_8_engines"] / raw["raw_map_p50_us"], 1)
    out.update({f"handoff_{k}": v for k, v in moved.items() if k in ("rounds", "pairs", "pairs_why")})
    out["handoff_p50_us"], out["handoff_p99_us"] = moved["handoff_p50_us"], moved["handoff_p99_us"]
    # The loser's grow back: a free page, but another engine's, so a fresh one first.
    out["handoff_regrant_p50_us"], out["handoff_regrant_p99_us"] = moved["regrant_p50_us"], moved["regrant_p99_us"]
    out["handoff_over_raw_map_p50"] = round(moved["handoff_p50_us"] / raw["raw_map_p50_us"], 1)
    out["handoff_over_grant_p50"] = round(moved["handoff_p50_us"] / out["grant_p50_us_1_engine"], 2)
    return out


if __name__ == "__main__":  # one engine process of the 8-engine run
    socket_path, engine_id, rounds, backend, barrier = sys.argv[1], sys.argv[2], int(sys.argv[3]), *sys.argv[4:6]
    print(json.dumps(engine_loop(socket_path, engine_id, rounds, backend, barrier)))
