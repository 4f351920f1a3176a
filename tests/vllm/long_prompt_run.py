"""One long prompt through vLLM's offline ``LLM`` on the wide model, as JSON.

    python tests/vllm/long_prompt_run.py MODEL_DIR PROMPT_TOKENS

A prompt far larger than one slab and than the engine's watermark reserve
(the wide model's 2 MiB slab holds 1,024 tokens), chunked prefill of 512
tokens per step: vLLM admits it only if the whole prompt fits at once. Prints
the greedy token ids, the wall time of the generate call and vLLM's own
prefix-cache figures. With ``KVELASTIC_ENABLE=1`` it runs through kvelastic.
"""

import json
import os
import random
import sys
import time

from kvelastic_tools.vllm_bench import quick_exit  # before vLLM: its handler runs after vLLM's
from kvelastic_tools.vllm_bench.vllm_serve import VLLM_ENV


def main() -> None:
    for key, value in VLLM_ENV.items():
        os.environ.setdefault(key, value)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    model, length = sys.argv[1], int(sys.argv[2])
    llm = LLM(model=model, dtype="bfloat16", max_model_len=8192, max_num_batched_tokens=512, enforce_eager=True,
              enable_prefix_caching=True, block_size=32, max_num_seqs=4, seed=0, disable_log_stats=False,
              kv_cache_memory_bytes=64 << 20)
    rng = random.Random(7)
    prompt = TokensPrompt(prompt_token_ids=[rng.randrange(3, 500) for _ in range(length)])
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    start = time.monotonic()
    [out] = llm.generate([prompt], params, use_tqdm=False)
    elapsed = time.monotonic() - start
    print("RESULT " + json.dumps({"tokens": list(out.outputs[0].token_ids), "seconds": elapsed}), flush=True)


if __name__ == "__main__":
    main()
    quick_exit.finish()
