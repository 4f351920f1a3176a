"""Throwaway probe used to map vLLM's hooks (see patches/vllm/NOTES.md).

A `vllm.general_plugins` entry point that logs, as JSON lines to $KVPROBE_LOG, in which process
it is loaded and, with KVPROBE_PATCH=1, the BlockPool constructor arguments (EngineCore) and
the allocate_kv_cache result (worker). To register it without pip-installing a package:

    SP=$(python -c 'import site; print(site.getsitepackages()[0])')
    echo $PWD/tests/vllm > $SP/kvprobe.pth
    mkdir -p $SP/kvprobe-0.0.0.dist-info
    printf 'Metadata-Version: 2.1\nName: kvprobe\nVersion: 0.0.0\n' > $SP/kvprobe-0.0.0.dist-info/METADATA
    printf '[vllm.general_plugins]\nkvprobe = probe_plugin:register\n' > $SP/kvprobe-0.0.0.dist-info/entry_points.txt

(remove both afterwards).
"""
import json, os


def _log(**kw):
    path = os.environ.get("KVPROBE_LOG")
    if path:
        import multiprocessing as mp
        kw.update(pid=os.getpid(), proc=mp.current_process().name)
        with open(path, "a") as f:
            f.write(json.dumps(kw, default=str) + "\n")


def register():
    _log(event="register")
    if os.environ.get("KVPROBE_PATCH") != "1":
        return
    from vllm.v1.core import kv_cache_coordinator as kcc
    from vllm.v1.core.block_pool import BlockPool
    import vllm.v1.worker.gpu_model_runner as gmr

    class ProbePool(BlockPool):
        def __init__(self, num_gpu_blocks, enable_caching, hash_block_size,
                     enable_kv_cache_events=False, metrics_collector=None, **kw):
            _log(event="BlockPool", num_gpu_blocks=num_gpu_blocks, enable_caching=enable_caching,
                 hash_block_size=hash_block_size, enable_kv_cache_events=enable_kv_cache_events,
                 metrics_collector=type(metrics_collector).__name__, extra=kw)
            super().__init__(num_gpu_blocks, enable_caching, hash_block_size,
                             enable_kv_cache_events, metrics_collector, **kw)

    kcc.BlockPool = ProbePool
    orig = gmr.allocate_kv_cache

    def allocate_kv_cache(kv_cache_config, device, layout, kernel_block_sizes=None):
        out = orig(kv_cache_config, device, layout, kernel_block_sizes)
        _log(event="allocate_kv_cache", num_blocks=kv_cache_config.num_blocks,
             tensors=[dict(size=t.size, layers=t.layers, layer_stride=t.layer_stride,
                           block_stride=t.block_stride, offset=t.offset)
                      for t in kv_cache_config.kv_cache_tensors],
             layout=str(layout), kernel_block_sizes=kernel_block_sizes,
             views={k: [list(v.shape), list(v.stride()), str(v.dtype), v.untyped_storage().nbytes()]
                    for k, v in out.items()})
        return out

    gmr.allocate_kv_cache = allocate_kv_cache
