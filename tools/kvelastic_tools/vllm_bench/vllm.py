"""``kvelastic bench vllm``: stock vLLM against vLLM with kvelastic, in one run.

(a) End to end, on the tiny model: two ``vllm serve`` instances, stock and
    with the plugin (its daemon's budget equals stock's KV size), measured in
    alternation under ``vllm bench serve`` with the ``prefix_repetition``
    dataset and a random one (no shared prefix), several rounds, medians:
    throughput, TTFT mean and p99, and the prefix-cache hit rate from vLLM's
    /metrics, plus the lowest and highest per-round throughput ratio (the
    noise floor of the machine). Target: within 3% of stock.
(b) Hot path: one trace of block-pool calls, recorded from vLLM's own
    ``KVCacheManager`` driving a stock ``BlockPool`` through a scheduler-like
    workload, replayed through a fresh ``BlockPool`` and through an
    ``ElasticBlockPool`` whose slabs are already granted, in steps as the
    scheduler makes them (the journal shipped after the timed window; a
    second figure ships it between steps). Target: 1.0x.
(c) Scheduler step: vLLM's ``Scheduler`` at a batch of 256 running requests,
    no model, stock and with kvelastic (same blocks, same schedule step after
    step): ``schedule()`` and ``update_from_output()`` per step, median and
    p90, several rounds in alternation (``vllm_sched``). Target: 1.05x.
"""

from __future__ import annotations

import gc
import pathlib
import random
import statistics
import tempfile
import time
from typing import Any

from kvelastic_tools.bench.daemon import running_daemon
from kvelastic_tools.vllm_bench import vllm_serve

BS = 16


# ----------------------------------------------------------- (b) hot path
def record_trace(num_requests: int, num_blocks: int, seed: int = 0) -> list[tuple]:
    """Block-pool calls made by KVCacheManager on a scheduler-like workload:
    requests sharing prefixes arrive, decode a block at a time, finish."""
    from unittest import mock

    import vllm.v1.core.kv_cache_coordinator as coordinator
    from vllm.v1.core.block_pool import BlockPool

    from kvelastic_tools.vllm_bench.vllm_pool import admit, manager, request

    trace: list[tuple] = []

    class Recorder(BlockPool):
        def get_cached_block(self, block_hash, group_ids):
            got = super().get_cached_block(block_hash, group_ids)
            trace.append(("get_cached_block", block_hash, list(group_ids)))
            return got

        def get_new_blocks(self, n):
            got = super().get_new_blocks(n)
            trace.append(("get_new_blocks", [b.block_id for b in got]))
            return got

        def touch(self, blocks):
            trace.append(("touch", [b.block_id for b in blocks]))
            super().touch(blocks)

        def free_blocks(self, blocks):
            blocks = list(blocks)
            trace.append(("free_blocks", [b.block_id for b in blocks]))
            super().free_blocks(blocks)

        def cache_full_blocks(self, request, blocks, num_cached_blocks, num_full_blocks, block_size,
                              kv_cache_group_id, block_mask=None):
            trace.append(("cache_full_blocks", list(request.block_hashes), [b.block_id for b in blocks],
                          num_cached_blocks, num_full_blocks, block_size, kv_cache_group_id))
            super().cache_full_blocks(request, blocks, num_cached_blocks, num_full_blocks, block_size,
                                      kv_cache_group_id, block_mask)

    rng = random.Random(seed)
    prefixes = [[rng.randrange(30000) for _ in range(rng.randint(4, 24) * BS)] for _ in range(8)]
    with mock.patch.object(coordinator, "BlockPool", Recorder):   # the pool the manager's coordinator builds
        mgr = manager(num_blocks, BS)
    running = []
    for i in range(num_requests):
        toks = rng.choice(prefixes) + [rng.randrange(30000) for _ in range(rng.randint(8, 200))]
        req = request(str(i), toks, BS)
        if admit(mgr, req)[0] is None:
            continue
        running.append(req)
        for r in running:               # one decode step: each running request grows
            r.append_output_token_ids(rng.randrange(30000))
            mgr.allocate_slots(r, 1, r.num_computed_tokens)
            r.num_computed_tokens = r.num_tokens - 1
        if len(running) > 12:
            mgr.free(running.pop(0))
    for r in running:
        mgr.free(r)
    return trace


class _Req:
    __slots__ = ("block_hashes",)

    def __init__(self, block_hashes):
        self.block_hashes = block_hashes


