"""One engine of the KV-correctness check (part 3): a real ``EngineClient`` and
``WorkerClient`` in one process, with paged attention in plain torch over the
arena that the daemon's pages are mapped into.

It also captures paged attention as a CUDA graph over the arena (``capture``)
and replays it after the daemon mapped new slabs (``replay``): the graph holds
raw addresses, so this is what vLLM's CUDA graphs rely on -- the arena never
moves, pages arrive under addresses the graph already reads, and no page
changes while a replay may run (both calls run inside ``worker.step()``).
Without a GPU the "graph" is the same computation run eagerly, so the flow
stays tested on host pages.

Driven by JSON lines on stdin, one JSON answer per line on stdout (like the
daemon tests' engine peer, but part of the package: the kit must run where
only the package and its tests are carried). Every block it fills gets seeded
random K/V written twice: into the arena and into an ordinary tensor of the
same shape (the reference). Attention over the two must agree bit for bit.

To measure DESIGN invariant 6 (a page that moves to another engine is a fresh
physical page) the worker's backend keeps a duplicate of every page descriptor
it imports, as a buggy or hostile worker could: after a reclaim, mapping that
kept descriptor shows either this engine's old bytes (fresh pages) or whatever
the next engine wrote into the same physical page.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import sys
from typing import Any

import torch

from kvelastic.client.engine import EngineClient
from kvelastic.client.worker import WorkerClient
from kvelastic.core.pool import SlabPool
from kvelastic.vmm import get_backend
from kvelastic.vmm.base import DEFAULT_PAGE_SIZE as PAGE
from kvelastic.vmm.base import Backend, Page

LAYERS, BLOCK_TOKENS, HEADS, HEAD_DIM, QUERY_TOKENS = 2, 16, 4, 64, 4


class KeepingBackend:
    """Delegates to a backend; keeps a duplicate of every imported descriptor."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.kept: list[int] = []          # in import order, which is map order

    def import_page(self, fd: int) -> Page:
        dup = os.dup(fd)
        try:
            page = self.inner.import_page(fd)
        except BaseException:
            os.close(dup)
            raise
        self.kept.append(dup)
        return page

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def paged_attention(kv: torch.Tensor, table: torch.Tensor, seq_len: int, q: torch.Tensor) -> torch.Tensor:
    """Attention of ``q`` [layers, heads, tokens, dim] over one sequence whose KV
    lives in the blocks ``table`` of ``kv`` [blocks, layers, 2, block_tokens, heads, dim]."""
    blocks = kv.index_select(0, table)               # the gather a paged kernel does
    out = []
    for layer in range(kv.shape[1]):
        k = blocks[:, layer, 0].reshape(-1, HEADS, HEAD_DIM)[:seq_len].transpose(0, 1)
        v = blocks[:, layer, 1].reshape(-1, HEADS, HEAD_DIM)[:seq_len].transpose(0, 1)
        out.append(torch.nn.functional.scaled_dot_product_attention(q[layer][None], k[None], v[None])[0])
    return torch.stack(out)


