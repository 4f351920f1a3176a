"""``kvelastic bench warm``: the first repeat of a prefix-heavy workload after
an engine restart, cold (stock vLLM: its prefix cache died with it) against
warm (kvelastic: the daemon kept the valid cache, the new engine adopts it).

Real vLLM (the CPU build, the tiny model) in one process per engine life
(``warm_run.py``), a real daemon (host backend). Each round:
- stock: a fresh stock engine warms up on an unrelated prompt (so both sides
  pay the same first-step costs), then runs the workload's prefill: its time
  is the batch's time to first token (TTFT), its uncached tokens the prefill
  work;
- kvelastic: an engine runs the workload twice (the second run's hit rate is
  the "before" figure) and is killed with SIGKILL; a new engine of the same
  model warms up likewise and runs the workload's prefill.
The baseline is the stock cold restart; ``ttft_speedup`` is cold / warm.
"""

from __future__ import annotations

import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any


class EngineLife:
    """One engine process (``python -m kvelastic_tools.vllm_bench.warm_run``)."""

    def __init__(self, model: pathlib.Path, socket: str | None, engine_id: str = "warm") -> None:
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "KVELASTIC_ENABLE": "0"}
        if socket is not None:
            env.update(KVELASTIC_ENABLE="1", KVELASTIC_SOCKET=socket, KVELASTIC_ENGINE_ID=engine_id)
        self.proc = subprocess.Popen([sys.executable, "-m", "kvelastic_tools.vllm_bench.warm_run", str(model)], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True)
        self._read("READY")

    def _read(self, prefix: str) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line[len(prefix):].strip()
        raise RuntimeError(f"the engine exited with {self.proc.wait(60)}")

    def do(self, command: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return json.loads(self._read("RESULT "))

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(30)

    def exit(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(120)


def _first_after_restart(life: EngineLife) -> dict[str, Any]:
    life.do("unrelated")                 # warm-up: the same first-step costs on both sides
    first = life.do("first")
    return {"ttft_s": first["seconds"], "hit_tokens": first["hits"], "query_tokens": first["queries"],
            "prefill_tokens": first["queries"] - first["hits"],
            "hit_rate": first["hits"] / first["queries"] if first["queries"] else 0.0, "tokens": first["tokens"]}


def _kept_blocks(socket: str) -> int:
    from kvelastic.ctl import get_status

    status = get_status(socket)
    return 0 if status["engines"] else sum(o["blocks"] for o in status["orphans"])


def one_round(model: pathlib.Path, socket: str) -> dict[str, Any]:
    stock = EngineLife(model, None)
    cold = _first_after_restart(stock)
    stock.exit()

    before = EngineLife(model, socket)
    before.do("workload")
    repeat = before.do("workload")
    before.kill()
    deadline = time.monotonic() + 30
    while not _kept_blocks(socket):
        if time.monotonic() > deadline:
            raise RuntimeError("the daemon kept no cache of the killed engine")
        time.sleep(0.1)
    kept = _kept_blocks(socket)
    after = EngineLife(model, socket)
    warm = _first_after_restart(after)
    stats = after.do("stats")
    after.exit()
    return {"cold": cold, "warm": warm, "kept_blocks": kept, "adopted_blocks": stats["adopted_blocks"],
            "hit_rate_before_restart": repeat["hits"] / repeat["queries"] if repeat["queries"] else 0.0,
            "same_tokens": cold["tokens"] == warm["tokens"]}


def run(quick: bool = False) -> dict[str, Any]:
    from kvelastic_tools.vllm_bench.elastic import daemon
    from kvelastic_tools.vllm_bench.tinymodel import build_tiny_llama

    model = build_tiny_llama(pathlib.Path(tempfile.gettempdir()) / "kvelastic-tiny-llama")
    rounds = 1 if quick else 3
    results = []
    for _ in range(rounds):     # a daemon per round: each starts with no kept cache
        with tempfile.TemporaryDirectory(prefix="kvelastic-bench-warm-") as folder, \
                daemon(pathlib.Path(folder), 64 << 20) as (socket, _port, _log):
            results.append(one_round(model, socket))

    def median(side: str, key: str) -> float:
        return statistics.median(r[side][key] for r in results)

    cold_ttft, warm_ttft = median("cold", "ttft_s"), median("warm", "ttft_s")
    return {
        "benchmark": "warm",
        "rounds": rounds,
        "workload": "6 prompts sharing a 1,600-token system prompt, 16 greedy tokens each, tiny Llama, vLLM CPU build",
        "baseline": "stock vLLM restarted (its prefix cache gone)",
        "ttft_cold_ms": round(cold_ttft * 1e3, 2),
        "ttft_warm_ms": round(warm_ttft * 1e3, 2),
        "ttft_speedup": round(cold_ttft / warm_ttft, 2) if warm_ttft else None,
        "prefill_tokens_cold": median("cold", "prefill_tokens"),
        "prefill_tokens_warm": median("warm", "prefill_tokens"),
        "prefill_ratio": round(median("warm", "prefill_tokens") / max(1.0, median("cold", "prefill_tokens")), 4),
        "hit_rate_cold": round(median("cold", "hit_rate"), 4),
        "hit_rate_warm": round(median("warm", "hit_rate"), 4),
        "hit_rate_before_restart": round(statistics.median(r["hit_rate_before_restart"] for r in results), 4),
        "kept_blocks": [r["kept_blocks"] for r in results],
        "adopted_blocks": [r["adopted_blocks"] for r in results],
        "same_tokens": all(r["same_tokens"] for r in results),
    }
