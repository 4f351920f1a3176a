"""vLLM's offline ``LLM`` over the tiny model, as the vLLM tests' scripts
(``offline_run.py``, ``settings_run.py``, ``replica_run.py``) start it:
offline, eager, prefix caching on, blocks of 32 tokens."""

import os

from kvelastic_vllm.bench.vllm_serve import VLLM_ENV


def tiny_llm(model: str, max_model_len: int = 1024):
    for key, value in VLLM_ENV.items():
        os.environ.setdefault(key, value)
    from vllm import LLM

    return LLM(model=model, dtype="float32", max_model_len=max_model_len, enforce_eager=True,
               enable_prefix_caching=True, block_size=32, max_num_seqs=8, seed=0, disable_log_stats=False,
               kv_cache_memory_bytes=64 << 20)
