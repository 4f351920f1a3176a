"""Greedy generation with vLLM's offline ``LLM`` on the tiny model, as JSON.

    python tests/vllm/offline_run.py MODEL_DIR [--compiled] [--engine-args JSON]

Runs a batch with shared prefixes three times: cold (misses), warm (hits),
and after ``reset_prefix_cache`` (misses again), and prints the token ids and
vLLM's own prefix-cache counters for each phase. With ``KVELASTIC_ENABLE=1``
in the environment the same run goes through kvelastic. ``--compiled`` runs
vLLM's compiled path (CUDA graphs on a GPU) instead of eager; ``--engine-args``
adds vLLM engine arguments (the GPU kit's: its bundle's attention backend).
"""

import json
import sys
import time

from tiny_llm import tiny_llm

from kvelastic_tools.vllm_bench import quick_exit  # before vLLM: its handler runs after vLLM's

PREFIXES = ["the cache block page memory token prefix " * 12, "alpha beta gamma delta epsilon zeta " * 14]
PROMPTS = [p + f"question number {i} about slabs" for p in PREFIXES for i in range(3)]


def main() -> None:
    from vllm import SamplingParams

    started = time.monotonic()
    flags = sys.argv[2:]
    extra = json.loads(flags[flags.index("--engine-args") + 1]) if "--engine-args" in flags else {}
    llm = tiny_llm(sys.argv[1], enforce_eager="--compiled" not in flags, **extra)
    result: dict = {"start_s": round(time.monotonic() - started, 2)}
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    def counters():
        m = {x.name: x.value for x in llm.get_metrics() if x.name.startswith("vllm:prefix_cache")}
        return m["vllm:prefix_cache_queries"], m["vllm:prefix_cache_hits"]

    for phase in ("cold", "warm", "reset"):
        if phase == "reset":
            assert llm.reset_prefix_cache()
        q0, h0 = counters()
        t0 = time.monotonic()
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        seconds = time.monotonic() - t0
        q1, h1 = counters()
        result[phase] = {"tokens": [list(o.outputs[0].token_ids) for o in outputs],
                         "queries": q1 - q0, "hits": h1 - h0, "seconds": round(seconds, 3)}
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
    quick_exit.finish()
