"""`vllm serve` on the tiny model, on loopback: health, completions, /metrics, bench.

    /tmp/vllm-venv/bin/python tests/vllm/serve_smoke.py [MODEL_DIR] [--bench]

Starts the server in its own process group, waits for /health, sends the
same long prompt twice, checks the prefix-cache counters moved, optionally
runs `vllm bench serve --dataset-name prefix_repetition` against it, and
always kills the whole process group (API server, EngineCore, worker).
Everything is bounded in time; traffic goes to 127.0.0.1 only.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

HERE = pathlib.Path(__file__).resolve().parent
ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_cmd(model: pathlib.Path, port: int) -> list[str]:
    return [
        sys.executable, str(HERE / "vllm_cli.py"), "serve", str(model),
        "--host", "127.0.0.1", "--port", str(port),
        "--served-model-name", "tiny",
        "--dtype", "float32", "--max-model-len", "1024", "--enforce-eager",
        "--enable-prefix-caching", "--block-size", "32", "--max-num-seqs", "8",
        "--kv-cache-memory-bytes", "64M",
    ]


def bench_cmd(model: pathlib.Path, port: int) -> list[str]:
    return [
        sys.executable, str(HERE / "vllm_cli.py"), "bench", "serve",
        "--backend", "vllm", "--base-url", f"http://127.0.0.1:{port}",
        "--model", "tiny", "--tokenizer", str(model),
        "--dataset-name", "prefix_repetition",
        "--prefix-repetition-prefix-len", "256", "--prefix-repetition-suffix-len", "32",
        "--prefix-repetition-num-prefixes", "4", "--prefix-repetition-output-len", "16",
        "--num-prompts", "32", "--max-concurrency", "4", "--request-rate", "inf",
        "--temperature", "0", "--ignore-eos", "--seed", "0",
    ]


def get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def post(url: str, body: dict, timeout: float = 60.0) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def counter(metrics: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} ([0-9.e+]+)$", metrics, re.M)
    return float(m.group(1)) if m else float("nan")


def main() -> int:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    sys.path.insert(0, str(HERE.parents[1]))
    from tests.vllm.tinymodel import build_tiny_llama

    model = build_tiny_llama(pathlib.Path(args[0] if args else "/tmp/kvelastic-tiny-llama"))
    env = {**os.environ, **ENV}
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = open("/tmp/kvelastic-vllm-serve.log", "w")
    t0 = time.monotonic()
    proc = subprocess.Popen(server_cmd(model, port), env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        while True:
            if proc.poll() is not None:
                print("server exited early; see /tmp/kvelastic-vllm-serve.log")
                return 1
            if time.monotonic() - t0 > 180:
                print("server not ready in 180 s")
                return 1
            try:
                if get(base + "/health", 1.0) is not None:
                    break
            except OSError:
                time.sleep(0.5)
        ready_s = time.monotonic() - t0
        prompt = " ".join(str(i) for i in range(60))  # ~110 tokens: 3 full blocks of 32
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        texts = [post(base + "/v1/completions", body)["choices"][0]["text"] for _ in range(2)]
        metrics = get(base + "/metrics")
        q = counter(metrics, "vllm:prefix_cache_queries_total")
        h = counter(metrics, "vllm:prefix_cache_hits_total")
        print(json.dumps({"ready_s": round(ready_s, 1), "same_text": texts[0] == texts[1],
                          "prefix_cache_queries_total": q, "prefix_cache_hits_total": h}))
        rc = 0 if (texts[0] == texts[1] and h > 0) else 1
        if "--bench" in sys.argv:
            t = time.monotonic()
            b = subprocess.run(bench_cmd(model, port), env=env, capture_output=True, text=True, timeout=300)
            lines = [ln for ln in b.stdout.splitlines() if re.match(r"(Successful|Failed) requests|Benchmark duration|Mean TTFT", ln)]
            metrics = get(base + "/metrics")
            print(json.dumps({"bench_rc": b.returncode, "bench_s": round(time.monotonic() - t, 1), "summary": lines,
                              "hits_total": counter(metrics, "vllm:prefix_cache_hits_total"),
                              "queries_total": counter(metrics, "vllm:prefix_cache_queries_total")}))
            rc = rc or b.returncode
        return rc
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        log.close()


if __name__ == "__main__":
    sys.exit(main())
