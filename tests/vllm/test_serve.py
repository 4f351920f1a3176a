"""Two real `vllm serve` instances share one real daemon.

The daemon's budget (96 MiB) is less than the two would preallocate with
stock vLLM (64 MiB each). Memory moves to the loaded instance and comes back
when its load ends (cached blocks expire after KVELASTIC_PREFIX_CACHE_TTL,
idle slabs go back); `kvelastic status` and the daemon's /metrics show it per
engine. Killing an instance returns its memory; restarting the daemon does
not break the other one.
"""

import json
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("vllm")

from kvelastic_tools.vllm_bench.tinymodel import build_tiny_llama
from kvelastic_tools.vllm_bench.vllm_serve import counter
from tests.daemon.books import held
from tests.daemon_proc import DaemonProcess, MiB, wait_for
from tests.vllm.forked import ForkedServer

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")


def test_two_vllm_instances_share_one_daemon(tmp_path, tiny_model):
    daemon = DaemonProcess(tmp_path, memory="96MiB").start()
    servers = []
    try:
        def serve(engine_id):
            server = ForkedServer(tiny_model, tmp_path / f"{engine_id}.log", env={
                "KVELASTIC_ENABLE": "1", "KVELASTIC_SOCKET": daemon.socket, "KVELASTIC_ENGINE_ID": engine_id,
                "KVELASTIC_PREFIX_CACHE_TTL": "2s", "KVELASTIC_METRICS_PORT": "0"})
            servers.append(server)
            return server.start()

        a, b = serve("a"), serve("b")
        wait_for(lambda: held(daemon, "a") and held(daemon, "b"), timeout=30, what="both engines registered")
        idle_a = held(daemon, "a")
        assert a.complete("hello")["choices"][0]["text"] and b.complete("hello")["choices"][0]["text"]

        peak = {"a": 0, "b": 0, "total": 0}
        stop = threading.Event()

        def sample():
            while not stop.is_set():
                s = daemon.status()
                assert s["memory"]["held"] + s["memory"]["free"] <= s["budget_bytes"]
                for e in s["engines"]:
                    peak[e["engine_id"]] = max(peak[e["engine_id"]], e["held_bytes"])
                peak["total"] = max(peak["total"], s["memory"]["held"])
                stop.wait(0.05)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        # load a: 48 distinct 900-token prompts, 8 at a time -> far more KV than it held idle
        a.bench(["--dataset-name", "random", "--random-input-len", "900", "--random-output-len", "8"],
                num_prompts=48, concurrency=8)
        loaded_a = held(daemon, "a")
        assert peak["a"] >= idle_a + 8 * MiB, (idle_a, peak)
        assert held(daemon, "b") < peak["a"]
        # the load ended: a's cache expires (TTL 2 s), its idle slabs go back (grace 5 s)
        wait_for(lambda: held(daemon, "a") <= idle_a + 8 * MiB, timeout=30, what="a's memory returned")
        # now b is loaded and gets the memory
        b.bench(["--dataset-name", "random", "--random-input-len", "900", "--random-output-len", "8"],
                num_prompts=48, concurrency=8)
        assert peak["b"] >= loaded_a - 8 * MiB
        stop.set()
        sampler.join()

        status = json.loads(subprocess.run([sys.executable, "-m", "kvelastic", "status", "--json"], env=daemon.env,
                                           capture_output=True, text=True, check=True).stdout)
        by_id = {e["engine_id"]: e for e in status["engines"]}
        assert set(by_id) == {"a", "b"} and by_id["a"]["grants"] > 2 and by_id["b"]["grants"] > 2
        assert by_id["a"]["returns"] > 0
        metrics = daemon.metrics()
        assert counter(metrics, 'kvelastic_slab_grants_total{device="0",engine="a"}') == by_id["a"]["grants"]
        assert counter(metrics, 'kvelastic_prefix_cache_queries_total{device="0",engine="b"}') > 0
        q, h = b.prefix_cache()
        assert q > 0

        # kill -9 of instance a (all its processes): its memory is back within 2 s
        a.kill()
        start = time.monotonic()
        wait_for(lambda: held(daemon, "a") is None, timeout=3, what="a's memory back")
        assert time.monotonic() - start < 2.0
        assert b.complete("still there")["choices"][0]["text"]

        # daemon kill -9 and restart: b keeps serving, then re-registers
        daemon.kill()
        before = b.complete("the daemon is gone")["choices"][0]["text"]
        daemon.stop()
        daemon = DaemonProcess(tmp_path, memory="96MiB").start()
        wait_for(lambda: held(daemon, "b"), timeout=20, what="b re-registered")
        assert b.complete("the daemon is gone")["choices"][0]["text"] == before
        b.bench(["--dataset-name", "random", "--random-input-len", "300", "--random-output-len", "8"],
                num_prompts=8, concurrency=4)
    finally:
        for server in servers:
            server.stop()
        daemon.stop()
