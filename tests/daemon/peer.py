"""An engine process for the daemon tests: an EngineClient with its SlabPool and
its WorkerClients mapping real pages (the tests' backend, ``tests/backend.py``),
driven by JSON lines on stdin, one JSON answer per line on stdout. Killing it
kills engine and workers.

``workers`` is the engine's number of ranks (default 1) and ``ranks`` the ones
that run in this process (default: all). ``{"role": "worker", "rank": r}``
runs one worker alone, as a separate process of an engine whose geometry has
``workers`` > 1 (vLLM's tensor-parallel shape: one process per rank)."""

import ctypes
import hashlib
import json
import sys
import time

from kvelastic import protocol as p
from kvelastic.client.connection import DaemonError, DaemonUnavailable
from kvelastic.client.engine import EngineClient
from kvelastic.client.worker import WorkerClient
from kvelastic.core.pool import SlabPool
from kvelastic.errors import PoolError
from kvelastic.vmm import get_backend
from tests.backend import TEST_BACKEND

MiB = 1 << 20


def arena_view(worker: WorkerClient):
    """The worker's arena, byte by byte. On host pages a ctypes array over
    the same memory (importing torch would cost each engine process most of
    a second of start-up, hundreds of times a suite); on CUDA pages a torch
    tensor, the only way to reach device memory."""
    arena = worker.arena
    if TEST_BACKEND == "cuda":
        import torch

        return arena.tensor(torch.uint8, (arena.size,))
    return (ctypes.c_ubyte * arena.size).from_address(arena.base)


def view_op(workers: list[WorkerClient], op: str, value: int = 0) -> list[int]:
    """Write ``value`` at the first byte of every mapped page, or read it, rank by rank."""
    values: list[int] = []
    for worker in workers:
        with worker.step():
            view = arena_view(worker)
            offsets = sorted(o for offs in worker.slabs.values() for o in offs)
            if op == "write":
                for o in offsets:
                    view[o] = value
            values += [int(view[o]) for o in offsets]
    return values


def worker_main(cfg: dict) -> None:
    worker = WorkerClient(get_backend(TEST_BACKEND), socket_path=cfg["socket"], engine_id=cfg["engine_id"],
                          rank=cfg["rank"], token=bytes.fromhex(cfg.get("token", ""))).start()
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        out: dict = {}
        if cmd["op"] in ("write", "read"):
            out["values"] = view_op([worker], cmd["op"], cmd.get("value", 0))
        with worker._mu:
            out["state"] = {"mapped": len(worker.arena.mapped()), "slabs": sorted(worker.slabs)}
        print(json.dumps(out), flush=True)
    worker.close()


def become(user: list[int] | None) -> None:
    """Run on as another user (a tenant), once everything is imported: the
    interpreter may live where that user cannot read."""
    if user:
        import os

        get_backend(TEST_BACKEND)          # the backend's modules, before the switch
        os.setgroups([])
        os.setgid(user[1])
        os.setuid(user[0])


