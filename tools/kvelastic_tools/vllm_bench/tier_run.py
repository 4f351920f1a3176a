"""One vLLM engine life for ``kvelastic bench tier`` (``tier.py``).

    python -m kvelastic_tools.vllm_bench.tier_run MODEL_DIR MODE KV_BYTES MAX_MODEL_LEN [CPU_BYTES]

MODE: ``stock``, ``kvelastic`` and ``kvelastic_ttl10m`` (the plugin on or off is the parent's
``KVELASTIC_ENABLE``), ``tier`` (kvelastic's ``KvelasticTierConnector``
configured, as docs/tier.md says), ``offload`` (vLLM's own
``OffloadingConnector``, CPU_BYTES of host memory), ``simple_offload``
(its ``SimpleCPUOffloadConnector``, likewise) or ``lmcache``
(``LMCacheConnectorV1``) or ``lmcache_mp`` (``LMCacheMPConnector`` to the
server on ``KVELASTIC_BENCH_LMCACHE_PORT``). Prints ``READY`` once the engine is up, or
``FAILED <error>`` if it could not start, then answers one command per
input line with a ``RESULT`` line (JSON):

- ``req JSON``: ``{"ids": [...], "max_tokens": n}``, one greedy request
  alone: its tokens, its time to first token (vLLM's own
  ``first_token_latency``), its wall time, and vLLM's prefix-cache counters
  for it (local ``hits``, ``external`` hits: a connector's, ``queries``).

End of input: the process exits (vLLM shuts the engine down: it unregisters).

    python -m kvelastic_tools.vllm_bench.tier_run --server SOCKET

A fork server: vLLM imported once (12 to 20 s of a 2-core machine's CPU per
engine otherwise), then for each connection to the Unix socket ``SOCKET``
a child forked that reads one JSON line (``{"argv": [...], "env": {...},
"log": PATH}``), takes the environment asked for (the plugin reads its
settings when vLLM registers it, in the child; nothing the children vary is
read at import), sends its stderr to ``log`` and runs the engine above with
the connection as its standard input and output. The engine runs in the
child (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so nothing else is forked.
"""

import json
import os
import sys
import time
import traceback
from typing import Any

from kvelastic_tools.vllm_bench import quick_exit  # before vLLM: its handler runs after vLLM's
from kvelastic_tools.vllm_bench.vllm_serve import VLLM_ENV

TIER_CONNECTOR = {"kv_connector": "KvelasticTierConnector", "kv_connector_module_path": "kvelastic_vllm.tier_connector",
                  "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}


def transfer_config(mode: str, cpu_bytes: int) -> dict | None:
    if mode in ("tier", "tier_host") or mode.startswith("tier_restart_"):   # the restart rounds are tier's
        return TIER_CONNECTOR
    if mode == "offload":
        return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"cpu_bytes_to_use": cpu_bytes}}
    if mode == "simple_offload":
        return {"kv_connector": "SimpleCPUOffloadConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"cpu_bytes_to_use": cpu_bytes}}
    if mode == "lmcache":
        return {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
    if mode.startswith("lmcache_mp"):   # LMCache's multi-process server (tier_lmcache), on the port the bench gives
        return {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
                "kv_connector_module_path": "lmcache.integration.vllm.lmcache_mp_connector",
                "kv_connector_extra_config": {"lmcache.mp.host": "tcp://localhost",
                                              "lmcache.mp.port": int(os.environ["KVELASTIC_BENCH_LMCACHE_PORT"])}}
    return None


PRELOAD = ("vllm", "vllm.inputs", "vllm.v1.engine.llm_engine", "vllm.v1.engine.core", "vllm.v1.worker.cpu_worker",
           "vllm.v1.worker.cpu_model_runner", "vllm.model_executor.models.llama", "kvelastic_vllm",
           "kvelastic_vllm.tier_connector", "transformers", "tokenizers")


def serve(path: str) -> None:
    """The fork server (above): never returns."""
    import importlib
    import signal
    import socket

    os.environ.update(VLLM_ENV, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    for module in PRELOAD:
        try:
            importlib.import_module(module)
        except Exception:   # noqa: BLE001 - a module of another build: imported when used, if ever
            pass
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)     # children reaped by the kernel
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(8)
    print("SERVING", flush=True)
    while True:
        conn, _ = listener.accept()
        if os.fork() == 0:
            listener.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            spec = json.loads(conn.makefile("r").readline())
            os.environ.clear()
            os.environ.update(spec["env"])
            log = os.open(spec["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(log, 2)
            os.dup2(conn.fileno(), 0)
            os.dup2(conn.fileno(), 1)
            conn.close()
            sys.stdin = open(0, closefd=False)
            sys.stdout = open(1, "w", closefd=False)
            sys.argv = [sys.argv[0], *spec["argv"]]
            main()
            quick_exit.finish()
            sys.exit(0)
        conn.close()


def main() -> None:
    model, mode, kv_bytes, max_len = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    cpu_bytes = int(sys.argv[5]) if len(sys.argv) > 5 else 0
    for key, value in VLLM_ENV.items():
        os.environ.setdefault(key, value)
    try:
        from vllm import LLM, SamplingParams

        extra: dict[str, Any] = {}
        config = transfer_config(mode, cpu_bytes)
        if config is not None:
            extra["kv_transfer_config"] = config
        if mode.startswith("lmcache_mp"):
            extra["disable_hybrid_kv_cache_manager"] = True     # as LMCache's own CI runs it
        llm = LLM(model=model, dtype="float32", max_model_len=max_len, enforce_eager=True, enable_prefix_caching=True,
                  block_size=32, max_num_seqs=4, seed=0, disable_log_stats=False, kv_cache_memory_bytes=kv_bytes,
                  **extra)
    except Exception as e:  # noqa: BLE001 - reported to the bench, which records it
        last = traceback.format_exception_only(type(e), e)[-1].strip()
        print("FAILED " + json.dumps(last[:2000]), flush=True)
        return

    def counters() -> dict[str, float]:
        return {m.name: float(getattr(m, "value", 0.0)) for m in llm.get_metrics()
                if m.name in ("vllm:prefix_cache_hits", "vllm:prefix_cache_queries",
                              "vllm:external_prefix_cache_hits")}

    print(f"READY {os.getpid()}", flush=True)      # the pid: the bench's engine restart kills it
    for line in sys.stdin:
        command, _, arg = line.strip().partition(" ")
        if command != "req":
            raise ValueError(f"unknown command {command!r}")
        req = json.loads(arg)
        before = counters()
        started = time.monotonic()
        prompt: Any = {"prompt_token_ids": req["ids"]}     # vLLM's TokensPrompt
        out = llm.generate([prompt],
                           SamplingParams(temperature=0.0, max_tokens=req["max_tokens"], ignore_eos=True),
                           use_tqdm=False)[0]
        seconds = time.monotonic() - started
        after = counters()
        metrics = out.metrics
        ttft = getattr(metrics, "first_token_latency", 0.0) or seconds

        def delta(name: str, after: dict[str, float] = after, before: dict[str, float] = before) -> float:
            return after.get(name, 0.0) - before.get(name, 0.0)

        print("RESULT " + json.dumps({
            "tokens": list(out.outputs[0].token_ids), "ttft_s": ttft, "seconds": seconds,
            "hits": delta("vllm:prefix_cache_hits"), "external": delta("vllm:external_prefix_cache_hits"),
            "queries": delta("vllm:prefix_cache_queries")}), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "--server":
        serve(sys.argv[2])
    main()
    quick_exit.finish()