class Graph:
    """Paged attention over ``kv`` captured once (CUDA graph) with static
    inputs; ``replay`` copies a new block table and query into them."""

    def __init__(self, kv: torch.Tensor, table: torch.Tensor, dtype: torch.dtype, slabs: set[int]) -> None:
        blocks, device = len(table), table.device
        self.blocks, self.slabs, self.address = blocks, slabs, kv.data_ptr()
        self.table = table.clone()        # live, mapped blocks: capture reads memory that exists
        self.q = torch.zeros((LAYERS, HEADS, QUERY_TOKENS, HEAD_DIM), dtype=dtype, device=device)
        run = lambda: paged_attention(kv, self.table, blocks * BLOCK_TOKENS, self.q)  # noqa: E731
        self.cuda_graph: torch.cuda.CUDAGraph | None = None
        if device.type == "cuda":
            self.kind = "cuda graph"
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):          # warm-up outside the capture, as torch asks
                for _ in range(2):
                    run()
            torch.cuda.current_stream().wait_stream(side)
            graph = self.cuda_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.out = run()
        else:
            self.kind = "eager (no GPU)"
            self.out = run()
        self._run = run

    def replay(self, table: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        self.table.copy_(table)
        self.q.copy_(q)
        if self.cuda_graph is not None:
            self.cuda_graph.replay()
            return self.out.clone()
        return self._run()


class KvEngine:
    def __init__(self, cfg: dict[str, Any]) -> None:
        self.backend_name = cfg["backend"]
        self.device = torch.device("cuda", 0) if self.backend_name == "cuda" else torch.device("cpu")
        self.dtype = torch.float16 if self.backend_name == "cuda" else torch.float32
        block_bytes = LAYERS * 2 * BLOCK_TOKENS * HEADS * HEAD_DIM * self.dtype.itemsize
        self.bps = PAGE // block_bytes
        self.gen = torch.Generator(device=self.device)
        self.gen.manual_seed(cfg["seed"])
        self.pool = SlabPool(self.bps, block_size=BLOCK_TOKENS)
        self.engine = EngineClient(self.pool, socket_path=cfg["socket"], engine_id=cfg["engine_id"],
                                   namespace=cfg["namespace"], page_size=PAGE, pages_per_worker=1, num_workers=1,
                                   block_bytes=block_bytes, low_watermark=0, keep_idle_slabs=0,
                                   shrink_grace=3600).start()
        self.keeping = KeepingBackend(get_backend(self.backend_name, PAGE))
        self.worker = WorkerClient(self.keeping, socket_path=cfg["socket"],  # type: ignore[arg-type]
                                   engine_id=cfg["engine_id"], rank=0, token=self.engine.token).start()
        arena = self.worker.reserved_arena()
        shape = (arena.size // block_bytes, LAYERS, 2, BLOCK_TOKENS, HEADS, HEAD_DIM)
        self.kv = arena.tensor(self.dtype, shape)                  # over the whole virtual range
        self.ref = torch.zeros(shape, dtype=self.dtype, device=self.device)  # an ordinary allocation
        self.live: dict[int, Any] = {}                             # block id -> block
        self.seqs: list[dict[str, Any]] = []                       # block table, length, query, first output
        self.kept_of: dict[int, int] = {}                          # mapped slab -> kept descriptor
        self.gone: dict[int, int] = {}                             # slab no longer mapped -> kept descriptor
        self.hash_at_release: dict[int, str] = {}
        self.graph: Graph | None = None

    # ---------------------------------------------------------------- helpers
    def _sync_kept(self) -> None:
        """Pair each slab this worker mapped with its kept descriptor (same order)."""
        with self.worker._mu:
            mapped = list(self.worker.slabs)
        for slab in list(self.kept_of):
            if slab not in mapped:
                self.gone[slab] = self.kept_of.pop(slab)
                if self.graph is not None:     # mapped again later: with a page the graph never saw
                    self.graph.slabs.discard(slab)
        for slab in mapped:
            if slab not in self.kept_of:
                self.kept_of[slab] = self.keeping.kept[len(self.kept_of) + len(self.gone)]

    def _page_hash(self, slab: int) -> str:
        return _digest(self.kv.view(-1).view(torch.uint8)[slab * PAGE:(slab + 1) * PAGE])

    def _sync_device(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    # ---------------------------------------------------------------- operations
    def grow(self, slabs: int, keep_cache: bool = False) -> dict[str, Any]:
        ok = self.engine.ensure(slabs * self.bps, timeout=20.0, keep_cache=keep_cache)
        self._sync_kept()
        return {"ok": ok, "slabs": sorted(self.pool.slab_ids())}

    def fill(self) -> dict[str, Any]:
        """Allocate every free block, check it reads zero, write seeded K/V, add sequences."""
        with self.engine.lock:
            blocks = self.pool.allocate(self.pool.num_free)
        ids = sorted(b.block_id for b in blocks)
        table = torch.tensor(ids, dtype=torch.long, device=self.device)
        with self.worker.step():
            zero_before = int(self.kv.index_select(0, table).view(torch.uint8).count_nonzero()) == 0
            data = torch.randn((len(ids),) + tuple(self.kv.shape[1:]), generator=self.gen,
                               device=self.device, dtype=torch.float32).to(self.dtype)
            self.kv.index_copy_(0, table, data)
            self.ref.index_copy_(0, table, data)
            self._sync_device()
        self.live.update((b.block_id, b) for b in blocks)
        by_slab: dict[int, list[int]] = {}
        for block_id in ids:
            by_slab.setdefault(block_id // self.bps, []).append(block_id)
        slabs = sorted(by_slab)
        for i in range(0, len(slabs), 2):          # one sequence per pair of slabs, blocks shuffled
            members = [b for s in slabs[i:i + 2] for b in by_slab[s]]
            order = torch.randperm(len(members), generator=self.gen, device=self.device).tolist()
            cut = int(torch.randint(0, BLOCK_TOKENS, (1,), generator=self.gen, device=self.device))
            q = torch.randn((LAYERS, HEADS, QUERY_TOKENS, HEAD_DIM), generator=self.gen, device=self.device,
                            dtype=torch.float32).to(self.dtype)
            self.seqs.append({"blocks": [members[j] for j in order],
                              "len": len(members) * BLOCK_TOKENS - cut, "q": q, "first": None})
        return {"blocks": len(ids), "slabs": slabs, "zero_before": zero_before}

    def attend(self) -> dict[str, Any]:
        """Paged attention over the arena and over the reference, for every live
        sequence: bitwise equal, and equal to its first run."""
        equal = stable = True
        done = 0
        with self.worker.step():
            for seq in self.seqs:
                table = torch.tensor(seq["blocks"], dtype=torch.long, device=self.device)
                mine = paged_attention(self.kv, table, seq["len"], seq["q"])
                ref = paged_attention(self.ref, table, seq["len"], seq["q"])
                equal &= bool(torch.equal(mine, ref))
                if seq["first"] is None:
                    seq["first"] = mine.clone()
                stable &= bool(torch.equal(mine, seq["first"]))
                done += 1
            self._sync_device()
        return {"sequences": done, "equal": equal, "stable": stable}

    def capture(self, blocks: int) -> dict[str, Any]:
        """Capture paged attention over ``blocks`` live blocks as a CUDA graph
        (eagerly without a GPU), with a static block table and query."""
        with self.worker.step():
            slabs = set(self.pool.slab_ids())
            first = torch.tensor(sorted(self.live)[:blocks], dtype=torch.long, device=self.device)
            if len(first) < blocks:
                raise RuntimeError(f"{len(first)} live blocks, the graph would read {blocks}")
            self.graph = Graph(self.kv, first, self.dtype, slabs)
            self._sync_device()
        return {"graph": self.graph.kind, "blocks": blocks, "slabs_at_capture": sorted(slabs),
                "kv_address": self.kv.data_ptr()}

    def capture_early(self, blocks: int) -> dict[str, Any]:
        """Capture before the engine holds any slab, as vLLM does: under the
        worker's warm-up scratch, over blocks 0..``blocks``-1."""
        if self.pool.slab_ids():
            raise RuntimeError("capture_early: the engine already holds slabs")
        with self.worker.warm_up() as backed, self.worker.step():
            table = torch.arange(blocks, dtype=torch.long, device=self.device)
            self.graph = Graph(self.kv, table, self.dtype, set())
            self._sync_device()
        return {"graph": self.graph.kind, "blocks": blocks, "scratch_slots": backed,
                "mapped_after": len(self.worker.reserved_arena().mapped())}

    def replay(self, after_capture: bool) -> dict[str, Any]:
        """Point the captured graph at live blocks (those of slabs mapped after
        the capture when ``after_capture``), replay it, and compare with paged
        attention over the reference tensor."""
        g = self.graph
        if g is None:
            raise RuntimeError("replay before capture")
        candidates = [b for b in sorted(self.live) if (b // self.bps not in g.slabs) == after_capture]
        if len(candidates) < g.blocks:
            raise RuntimeError(f"{len(candidates)} live blocks fit, the graph reads {g.blocks}")
        order = torch.randperm(len(candidates), generator=self.gen, device=self.device).tolist()[:g.blocks]
        table = torch.tensor([candidates[i] for i in order], dtype=torch.long, device=self.device)
        q = torch.randn(tuple(g.q.shape), generator=self.gen, device=self.device,
                        dtype=torch.float32).to(self.dtype)
        with self.worker.step():
            out = g.replay(table, q)
            ref = paged_attention(self.ref, table, g.blocks * BLOCK_TOKENS, q)
            self._sync_device()
            bitwise = bool(torch.equal(out, ref))
            diff = float((out.float() - ref.float()).abs().max())
        slabs = sorted({int(b) // self.bps for b in table.tolist()})
        return {"graph": g.kind, "equal": bitwise or diff <= 1e-3, "bitwise": bitwise, "max_diff": diff,
                "slabs": slabs, "kv_address_unchanged": self.kv.data_ptr() == g.address}

    def release(self, slabs: int) -> dict[str, Any]:
        """Cache and free every block of the ``slabs`` highest held slabs (reclaimable)."""
        with self.engine.lock:
            chosen = sorted({b // self.bps for b in self.live})[-slabs:]
            blocks = [blk for b, blk in sorted(self.live.items()) if b // self.bps in chosen]
            with self.worker.step():
                for s in chosen:
                    self.hash_at_release[s] = self._page_hash(s)
            self.pool.cache(blocks, [f"{self.engine.engine_id}-{b.block_id}".encode() for b in blocks])
            self.pool.free(blocks)
        for blk in blocks:
            del self.live[blk.block_id]
        gone = {blk.block_id for blk in blocks}   # their sequences end: the blocks may be reused
        self.seqs = [seq for seq in self.seqs if not gone.intersection(seq["blocks"])]
        return {"released": chosen}

    def forget_lost(self) -> dict[str, Any]:
        """After reclaims: which released slabs left, whether this worker unmapped
        them, and what a kept descriptor of each lost page shows now."""
        self._sync_kept()
        report = []
        arena = self.worker.reserved_arena()
        for slab, fd in sorted(self.gone.items()):
            stale = _read_kept(self.keeping.inner, fd, self.dtype)
            own = self.hash_at_release.get(slab)
            report.append({"slab": slab, "unmapped_here": not arena.is_mapped(slab * PAGE),
                           "stale": "own" if stale == own else "zeros" if stale == _ZERO else "other",
                           "stale_hash": stale})
        return {"lost": report, "slabs": sorted(self.pool.slab_ids())}

    def hashes(self) -> dict[str, Any]:
        with self.worker.step():
            return {"hashes": {str(s): self._page_hash(s) for s in sorted(self.pool.slab_ids())}}

    def close(self) -> None:
        self.engine.close()
        self.worker.close()


def _digest(data: torch.Tensor) -> str:
    """sha256 of a uint8 tensor's bytes, copied into a ctypes buffer (no numpy:
    the GPU image may not have it)."""
    buf = (ctypes.c_uint8 * data.numel())()
    torch.frombuffer(buf, dtype=torch.uint8).copy_(data.reshape(-1))
    return hashlib.sha256(buf).hexdigest()


_ZERO = hashlib.sha256(bytes(PAGE)).hexdigest()


def _read_kept(backend: Backend, fd: int, dtype: torch.dtype) -> str:
    """Map a kept descriptor into a private arena and hash the page's bytes."""
    page = backend.import_page(os.dup(fd))
    try:
        with backend.reserve(PAGE) as arena:
            arena.map(0, page)
            view = arena.tensor(torch.uint8, (PAGE,))
            digest = _digest(view)
            del view
            arena.unmap(0)
    finally:
        backend.release_page(page)
    return digest


def main() -> None:
    peer = KvEngine(json.loads(sys.argv[1]))
    print(json.dumps({"ready": True, "blocks_per_slab": peer.bps}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        try:
            out = getattr(peer, op)(**cmd)
        except Exception as exc:  # noqa: BLE001 - reported to the orchestrator, which fails the check
            out = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(out), flush=True)
    peer.close()


if __name__ == "__main__":
    main()
