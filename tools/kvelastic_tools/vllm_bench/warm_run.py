"""One vLLM engine through the plugin (or stock, ``KVELASTIC_ENABLE=0``), for
``kvelastic bench warm`` and the warm-restart tests.

    python -m kvelastic_tools.vllm_bench.warm_run MODEL_DIR

Prints ``READY`` once the engine is up, then runs one command per input line,
each answered by a ``RESULT`` line (JSON):
- ``workload``: the prefix-heavy workload once (prompts sharing a long
  system prompt): greedy tokens, vLLM's prefix-cache hits and queries (tokens).
- ``first``: the workload's prompts with one output token each: the time to
  first token of the batch, and its hits.
- ``unrelated``: one prompt that shares nothing with the workload, likewise.
- ``poison``: the unrelated prompt, but the process kills itself (SIGKILL)
  in the middle of its first model step, after the daemon heard the keys
  that step stores (no RESULT: the process is gone).
- ``stats``: this engine's counters in the daemon (adopted blocks, their hits).
End of input: the process exits (vLLM shuts the engine down: it unregisters).
"""

import json
import os
import signal
import sys
import time

from kvelastic_tools.vllm_bench import quick_exit  # before vLLM: its handler runs after vLLM's
from kvelastic_tools.vllm_bench.tinymodel import offline_llm

SYSTEM = ("You are a careful assistant for a memory allocator team. Answer about pages, slabs, blocks, "
          "prefix caches, eviction, reclaim, namespaces and warm restarts. ") * 18
QUESTIONS = ["What is a slab?", "Why keep a cache after a crash?", "How is a page zeroed?",
             "Who owns the block refcounts?", "When does a reserve decay?", "What is a namespace?"]
UNRELATED = "zebra " + " ".join(f"w{i}" for i in range(240))
POISON = {"armed": False}


def arm_poison() -> None:
    """The next model step kills the process: after scheduling (its keys are
    stored and the daemon acknowledged them) and before its KV is written."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner.execute_model

    def execute_model(self, scheduler_output, *args, **kwargs):
        if POISON["armed"] and scheduler_output.total_num_scheduled_tokens:
            from kvelastic_vllm.state import state

            client = state().link.client
            with client.lock:
                client.flush_journal(sync=True)   # the daemon has this step's keys, not its end
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, scheduler_output, *args, **kwargs)

    setattr(GPUModelRunner, "execute_model", execute_model)   # noqa: B010 - mypy refuses a method assignment


def engine_stats(wait_for_hits: bool) -> dict:
    from kvelastic.ctl import get_status

    # The engine this process started: in vLLM's default layout its EngineCore
    # is a child process, so by the id the plugin exported (``register``).
    engine_id = os.environ.get("KVELASTIC_ENGINE_ID")
    deadline = time.monotonic() + 5
    while True:
        engines = [e for e in get_status(os.environ["KVELASTIC_SOCKET"])["engines"]
                   if (e["engine_id"] == engine_id if engine_id else e["pid"] == os.getpid())]
        if engines and (not wait_for_hits or engines[0]["stats"]["adopted_hits"] or time.monotonic() > deadline):
            return engines[0]["stats"]
        time.sleep(0.1)


def main() -> None:
    from vllm import SamplingParams

    arm_poison()
    llm = offline_llm(sys.argv[1], max_model_len=2048)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)

    def counter(name: str) -> float:
        return next(m.value for m in llm.get_metrics() if m.name == name)

    def run(prompts: list[str], sampling=params) -> dict:
        hits, queries = counter("vllm:prefix_cache_hits"), counter("vllm:prefix_cache_queries")
        started = time.monotonic()
        outs = llm.generate(prompts, sampling, use_tqdm=False)
        return {"tokens": [list(o.outputs[0].token_ids) for o in outs],
                "seconds": time.monotonic() - started,
                "hits": counter("vllm:prefix_cache_hits") - hits,
                "queries": counter("vllm:prefix_cache_queries") - queries}

    print("READY", flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "workload":
            out = run([SYSTEM + q for q in QUESTIONS])
        elif command == "first":       # the workload's prefill and first token only: its time is the TTFT
            out = run([SYSTEM + q for q in QUESTIONS], SamplingParams(temperature=0.0, max_tokens=1))
        elif command == "unrelated":
            out = run([UNRELATED])
        elif command == "poison":
            POISON["armed"] = True
            run([UNRELATED])
            raise AssertionError("the poisoned step did not kill the process")
        elif command == "stats":
            out = engine_stats(wait_for_hits=True)
        else:
            raise ValueError(f"unknown command {command!r}")
        print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
    quick_exit.finish()
