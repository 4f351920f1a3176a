"""``kvelastic bench core``: a synthetic scheduler trace through the core pool.

Requests share a few long prefixes; each arrives (lookup + touch the hits +
allocate the rest + cache its full prompt blocks), decodes block by block
(allocate + cache each block as it fills), and finishes (free, tail first).
The pool is sized so that evictions happen. The same trace runs through
``FlatPool``, a minimal single-list prefix cache in the style of nano-vllm's
block manager, as the baseline: the ratio is the price of slab awareness
(best fit, per-slab counts, the journal).
"""

from __future__ import annotations

import random
import time
from collections import OrderedDict, deque
from typing import Any

from kvelastic.core.block import Block
from kvelastic.core.pool import SlabPool

BLOCKS_PER_SLAB = 32


class FlatPool:
    """Baseline: one free deque, one LRU, one hash dict; no slabs, no journal."""

    def __init__(self, num_blocks: int) -> None:
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: deque[int] = deque(range(num_blocks))
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.index: dict[Any, Block] = {}

    def lookup(self, keys):
        hits = []
        for key in keys:
            blk = self.index.get(key)
            if blk is None:
                break
            hits.append(blk)
        return hits

    def touch(self, blocks):
        for blk in blocks:
            if blk.ref_cnt == 0:
                del self.lru[blk.block_id]
            blk.ref_cnt += 1

    def allocate(self, n):
        out = []
        for _ in range(n):
            if self.free_ids:
                blk = self.blocks[self.free_ids.pop()]
            else:
                blk = self.blocks[self.lru.popitem(last=False)[0]]
                del self.index[blk._block_hash]
                blk._block_hash = None
            blk.ref_cnt = 1
            out.append(blk)
        return out

    def cache(self, blocks, keys):
        for blk, key in zip(blocks, keys):
            if key not in self.index:
                blk._block_hash = key
                self.index[key] = blk

    def free(self, blocks):
        for blk in blocks:
            blk.ref_cnt -= 1
            if blk.ref_cnt == 0:
                if blk._block_hash is None:
                    self.free_ids.append(blk.block_id)
                else:
                    self.lru[blk.block_id] = None


def make_trace(num_requests: int, seed: int = 0) -> list[tuple[list[bytes], int]]:
    """(prompt block keys, decode blocks) per request; keys chain a shared prefix."""
    rng = random.Random(seed)
    prefixes = [[f"p{p}-{i}".encode() for i in range(rng.randint(16, 48))] for p in range(6)]
    trace = []
    for r in range(num_requests):
        prefix = prefixes[min(int(rng.expovariate(0.7)), len(prefixes) - 1)]
        shared = prefix[: rng.randint(len(prefix) // 2, len(prefix))]
        own = [f"r{r}-{i}".encode() for i in range(rng.randint(1, 8))]
        trace.append((shared + own, rng.randint(1, 16)))
    return trace


def replay(pool, trace, concurrency: int = 16) -> dict[str, float]:
    """Run the trace; returns pool-call count, seconds, and the block hit rate."""
    ops = hits = asked = 0
    running: deque[tuple[list, list[bytes], int]] = deque()
    start = time.perf_counter()
    for keys, decode in trace:
        found = pool.lookup(keys)
        ops += 1
        if found:
            pool.touch(found)
            ops += 1
        hits += len(found)
        asked += len(keys)
        blocks = found + pool.allocate(len(keys) - len(found))
        pool.cache(blocks[len(found):], keys[len(found):])
        ops += 2
        running.append((blocks, keys, decode))
        # decode one block for every running request, then retire the oldest
        for req in running:
            blocks, keys, _ = req
            new = pool.allocate(1)
            key = keys[-1] + b"+"
            keys.append(key)
            pool.cache(new, [key])
            blocks.extend(new)
            ops += 2
        if len(running) >= concurrency:
            blocks, _, _ = running.popleft()
            pool.free(blocks[::-1])
            ops += 1
    while running:
        pool.free(running.popleft()[0][::-1])
        ops += 1
    seconds = time.perf_counter() - start
    return {"ops": ops, "seconds": seconds, "hit_rate": hits / asked if asked else 0.0}


def run(quick: bool = False) -> dict[str, Any]:
    num_requests = 400 if quick else 6000
    num_slabs = 48
    trace = make_trace(num_requests)

    def copy():
        return [(list(keys), decode) for keys, decode in trace]

    pool = SlabPool(BLOCKS_PER_SLAB)
    for slab in range(num_slabs):
        pool.add_slab(slab)
    ours = replay(pool, copy())
    flat = replay(FlatPool(num_slabs * BLOCKS_PER_SLAB), copy())
    ops_per_s = ours["ops"] / ours["seconds"]
    flat_ops_per_s = flat["ops"] / flat["seconds"]
    return {
        "benchmark": "core",
        "requests": num_requests,
        "pool_blocks": num_slabs * BLOCKS_PER_SLAB,
        "blocks_per_slab": BLOCKS_PER_SLAB,
        "ops": ours["ops"],
        "ops_per_s": round(ops_per_s),
        "hit_rate": round(ours["hit_rate"], 4),
        "evictions": dict(pool.stats.evictions),
        "baseline": "flat single-list prefix cache (nano-vllm style)",
        "baseline_ops_per_s": round(flat_ops_per_s),
        "baseline_hit_rate": round(flat["hit_rate"], 4),
        "ratio_ops_per_s": round(ops_per_s / flat_ops_per_s, 3),
    }
