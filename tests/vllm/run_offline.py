"""Offline vLLM (CPU) on the tiny model: greedy, prefix caching on.

    /tmp/vllm-venv/bin/python tests/vllm/run_offline.py [MODEL_DIR]

Prints the outputs as JSON lines and timings; exits non-zero if greedy
output collapses to one token or a repeated prompt is not a prefix-cache hit.
Everything vLLM needs on this CPU-only, offline machine is set in ENV below.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time

ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # 2 shared cores: no pinning
    "OMP_NUM_THREADS": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",
    "TOKENIZERS_PARALLELISM": "false",
}


def main() -> int:
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    here = pathlib.Path(__file__).resolve()
    sys.path.insert(0, str(here.parents[2]))
    from tests.vllm.tinymodel import build_tiny_llama, greedy_tokens

    model = build_tiny_llama(pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/kvelastic-tiny-llama"))

    t0 = time.monotonic()
    from vllm import LLM, SamplingParams

    t1 = time.monotonic()
    llm = LLM(
        model=str(model),
        dtype="float32",
        max_model_len=1024,
        enforce_eager=True,
        enable_prefix_caching=True,
        block_size=32,  # CPU_ATTN needs a multiple of 32 (16 fails)
        max_num_seqs=8,
        seed=0,
        disable_log_stats=False,  # LLM() defaults to True: no prefix-cache counters
        # Explicit KV size: no auto sizing from gpu_memory_utilization (a
        # fraction of *host* RAM on CPU) and no warm-up pass. The env var
        # VLLM_CPU_KVCACHE_SPACE (whole GiB) would override this.
        kv_cache_memory_bytes=int(os.environ.get("KV_BYTES", 64 << 20)),
    )
    t2 = time.monotonic()
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    shared = "the cache block page memory token prefix " * 8
    prompts = [shared + "alpha", shared + "beta", "one two three", shared + "alpha"]
    outs = llm.generate(prompts, sp, use_tqdm=False)
    t3 = time.monotonic()
    again = llm.generate(prompts, sp, use_tqdm=False)
    t4 = time.monotonic()
    rc = 0
    for p, o, a in zip(prompts, outs, again):
        ids = list(o.outputs[0].token_ids)
        print(json.dumps({"prompt": p[-20:], "cached": o.num_cached_tokens,
                          "cached_again": a.num_cached_tokens, "ids": ids,
                          "text": o.outputs[0].text}))
        if len(set(ids)) < 8 or list(a.outputs[0].token_ids) != ids:
            rc = 1
    if again[0].num_cached_tokens == 0:
        rc = 1
    # vLLM (float32, CPU) and plain transformers agree token for token.
    hf = greedy_tokens(model, prompts[2], 24)
    hf_match = hf == list(outs[2].outputs[0].token_ids)
    metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()
               if m.name.startswith("vllm:prefix_cache_")}
    print(json.dumps({"hf_match": hf_match, **metrics}))
    rc = rc or int(not metrics.get("vllm:prefix_cache_hits"))
    rc = rc or int(not hf_match)
    print(json.dumps({"import_s": round(t1 - t0, 1), "engine_s": round(t2 - t1, 1),
                      "gen1_s": round(t3 - t2, 2), "gen2_s": round(t4 - t3, 2)}))
    return rc


if __name__ == "__main__":
    sys.exit(main())