def main() -> None:
    cfg = json.loads(sys.argv[1])
    become(cfg.get("user"))
    if cfg.get("role") == "worker":
        return worker_main(cfg)
    pool = SlabPool(cfg.get("bps", 4))
    page_size = 2 * MiB
    num_workers = cfg.get("workers", 1)
    engine = EngineClient(
        pool, socket_path=cfg["socket"], engine_id=cfg["engine_id"], namespace=cfg.get("namespace", "ns"),
        page_size=page_size, pages_per_worker=cfg.get("ppw", 1), num_workers=num_workers,
        block_bytes=page_size * cfg.get("ppw", 1) // cfg.get("bps", 4),
        min_bytes=cfg.get("min_bytes", 0), max_bytes=cfg.get("max_bytes", 0),
        low_watermark=cfg.get("low_watermark", 0), keep_idle_slabs=cfg.get("keep_idle", 0),
        shrink_grace=cfg.get("grace", 0.3), key_group_suffix=cfg.get("vllm_keys", False),
        private=cfg.get("private", False))
    engine.journal_interval = cfg.get("journal_interval", engine.journal_interval)
    engine.start()
    backend = get_backend(TEST_BACKEND) if num_workers else None
    workers = [WorkerClient(backend, socket_path=cfg["socket"], engine_id=cfg["engine_id"], rank=rank,
                            token=engine.token).start()
               for rank in cfg.get("ranks", range(num_workers))]
    live: list = []
    in_step: list = []       # workers' step contexts held open (a long model step)

    def key(prefix: str, i: int) -> bytes:
        """vLLM-style keys (sha256 + 4-byte group id) or short readable ones."""
        raw = f"{prefix}-{i}".encode()
        return hashlib.sha256(raw).digest() + bytes(4) if cfg.get("vllm_keys") else raw

    held: list[bool] = []     # ``hold``: the pool lock, held between commands
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op, out = cmd["op"], {}
        if op == "ensure":
            t0 = time.monotonic()
            out["ok"] = engine.ensure(cmd["n"], timeout=cmd.get("timeout", 5.0),
                                      keep_cache=cmd.get("keep_cache", False))
            out["seconds"] = time.monotonic() - t0
        elif op == "alloc":
            with engine.lock:
                try:
                    live.extend(pool.allocate(cmd["n"]))
                    out["ok"] = True
                except PoolError as exc:
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
        elif op == "hit":        # a request on the prefix: its cached blocks turn live again
            with engine.lock:
                hits = pool.lookup([key(cmd["prefix"], i) for i in range(cmd["n"])])
                pool.touch(hits)
                live.extend(hits)
            out["hits"] = len(hits)
        elif op == "keys":
            with engine.lock:
                out["keys"] = sorted(k.hex() for k, _ in pool.cached_keys())
        elif op in ("write", "read"):
            out["values"] = view_op(workers, op, cmd.get("value", 0))
        elif op == "write_blocks":   # value + k at the first byte of block k's run in every page (a region a page)
            for worker in workers:
                with worker.step():
                    view = arena_view(worker)
                    for o in sorted(o for offs in worker.slabs.values() for o in offs):
                        for k in range(cfg.get("bps", 4)):
                            view[o + k * page_size // cfg.get("bps", 4)] = cmd["value"] + k
        elif op == "step":       # a model step is being scheduled (as vLLM's schedule() begins)
            with engine.lock:
                out["step"] = pool.begin_step()
        elif op == "seal":       # scheduled: before it runs, the daemon hears what it rewrites
            out["needed"] = pool.journal.removed     # a key dropped that the daemon may believe in
            engine.seal_step()
        elif op == "end_step":
            with engine.lock:
                pool.end_step(cmd["n"])
        elif op == "worker_step":      # the workers enter a model step and stay in it (unmaps wait)
            for w in workers:
                ctx = w.step()
                ctx.__enter__()
                in_step.append(ctx)
        elif op == "worker_step_end":
            while in_step:
                in_step.pop().__exit__(None, None, None)
        elif op == "diverge":    # its weights changed in memory (the plugin: a prefix-cache reset, an RPC)
            engine.diverge(cmd.get("reason", "test"))
            out["namespace"] = engine.namespace
        elif op == "hold":       # the scheduler holds the pool (mid-step): the daemon's commands wait for it
            engine.lock.acquire()
            held.append(True)
        elif op == "release":    # and lets go: a command that waited runs at the next tick
            while held:
                held.pop()
                engine.lock.release()
        elif op == "flush":
            with engine.lock:
                engine.flush_journal(sync=True)
        elif op == "send":       # a message on the engine's own connection (hex msgpack), its reply likewise
            try:
                reply = engine.conn.call(p.decode(bytes.fromhex(cmd["msg"])), cmd.get("timeout", 2.0))
            except DaemonError as exc:
                reply = p.Error(reason=exc.reason, message=str(exc))
            except DaemonUnavailable:
                reply = None
            out["reply"] = None if reply is None else p.encode(reply).hex()
        with engine.lock:
            out["state"] = {"slabs": sorted(pool.slab_ids()), "free": pool.num_free,
                            "cached": pool.num_cached, "live": pool.num_live, "demoted": len(pool.demoted),
                            "withheld": pool.num_withheld, "draining": sorted(pool.draining_slabs()),
                            "mapped": sum(len(w.arena.mapped()) for w in workers),
                            "reconnects": engine.conn.reconnects, "token": engine.token.hex(),
                            "failed": getattr(engine, "failed", ""), "hash_seed": engine.hash_seed}
        print(json.dumps(out), flush=True)
    engine.close()
    for worker in workers:
        worker.close()


if __name__ == "__main__":
    main()
