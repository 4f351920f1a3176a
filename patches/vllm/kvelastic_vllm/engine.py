"""EngineCore side: register the engine with the daemon while vLLM sizes its KV cache.

vLLM turns available memory into ``num_blocks`` in ``get_kv_cache_configs``.
The wrapper lets vLLM lay the cache out once, reads the geometry (bytes per
block per layer, layer-outer or block-outer), registers the engine, and asks
vLLM again for exactly ``max_slabs * blocks_per_slab`` blocks: the engine's
whole virtual capacity. Memory arrives underneath, slab by slab.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from typing import Any

from kvelastic.client.engine import EngineClient
from kvelastic.core.pool import SlabPool
from kvelastic_vllm import demand
from kvelastic_vllm.identity import namespace_of
from kvelastic_vllm.link import EngineLink, Geometry
from kvelastic_vllm.patching import keep_face
from kvelastic_vllm.state import PluginState, state

# Consecutive pages a slab may take per region: a block size no page
# divides needs a run of pages (its odd factor: 9 for MLA's 576 latents).
MAX_PAGES_PER_REGION = 64

log = logging.getLogger("kvelastic.vllm")


def geometry_of(kv_cache_config: Any, page_size: int, num_workers: int, model: str = "this model") -> Geometry:
    """Check that vLLM's layout maps onto pages and derive the slab geometry.

    vLLM keeps the whole KV cache in one backing allocation and describes it
    with one ``KVCacheTensor`` per cache group (hybrid models: Gemma 3's five
    sliding-window groups and one full-attention group), all of the same
    size and strides, overlapping: group ``g``'s layer ``l`` lives in the same
    region as every other group's layer ``l``, and a block id is one group's
    block at a time. So a slab is the same block range in every region, as
    for one group: layer-outer, a page per region; block-outer, one page
    holding whole blocks."""
    _check_specs(kv_cache_config, model)
    tensors = kv_cache_config.kv_cache_tensors
    t = tensors[0]
    shapes = {(x.size, x.block_stride, x.layer_stride) for x in tensors}
    if len(shapes) != 1:
        raise RuntimeError(f"kvelastic: {model}'s KV cache tensors differ in size or strides ({sorted(shapes)}); "
                           "kvelastic maps one layout for every cache group. Run it without KVELASTIC_ENABLE")
    # A slab takes ``run`` consecutive pages per region: the fewest that hold
    # whole blocks (1 unless the block size is no divisor of the page, as
    # MLA's 576-wide latents make it: 36,864-byte blocks need 9 pages).
    run = t.block_stride // math.gcd(t.block_stride, page_size)
    if run > MAX_PAGES_PER_REGION:
        raise RuntimeError(f"kvelastic: a KV block of {model} takes {t.block_stride} bytes per region; only "
                           f"{run} pages of {page_size} bytes hold whole blocks (at most {MAX_PAGES_PER_REGION}); "
                           "set KVELASTIC_PAGE_SIZE to a multiple of the block, or run it without "
                           "KVELASTIC_ENABLE (see docs/models.md)")
    if t.layer_stride == kv_cache_config.num_blocks * t.block_stride:
        # layer-outer: a region per layer position; a tensor at an offset starts further in
        if any(x.offset % t.layer_stride for x in tensors):
            raise RuntimeError(f"unsupported KV layout: a tensor offset not a multiple of the layer stride "
                               f"{t.layer_stride}")
        regions = max(x.offset // t.layer_stride + len(x.layers) for x in tensors)
        if regions * t.layer_stride > t.size:
            raise RuntimeError(f"unsupported KV layout: {regions} layer regions exceed the allocation of {t.size}")
    elif all(x.offset + t.layer_stride * len(x.layers) <= t.block_stride for x in tensors):
        regions = 1                           # block-outer: a block holds every layer
    else:
        raise RuntimeError(f"unsupported KV layout: layer stride {t.layer_stride}, block stride {t.block_stride}")
    bps = run * page_size // t.block_stride
    return Geometry(t.block_stride, regions, bps, run * page_size * regions * max(1, num_workers) // bps, run)


def _check_specs(kv_cache_config: Any, model: str) -> None:
    """Attention caches (full, sliding window, chunked local, MLA, ...) and
    state caches (``MambaSpec``: Mamba, linear attention, short convolutions)
    live in the same elastic pages: vLLM gives every group blocks of one page
    size in one backing allocation, and a state block is a block like any
    other (live while its request runs, cached only where vLLM caches it).
    Anything else (HiSparse's caches, allocated apart) is refused at
    start-up, saying what to do. With prefix caching on, vLLM caches state
    blocks too (``block_pool.py``: partial entries and hash moves), and so
    does the elastic pool."""
    from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec, UniformTypeKVCacheSpecs

    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        specs = spec.kv_cache_specs.values() if isinstance(spec, UniformTypeKVCacheSpecs) else [spec]
        other = next((s for s in specs if not isinstance(s, AttentionSpec | MambaSpec)), None)
        if other is not None:
            raise RuntimeError(f"kvelastic: {model} keeps a {type(other).__name__} cache, which vLLM allocates "
                               "apart from its KV cache tensors and kvelastic does not back: run it without "
                               "KVELASTIC_ENABLE (see docs/models.md)")


def caches_state(kv_cache_config: Any, prefix_caching: bool) -> bool:
    """vLLM caches state blocks (Mamba, linear attention) with prefix caching
    on: through partial-block entries, whose prefix length (vLLM's
    ``block_hash_num_tokens``) its Mamba manager reads at every hit. A key
    alone does not carry it, so such an engine's blocks are never handed to
    or adopted from another engine (it registers private: its cache is its
    own, and is not kept after it exits)."""
    from vllm.v1.kv_cache_interface import MambaSpec, UniformTypeKVCacheSpecs

    if not prefix_caching:
        return False
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        specs = spec.kv_cache_specs.values() if isinstance(spec, UniformTypeKVCacheSpecs) else [spec]
        if any(isinstance(s, MambaSpec) for s in specs):
            return True
    return False


def reserve_watermark(max_num_batched_tokens: int, block_size: int, blocks_per_slab: int, groups: int = 1) -> int:
    """Free blocks kept ahead of need: one scheduling step's worth (each KV
    cache group takes its own blocks for the same tokens) plus a slab, so a
    step rarely waits for the daemon (larger needs are demand grows)."""
    return math.ceil(max_num_batched_tokens / block_size) * max(1, groups) + blocks_per_slab


def engine_id_of_rank(engine_id: str, parallel_config: Any) -> str:
    """Data parallel: each rank's EngineCore is an engine of its own in the
    daemon (``llm-dp1``...), of one namespace, so hand-off and warm restarts
    work across the ranks. Its workers learn the name with their KV cache
    config (``wrap_get_kv_cache_configs``). vLLM runs each rank of a dense
    model as an independent engine of DP size 1 and rank 0; only
    ``data_parallel_index`` keeps the rank, so rank 0 of a dense model keeps
    the plain id."""
    index: int = getattr(parallel_config, "data_parallel_index", None) \
        or getattr(parallel_config, "data_parallel_rank", 0) or 0
    size = getattr(parallel_config, "data_parallel_size", 1) or 1
    return f"{engine_id}-dp{index}" if size > 1 or index > 0 else engine_id


def register(vllm_config: Any, kv_cache_configs: list, plugin: PluginState) -> EngineLink:
    config = plugin.config
    engine_id = engine_id_of_rank(plugin.engine_id, vllm_config.parallel_config)
    num_workers = len(kv_cache_configs)
    architecture = ",".join(getattr(vllm_config.model_config.hf_config, "architectures", None) or ["this model"])
    # Pipeline stages hold different layers: a slab has as many regions as the largest stage needs.
    caching = bool(vllm_config.cache_config.enable_prefix_caching)
    state_caching = caches_state(kv_cache_configs[0], caching)
    if state_caching and not config.private_cache:
        log.info("kvelastic: engine %s caches state blocks (%s with prefix caching): its cache stays its own "
                 "(no hand-on, not kept after it exits)", engine_id, architecture)
    geometries = [geometry_of(c, config.page_size, num_workers, architecture) for c in kv_cache_configs]
    if len({g.block_stride for g in geometries}) != 1:
        raise RuntimeError(f"kvelastic: {architecture}'s workers lay out KV blocks of different sizes "
                           f"({sorted({g.block_stride for g in geometries})}); run it without KVELASTIC_ENABLE")
    geometry = max(geometries, key=lambda g: g.regions)
    low = reserve_watermark(vllm_config.scheduler_config.max_num_batched_tokens,
                            vllm_config.cache_config.block_size, geometry.blocks_per_slab,
                            len(kv_cache_configs[0].kv_cache_groups))
    pool = SlabPool(geometry.blocks_per_slab, block_size=vllm_config.cache_config.block_size,
                    block_bytes=geometry.block_bytes, max_cached_bytes=config.prefix_cache_max_size,
                    ttl=config.prefix_cache_ttl)
    client = EngineClient(pool, socket_path=config.socket, engine_id=engine_id,
                          namespace=namespace_of(vllm_config, geometry.block_stride, geometry.regions, num_workers,
                                                 config.tenant_salt), page_size=config.page_size,
                          pages_per_worker=geometry.regions * geometry.pages_per_region,
                          pages_per_region=geometry.pages_per_region, num_workers=num_workers,
                          block_bytes=geometry.block_bytes, min_bytes=config.engine_min_memory,
                          max_bytes=config.engine_max_memory, low_watermark=0, key_group_suffix=True,
                          private=config.private_cache or state_caching)
    client.start(timeout=30.0)
    link = attach(plugin, client, geometry, low)
    log.info("kvelastic: engine %s registered: %d blocks of virtual capacity (%d slabs of %d blocks), "
             "namespace %s", engine_id, link.num_blocks, client.max_slabs, geometry.blocks_per_slab,
             client.namespace)
    return link


def attach(plugin: PluginState, client: EngineClient, geometry: Geometry, low_watermark: int) -> EngineLink:
    """Make ``client`` (registered, started with no watermark: no prefetch
    before the block pool exists, whose records the blocks must be) the
    engine the next ElasticBlockPool serves."""
    return plugin.attach(EngineLink(client.pool, client, geometry, client.max_slabs * geometry.blocks_per_slab,
                                    low_watermark))


def wrap_get_kv_cache_configs(original):
    @keep_face(original)
    def get_kv_cache_configs(vllm_config, kv_cache_specs, available_memory, *rest):
        # *rest: vLLM 0.33 passes the global KV cache groups as well.
        first = original(vllm_config, kv_cache_specs, available_memory, *rest)
        link = register(vllm_config, first, state())
        vllm_config.cache_config.num_gpu_blocks_override = link.num_blocks
        configs = original(vllm_config, kv_cache_specs, available_memory, *rest)
        # The engine's secret travels to its workers with their KV cache config
        # (pickled to worker processes); a worker in this process also finds
        # it in the plugin state's link (see ``worker.worker_client``).
        for config in configs:
            config.kvelastic_token = link.client.token
            config.kvelastic_engine_id = link.client.engine_id
        t = configs[0].kv_cache_tensors[0]
        if configs[0].num_blocks != link.num_blocks or t.block_stride != link.geometry.block_stride:
            raise RuntimeError(f"kvelastic: vLLM laid out {configs[0].num_blocks} blocks of {t.block_stride} "
                               f"bytes, expected {link.num_blocks} of {link.geometry.block_stride}")
        return configs

    return get_kv_cache_configs


# vLLM's own collective RPCs that change no weight (it calls some itself).
# Anything else sent through ``collective_rpc`` may: worker extensions that
# load weights (veRL, OpenRLHF, TRL, NeMo-RL), ``reload_weights``, vLLM's
# weight transfer (``update_weights``), a pickled function.
READ_ONLY_RPCS = frozenset({"get_model_inspection", "compute_weight_checksums", "synchronize_device",
                            "update_max_model_len", "check_health", "list_loras", "save_sharded_state",
                            "release_late_interaction_query_cache"})


def wrap_collective_rpc(original):
    """A collective RPC that may change the weights: the engine diverges
    (its cache is its own from now on) before the RPC runs, so nothing it
    caches with the new weights reaches an engine of the checkpoint."""

    plugin = state()

    @keep_face(original)
    def collective_rpc(self, method, *args, **kwargs):
        link = plugin.link
        if link is not None and not (isinstance(method, str) and method in READ_ONLY_RPCS):
            name = method if isinstance(method, str) else getattr(method, "__name__", "a function")
            link.client.diverge(f"collective_rpc {name}")
        return original(self, method, *args, **kwargs)

    return collective_rpc


def _begin_step(pool: Any) -> None:
    """A scheduler step takes hold of the pool, with the client's lock held:
    the block pool is told so (``ElasticBlockPool.in_step``: its calls skip
    the lock). Plain calls, not a context manager: a generator's frames on
    every step cost more than the rest of the wrapper (``docs/benchmarks.md``)."""
    if pool is not None:
        pool.refresh()
        pool.in_step = True


def _end_step(pool: Any) -> None:
    """The step lets go of the pool (lock still held): the demand hooks an
    admission put on (``demand.py``) end with it."""
    if pool is not None:
        pool.in_step = False
        demand.stop_hearing(pool.demand)


def wrap_schedule(original):
    """One scheduling step is atomic for the pool: a reclaim cannot take a slab
    between the lookup of a cached block and the touch that makes it live.

    Each scheduled step is numbered in the pool's journal (the blocks vLLM
    keys while scheduling it hold their KV only once it ran: see
    ``wrap_update_from_output``), and before it runs the daemon has
    acknowledged any dropped key whose block it may rewrite (``seal_step``)."""

    plugin = state()

    @keep_face(original)
    def schedule(self, *args, **kwargs):
        link = plugin.link
        if link is None:
            return original(self, *args, **kwargs)
        pool = link.block_pool
        with link.client.lock:
            _begin_step(pool)
            try:
                step = link.pool.begin_step()
                out = original(self, *args, **kwargs)
            finally:
                _end_step(pool)
        out.kvelastic_step = step
        link.client.seal_step()
        link.client.poll()
        return out

    return schedule


def wrap_update_from_output(original):
    """The model output of a step arrived: the KV of the blocks keyed while
    scheduling it is written (steps finish in order, with or without vLLM's
    batch queue)."""

    plugin = state()

    @keep_face(original)
    def update_from_output(self, scheduler_output, *args, **kwargs):
        link = plugin.link
        if link is None:
            return original(self, scheduler_output, *args, **kwargs)
        step = getattr(scheduler_output, "kvelastic_step", 0)
        # Held throughout: vLLM takes the pool's events and publishes them in
        # here, and the I/O thread publishes what a reclaim queued between
        # steps (``PoolEvents.publish_queued``): one order for both.
        pool = link.block_pool
        with link.client.lock:
            _begin_step(pool)
            try:
                if step:
                    link.pool.end_step(step)
                return original(self, scheduler_output, *args, **kwargs)
            finally:
                _end_step(pool)

    return update_from_output


def call_blocks(scheduler: Any) -> int | None:
    """The most free blocks one running request's capacity check can need
    (``ElasticBlockPool.call_blocks``): a step's token budget plus lookahead
    (speculative) tokens, and the partial block they start in, in every
    cache group. None if this vLLM's scheduler does not say (the pool keeps
    its reserve watermark, which covers a step's tokens and a slab)."""
    budget = getattr(scheduler, "max_num_scheduled_tokens", None)
    config = getattr(scheduler, "kv_cache_config", None)
    if not isinstance(budget, int) or config is None:
        return None
    tokens = budget + (getattr(scheduler, "num_lookahead_tokens", 0) or 0)
    return sum(-(-tokens // group.kv_cache_spec.block_size) + 1 for group in config.kv_cache_groups)


def wrap_scheduler_init(original):
    """The elastic block pool publishes through the scheduler's KV event publisher too.

    Its sequence numbers start at the wall clock in microseconds, not 0: a
    router takes a batch whose number it has seen from this endpoint for a
    duplicate, and an engine restarted on the same endpoint (a warm restart,
    whose first batches announce the cache it adopted) would go unheard until
    it passed its earlier life's count. At most one batch per step, so a
    later life always numbers above an earlier one's."""

    @keep_face(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        pool = getattr(getattr(self, "kv_cache_manager", None), "block_pool", None)
        if hasattr(pool, "call_blocks"):
            pool.call_blocks = call_blocks(self) or pool.call_blocks
        if hasattr(pool, "events"):
            publisher = getattr(self, "kv_event_publisher", None)
            pool.events.publisher = publisher
            if hasattr(publisher, "_seq_gen"):   # vLLM's ZmqEventPublisher (itertools.count from 0)
                publisher._seq_gen = itertools.count(time.time_ns() // 1000)

    return __init__


def wrap_record_prefix_cache_stats(original):
    """Count prefix-cache queries and hits in the core pool's stats, which the
    daemon exports per engine, exactly as vLLM counts its own
    ``prefix_cache_queries`` / ``prefix_cache_hits``: prompt tokens looked up
    and tokens served from the cache, once per admitted request (whether or
    not vLLM itself logs stats)."""

    plugin = state()

    @keep_face(original)
    def record_prefix_cache_stats(self, request, num_hits, *args, **kwargs):
        original(self, request, num_hits, *args, **kwargs)
        enabled = getattr(self, "prefix_cache_lookup_enabled", None)
        link = plugin.link
        if link is not None and (enabled(request) if enabled else self.enable_caching):
            link.pool.record_query(request.num_tokens, num_hits)

    return record_prefix_cache_stats


def wrap_shutdown(original):
    """The EngineCore shuts down (``vllm serve`` stopped, the ``LLM`` deleted or
    the interpreter exiting): the engine unregisters, its journal (the last
    steps' completions) flushed first, so the daemon keeps its valid cache
    for the next engine of its namespace (a graceful restart starts warm)."""

    plugin = state()

    @keep_face(original)
    def shutdown(self, *args, **kwargs):
        link = plugin.link
        try:
            return original(self, *args, **kwargs)
        finally:
            if link is not None and plugin.link is link:
                plugin.detach()
                link.client.close()
                log.info("kvelastic: engine %s unregistered", link.client.engine_id)

    return shutdown