# Calls per scheduler step in the replay: the trace's workload runs about a
# dozen requests, two or three pool calls each per step.
STEP_CALLS = 32


def replay(pool, trace: list[tuple]) -> float:
    """Seconds to replay ``trace`` through ``pool`` (recorded ids -> its blocks).
    An ``ElasticBlockPool`` is driven as vLLM's scheduler drives it through
    the plugin: ``STEP_CALLS`` calls at a time inside a step, which holds the
    client's lock (``engine.wrap_schedule``); between steps the I/O thread may
    take it to ship the journal."""
    blocks: dict[int, Any] = {}
    if getattr(pool, "null_block", None) is not None:
        blocks[0] = pool.null_block
    stepped = hasattr(pool, "in_step")
    start = time.perf_counter()
    for first in range(0, len(trace), STEP_CALLS):
        if stepped:
            pool.lock.acquire()
            pool.in_step = True
        for op in trace[first:first + STEP_CALLS]:
            name = op[0]
            if name == "get_cached_block":
                pool.get_cached_block(op[1], op[2])
            elif name == "get_new_blocks":
                for rec, blk in zip(op[1], pool.get_new_blocks(len(op[1]))):
                    blocks[rec] = blk
            elif name == "touch":
                pool.touch([blocks[i] for i in op[1]])
            elif name == "free_blocks":
                pool.free_blocks([blocks[i] for i in op[1]])
            else:
                _n, hashes, ids, num_cached, num_full, block_size, group_id = op
                pool.cache_full_blocks(_Req(hashes), [blocks[i] for i in ids], num_cached, num_full, block_size,
                                       group_id)
        if stepped:
            pool.in_step = False
            pool.lock.release()
    return time.perf_counter() - start


def hot_path(quick: bool, socket_path: str, num_blocks: int) -> dict[str, Any]:
    """``num_blocks``: the daemon's whole budget in blocks, so both pools have
    the same capacity and make the same eviction decisions on the trace."""
    from vllm.v1.core.block_pool import BlockPool

    from kvelastic_tools.vllm_bench.vllm_pool import elastic
    from kvelastic_vllm.block_pool import ElasticBlockPool

    trace = record_trace(300 if quick else 3000, num_blocks)
    stock_s: list[float] = []
    elastic_s: dict[bool, list[float]] = {False: [], True: []}
    for round_ in range(3 if quick else 5):
        gc.collect()
        stock_s.append(replay(BlockPool(num_blocks, True, BS), trace))
        for shipping in (False, True):
            # Keys as the plugin registers them (vLLM's bytes, group suffix): shipped as they stand.
            with elastic(socket_path, blocks_per_slab=64, engine_id=f"bench-hot-path-{round_}-{shipping}",
                         key_group_suffix=True) as link:
                pool = ElasticBlockPool(link.num_blocks, True, BS)
                # Every slab granted before timing, or the replay would time the daemon.
                if not link.client.ensure(num_blocks - 1, timeout=30):
                    raise RuntimeError(f"bench vllm: the daemon did not grant its whole budget "
                                       f"({num_blocks} blocks) in 30 s")
                if pool.core.num_blocks != num_blocks:
                    raise RuntimeError(f"bench vllm: the elastic pool holds {pool.core.num_blocks} blocks, "
                                       f"the stock one {num_blocks}: their evictions would differ")
                # Without shipping, the journal goes out after the timed window: the
                # pool's own cost. With it, the I/O thread ships it meanwhile and, on
                # this 2-core machine, the daemon digests it on the other core.
                if not shipping:
                    link.client.journal_interval = 3600.0
                gc.collect()
                elastic_s[shipping].append(replay(pool, trace))
    stock, mine, shipped = min(stock_s), min(elastic_s[False]), min(elastic_s[True])
    return {"hot_path_calls": len(trace), "hot_path_stock_us_per_call": round(stock / len(trace) * 1e6, 3),
            "hot_path_kvelastic_us_per_call": round(mine / len(trace) * 1e6, 3),
            "hot_path_ratio": round(mine / stock, 3),
            "hot_path_ratio_with_journal_shipping": round(shipped / stock, 3)}


# ------------------------------------------------------------ (a) serving
DATASETS = (("prefix", vllm_serve.PREFIX_REPETITION), ("random", vllm_serve.RANDOM))


