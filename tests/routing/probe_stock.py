"""Prototype (a script, not a test): a stock vLLM engine's own KV event
publisher, indexed by Dynamo's standalone indexer. Usage:
python -m tests.routing.probe_stock [kvelastic]"""

from __future__ import annotations

import json
import pathlib
import random
import sys
import tempfile
import time

from kvelastic_tools.vllm_bench.dynamo_indexer import DynamoIndexer
from kvelastic_tools.vllm_bench.kv_events import Subscriber, dump_hashes, wait_for
from kvelastic_tools.vllm_bench.tinymodel import build_tiny_llama
from kvelastic_tools.vllm_bench.vllm_serve import VllmServer

BLOCK = 32


def main() -> None:
    use_kvelastic = len(sys.argv) > 1 and sys.argv[1] == "kvelastic"
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="kvr-", dir="/tmp"))
    model = build_tiny_llama(pathlib.Path("/tmp/kvr-model/tiny-llama"))
    ix = DynamoIndexer(tmp / "indexer.log").start()
    endpoint, replay = f"ipc://{tmp}/ev.sock", f"ipc://{tmp}/ev-replay.sock"
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint,
           "replay_endpoint": replay, "topic": "kv"}
    env = {"KVELASTIC_ENABLE": "0"}
    daemon = None
    if use_kvelastic:
        from tests.daemon_proc import DaemonProcess
        daemon = DaemonProcess(tmp, memory="64MiB").start()
        env = {"KVELASTIC_ENABLE": "1", "KVELASTIC_SOCKET": daemon.socket, "KVELASTIC_ENGINE_ID": "e1",
               "KVELASTIC_METRICS_PORT": "0"}
    server = VllmServer(model, tmp / "vllm.log", env=env, flags=["--kv-events-config", json.dumps(cfg)])
    t0 = time.monotonic()
    server.start()
    print(f"vllm up in {time.monotonic() - t0:.1f} s", flush=True)
    sub = Subscriber(endpoint)
    try:
        ix.register(1, endpoint, "tiny", BLOCK, replay)
        rng = random.Random(7)
        tok = lambda n: [rng.randrange(3, 500) for _ in range(n)]  # noqa: E731
        a = tok(64)
        prompts = [a + tok(40), a + tok(40), tok(100)]
        for pr in prompts:
            server.complete(pr, max_tokens=4)  # type: ignore[arg-type]
        try:
            wait_for(lambda: sub.hashes() and dump_hashes(ix.dump(), "tiny", 1) == sub.hashes(), 30,
                     "indexer == vLLM events")
        except AssertionError:
            print("MISMATCH sub", sub.snapshot().counts, sorted(sub.hashes()))
            print("MISMATCH dump", json.dumps(ix.dump())[:3000])
            raise
        print("vLLM event counts", sub.snapshot().counts, "cached", len(sub.hashes()))
        print("dump == vLLM events:", dump_hashes(ix.dump(), "tiny", 1) == sub.hashes())
        for name, q in [("A+z", a + tok(40)), ("p0", prompts[0]), ("p2", prompts[2]), ("new", tok(100))]:
            print(name, ix.query("tiny", q))
        q0, h0 = server.prefix_cache()
        probe = a + tok(50)
        predicted = ix.query("tiny", probe).get(1, 0)
        server.complete(probe, max_tokens=1)  # type: ignore[arg-type]
        q1, h1 = server.prefix_cache()
        print("predicted", predicted, "vLLM hit tokens", h1 - h0, "queried", q1 - q0)
        if daemon is not None:
            print(json.dumps(daemon.status()["engines"][0])[:600])
    finally:
        sub.close()
        server.stop()
        ix.stop()
        if daemon is not None:
            daemon.stop()
        print("logs in", tmp)


if __name__ == "__main__":
    main()
