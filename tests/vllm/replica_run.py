"""One vLLM replica through the plugin, for the cache hand-off test.

    python tests/vllm/replica_run.py MODEL_DIR give|take

The batch: distinct prompts whose cached blocks fill the engine's first slab
(which also holds vLLM's null block, so it never moves) and spill into a
second one (the tiny model's slab holds 128 blocks of 32 tokens).
``give``: generate the batch twice (the second run hits), print ``RESULT``
with its tokens and vLLM's hit count for the second run, then wait: an
input line ``again`` runs it twice again (when memory came back) and prints
another ``RESULT``; end of input exits. The engine idles meanwhile, holding
its cache.
``take``: generate one short unrelated prompt first (its demand takes the
giver's second slab, whose cache comes along within a namespace), then the
batch once: ``RESULT`` with tokens, hits and this engine's counters in the
daemon (adopted blocks, hits on them).
"""

import json
import os
import random
import sys
import time

from tiny_llm import tiny_llm

from kvelastic_tools.vllm_bench import quick_exit  # before vLLM: its handler runs after vLLM's

OTHER = "an unrelated short prompt"
WORDS = "the cache block page memory token prefix alpha beta gamma delta epsilon zeta question number about".split()
def batch_prompts(tokenizer, n: int = 20, limit: int = 400) -> list[str]:
    """``n`` distinct prompts of at most ``limit`` tokens (about 9 cached
    blocks each, some 180 in all): more than the 127 the engine's first slab
    has room for, less than two slabs."""
    prompts, seed = [], 0
    while len(prompts) < n:
        seed += 1
        rng = random.Random(seed)
        prompt = " ".join(rng.choice(WORDS) for _ in range(150))
        if len(tokenizer.encode(prompt)) <= limit:
            prompts.append(prompt)
    return prompts


def main() -> None:
    from vllm import SamplingParams

    llm = tiny_llm(sys.argv[1], max_model_len=2048)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)

    def hits() -> float:
        return next(m.value for m in llm.get_metrics() if m.name == "vllm:prefix_cache_hits")

    prompts = batch_prompts(llm.get_tokenizer())

    def batch(newest_first: bool = False) -> dict:
        """The batch's tokens (in the batch's order) and vLLM's hits for it.
        ``newest_first``: the giver's last prompts (the ones in its second
        slab) are scheduled first, so they hit before others' blocks evict."""
        before = hits()
        order = prompts[::-1] if newest_first else prompts
        out = [list(o.outputs[0].token_ids) for o in llm.generate(order, params, use_tqdm=False)]
        return {"tokens": out[::-1] if newest_first else out, "hits": hits() - before}

    if sys.argv[2] == "give":
        batch()
        print("RESULT " + json.dumps(batch()), flush=True)
        for line in sys.stdin:
            if line.strip() == "again":
                batch()
                print("RESULT " + json.dumps(batch()), flush=True)
    else:
        llm.generate([OTHER], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        out = batch(newest_first=True)
        out["stats"] = engine_stats()
        print("RESULT " + json.dumps(out), flush=True)


def engine_stats() -> dict:
    """This engine's counters as the daemon has them, once its journal (with
    the adopted blocks' hits) has arrived."""
    from kvelastic.ctl import get_status

    deadline = time.monotonic() + 5
    while True:
        [engine] = [e for e in get_status(os.environ["KVELASTIC_SOCKET"])["engines"] if e["pid"] == os.getpid()]
        if engine["stats"]["adopted_hits"] or time.monotonic() > deadline:
            return engine["stats"]
        time.sleep(0.1)


if __name__ == "__main__":
    main()
    quick_exit.finish()
