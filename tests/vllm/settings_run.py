"""vLLM's offline ``LLM`` through the plugin, reporting what the daemon sees.

    python tests/vllm/settings_run.py MODEL_DIR SOCKET

Generates a batch with shared prefixes twice (the second run hits), waits
while the engine idles (so a prefix-cache TTL, when set, expires blocks),
then prints this engine's entry of the daemon's status, as JSON, while the
engine is still registered. The plugin's settings come from the environment
(``KVELASTIC_*``), exactly as an operator sets them. Also prints vLLM's
block-hash root (``NONE_HASH``), which the plugin seeds per namespace.
"""

import json
import os
import sys
import time

from tiny_llm import tiny_llm

from kvelastic_tools.vllm_bench import quick_exit  # before vLLM: its handler runs after vLLM's

PREFIXES = ["the cache block page memory token prefix " * 12, "alpha beta gamma delta epsilon zeta " * 14]
PROMPTS = [p + f"question number {i} about slabs" for p in PREFIXES for i in range(3)]
IDLE = 2.5   # seconds without a step after the second batch


def main() -> None:
    from vllm import SamplingParams

    from kvelastic.ctl import get_status

    llm = tiny_llm(sys.argv[1])
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for _ in range(2):
        llm.generate(PROMPTS, params, use_tqdm=False)
    time.sleep(IDLE)
    import vllm.v1.core.kv_cache_utils as kv_cache_utils

    [engine] = [e for e in get_status(sys.argv[2])["engines"] if e["pid"] == os.getpid()]
    print("RESULT " + json.dumps({"engine": engine, "none_hash": bytes(kv_cache_utils.NONE_HASH).hex()}),
          flush=True)


if __name__ == "__main__":
    main()
    quick_exit.finish()
