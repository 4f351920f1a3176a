"""Worker side: KV tensors are views over an arena the daemon's pages map into.

``allocate_kv_cache`` reserves the engine's whole virtual capacity (no memory
until slabs are mapped) and builds vLLM's per-layer views over it, exactly
where vLLM would have put them in its single backing allocation. Each model
step runs inside ``WorkerClient.step()``, so pages are unmapped only between
steps.

CUDA graphs (no ``--enforce-eager``) need two more things, both here: vLLM's
memory profiler builds a throwaway minimal KV cache before the engine
registers (its config carries no kvelastic engine: stock allocation), and
its warm-up and graph capture run before any slab is granted, over every
block (``WorkerClient.warm_up``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from kvelastic.client.worker import WorkerClient
from kvelastic.vmm import get_backend
from kvelastic_vllm.patching import keep_face
from kvelastic_vllm.state import state

log = logging.getLogger("kvelastic.vllm")


def _rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0


def daemon_device(device: torch.device, rank: int, chosen: tuple[str, ...]) -> str:
    """The daemon device this worker's pages live on: ``KVELASTIC_WORKER_DEVICES``
    by rank; else its GPU's UUID (CUDA indices differ between processes under
    ``CUDA_VISIBLE_DEVICES``; the UUID names the same GPU in the daemon);
    else "" (the engine's device)."""
    if chosen:
        return chosen[rank % len(chosen)]
    if device.type == "cuda":
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
    return ""


def worker_client(device: torch.device, token: bytes = b"", engine_id: str = "") -> WorkerClient:
    """This worker's link, opened with its engine's secret and name (``token``,
    ``engine_id``: from the KV cache config the EngineCore sent, see
    ``engine.wrap_get_kv_cache_configs``; a worker in the EngineCore's own
    process also has the engine's link)."""
    plugin = state()
    if plugin.worker is not None:
        return plugin.worker
    config = plugin.config
    backend = get_backend("cuda" if device.type == "cuda" else "host", config.page_size,
                          **({"device": device.index or 0} if device.type == "cuda" else {}))
    if not token and plugin.link is not None:
        token = plugin.link.client.token
    if plugin.link is not None:
        engine_id = engine_id or plugin.link.client.engine_id
    engine_id = engine_id or plugin.engine_id
    rank = _rank()
    client = WorkerClient(backend, socket_path=config.socket, engine_id=engine_id, rank=rank,
                          device=daemon_device(device, rank, config.worker_devices), token=token).start(30.0)
    plugin.worker = client
    log.info("kvelastic: worker %d of engine %s reserved %d MiB of virtual KV space on device %s",
             client.rank, engine_id, client.reserved_arena().size >> 20, client.device or "(the engine's)")
    return client


def wrap_allocate_kv_cache(original):
    """The engine's KV cache over the arena; any other (the profiler's
    minimal cache, which no registered engine's config describes) stock."""

    @keep_face(original)
    def allocate(kv_cache_config: Any, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
        if getattr(kv_cache_config, "kvelastic_engine_id", None) is None:
            log.debug("kvelastic: a KV cache of no registered engine (vLLM's profiling pass): stock allocation")
            return original(kv_cache_config, *args, **kwargs)
        return allocate_kv_cache(kv_cache_config, *args, **kwargs)

    return allocate


def wrap_warm_up(original):
    """``compile_or_warm_up_model`` over a fully backed arena (``WorkerClient.warm_up``)."""

    plugin = state()

    @keep_face(original)
    def compile_or_warm_up_model(self, *args, **kwargs):
        client = plugin.worker
        if client is None:
            return original(self, *args, **kwargs)
        with client.warm_up():
            return original(self, *args, **kwargs)

    return compile_or_warm_up_model


def allocate_kv_cache(kv_cache_config: Any, device: torch.device, layout: Any,
                      kernel_block_sizes: list[int] | None = None) -> dict[str, torch.Tensor]:
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs, create_kv_cache_views

    if not kv_cache_config.kv_cache_tensors:
        return {}
    size = kv_cache_config.kv_cache_tensors[0].size
    arena = worker_client(device, getattr(kv_cache_config, "kvelastic_token", b""),
                          getattr(kv_cache_config, "kvelastic_engine_id", "")).reserved_arena()
    if size > arena.size:
        raise RuntimeError(f"kvelastic: vLLM wants {size} bytes of KV space, the arena has {arena.size}")
    buf = arena.tensor(torch.int8, (size,))
    kv_caches: dict[str, torch.Tensor] = {}
    for tensor in kv_cache_config.kv_cache_tensors:
        group_id, group = next((i, g) for i, g in enumerate(kv_cache_config.kv_cache_groups)
                               if tensor.layers[0] in g.layer_names)
        spec = group.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            spec = spec.kv_cache_specs[tensor.layers[0]]
        # vLLM 0.30+: a spec without per-layer views lays the raw buffer out
        # itself, and a tensor may hold its own block count; vLLM 0.29 views
        # every spec over kv_cache_config.num_blocks.
        if not getattr(spec, "has_layer_views", True):
            kv_caches.update((name, buf) for name in tensor.layers)
            continue
        kernel_block_size = kernel_block_sizes[group_id] if kernel_block_sizes and group_id < len(
            kernel_block_sizes) else None
        num_blocks = kv_cache_config.num_blocks_of(tensor) if hasattr(kv_cache_config, "num_blocks_of") \
            else kv_cache_config.num_blocks
        views = create_kv_cache_views(buf, spec, num_blocks, layout, tensor, kernel_block_size=kernel_block_size)
        kv_caches.update(zip(tensor.layers, views))
    return kv_caches


def wrap_step(original):
    """``execute_model`` and ``sample_tokens`` (drafters read the KV cache there
    too) run inside ``WorkerClient.step()``: no unmap while they run."""

    plugin = state()

    @keep_face(original)
    def step(self, *args, **kwargs):
        client = plugin.worker
        if client is None:
            return original(self, *args, **kwargs)
        with client.step():
            return original(self, *args, **kwargs)

    return step