def measure(server: vllm_serve.VllmServer, dataset: list[str], prompts: int, seed: int) -> dict[str, float]:
    q0, h0 = server.prefix_cache()
    result = server.bench(dataset, num_prompts=prompts, seed=seed)
    q1, h1 = server.prefix_cache()
    return {"throughput_tok_s": (result["total_input_tokens"] + result["total_output_tokens"]) / result["duration"],
            "ttft_mean_ms": result["mean_ttft_ms"], "ttft_p99_ms": result["p99_ttft_ms"],
            "hit_rate": (h1 - h0) / (q1 - q0) if q1 > q0 else 0.0}


def serving(model: pathlib.Path, tmp: pathlib.Path, socket_path: str,
            quick: bool) -> dict[tuple[str, str], dict[str, float]]:
    """Both servers up at once, measured in alternation, round after round (a
    new dataset seed each round, the same for both), so that drift and noise of
    a shared 2-core machine fall on both alike; medians are reported."""
    stock = vllm_serve.VllmServer(model, tmp / "vllm-stock.log")
    mine = vllm_serve.VllmServer(model, tmp / "vllm-kvelastic.log", env={
        "KVELASTIC_ENABLE": "1", "KVELASTIC_SOCKET": socket_path, "KVELASTIC_ENGINE_ID": "bench"})
    runs: dict[tuple[str, str], list[dict[str, float]]] = {}
    try:
        for server in (stock, mine):
            server.start()
            server.bench(vllm_serve.RANDOM, num_prompts=8, seed=99)    # warm-up
        prompts = 24 if quick else 64
        pair = [("stock", stock), ("kvelastic", mine)]
        for seed in range(2 if quick else 6):
            for name, dataset in DATASETS:
                for label, server in pair if seed % 2 == 0 else pair[::-1]:   # who goes first alternates
                    runs.setdefault((name, label), []).append(measure(server, dataset, prompts, seed))
    finally:
        stock.stop()
        mine.stop()
    out = {key: {metric: statistics.median(r[metric] for r in rs) for metric in rs[0]} for key, rs in runs.items()}
    for name, _ in DATASETS:   # the noise floor: the same round's kvelastic/stock ratio, lowest and highest
        ratios = [m["throughput_tok_s"] / s["throughput_tok_s"]
                  for s, m in zip(runs[(name, "stock")], runs[(name, "kvelastic")])]
        out[(name, "kvelastic")]["round_ratio_min"] = min(ratios)
        out[(name, "kvelastic")]["round_ratio_max"] = max(ratios)
    return out


def run(quick: bool = False) -> dict[str, Any]:
    from kvelastic_tools.vllm_bench import vllm_sched
    from kvelastic_tools.vllm_bench.tinymodel import build_tiny_llama

    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = pathlib.Path(tmp_dir)
        model = build_tiny_llama(pathlib.Path(tempfile.gettempdir()) / "kvelastic-tiny-llama")
        with running_daemon(tmp_dir, "64MiB") as sock:     # stock vLLM preallocates 64 MiB
            hot = hot_path(quick, sock, num_blocks=32 * 64)  # 32 pages of 64 blocks
            served = serving(model, tmp, sock, quick)
        sched = vllm_sched.scheduler_step(quick, model)
    out: dict[str, Any] = {"benchmark": "vllm", "model": "tiny random Llama (2 layers, fp32, block 32)", **hot,
                           **sched}
    for dataset, _ in DATASETS:
        stock, mine = served[(dataset, "stock")], served[(dataset, "kvelastic")]
        for key in ("throughput_tok_s", "ttft_mean_ms", "ttft_p99_ms", "hit_rate"):
            out[f"{dataset}_{key}_stock"] = round(stock[key], 4)
            out[f"{dataset}_{key}_kvelastic"] = round(mine[key], 4)
        out[f"{dataset}_throughput_ratio"] = round(mine["throughput_tok_s"] / stock["throughput_tok_s"], 3)
        out[f"{dataset}_ttft_mean_ratio"] = round(mine["ttft_mean_ms"] / stock["ttft_mean_ms"], 3)
        out[f"{dataset}_ttft_p99_ratio"] = round(mine["ttft_p99_ms"] / stock["ttft_p99_ms"], 3)
        out[f"{dataset}_throughput_ratio_per_round"] = [round(mine["round_ratio_min"], 3),
                                                         round(mine["round_ratio_max"], 3)]
    return out
