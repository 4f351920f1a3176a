"""An engine process for the daemon tests: an EngineClient with its SlabPool and
one WorkerClient (rank 0) mapping real host pages, driven by JSON lines on
stdin, one JSON answer per line on stdout. Killing it kills engine and worker."""

import hashlib
import json
import sys

import torch

from kvelastic.client.engine import EngineClient
from kvelastic.client.worker import WorkerClient
from kvelastic.core.pool import SlabPool
from kvelastic.vmm import get_backend

MiB = 1 << 20


def main() -> None:
    cfg = json.loads(sys.argv[1])
    pool = SlabPool(cfg.get("bps", 4))
    page_size = 2 * MiB
    engine = EngineClient(
        pool, socket_path=cfg["socket"], engine_id=cfg["engine_id"], namespace=cfg.get("namespace", "ns"),
        page_size=page_size, pages_per_worker=cfg.get("ppw", 1), num_workers=cfg.get("workers", 1),
        block_bytes=page_size * cfg.get("ppw", 1) // cfg.get("bps", 4),
        min_bytes=cfg.get("min_bytes", 0), max_bytes=cfg.get("max_bytes", 0),
        low_watermark=cfg.get("low_watermark", 0), keep_idle_slabs=cfg.get("keep_idle", 0),
        shrink_grace=cfg.get("grace", 0.3), key_group_suffix=cfg.get("vllm_keys", False)).start()
    worker = WorkerClient(get_backend("host"), socket_path=cfg["socket"], engine_id=cfg["engine_id"],
                          rank=0).start() if cfg.get("workers", 1) else None
    live: list = []

    def key(prefix: str, i: int) -> bytes:
        """vLLM-style keys (sha256 + 4-byte group id) or short readable ones."""
        raw = f"{prefix}-{i}".encode()
        return hashlib.sha256(raw).digest() + bytes(4) if cfg.get("vllm_keys") else raw

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op, out = cmd["op"], {}
        if op == "ensure":
            out["ok"] = engine.ensure(cmd["n"], timeout=cmd.get("timeout", 5.0))
        elif op == "alloc":
            with engine.lock:
                try:
                    live.extend(pool.allocate(cmd["n"]))
                    out["ok"] = True
                except Exception as exc:
                    out["ok"], out["error"] = False, type(exc).__name__
        elif op == "cache":
            with engine.lock:
                pool.cache(live, [key(cmd["prefix"], i) for i in range(len(live))])
        elif op == "free":
            with engine.lock:
                pool.free(live[::-1])
            live.clear()
        elif op == "lookup":
            with engine.lock:
                out["hits"] = len(pool.lookup([key(cmd["prefix"], i) for i in range(cmd["n"])]))
        elif op == "keys":
            with engine.lock:
                out["keys"] = sorted(k.hex() for k, _ in pool.cached_keys())
        elif op in ("write", "read"):
            with worker.step():
                view = worker.arena.tensor(torch.uint8, (worker.arena.size,))
                offsets = sorted(o for offs in worker.slabs.values() for o in offs)
                if op == "write":
                    for o in offsets:
                        view[o] = cmd["value"]
                out["values"] = [int(view[o]) for o in offsets]
        with engine.lock:
            out["state"] = {"slabs": sorted(pool.slab_ids()), "free": pool.num_free,
                            "cached": pool.num_cached, "live": pool.num_live,
                            "mapped": len(worker.arena.mapped()) if worker else 0,
                            "reconnects": engine.conn.reconnects}
        print(json.dumps(out), flush=True)
    engine.close()
    if worker:
        worker.close()


if __name__ == "__main__":
    main()
