"""LoRA adapters loaded and unloaded at run time through the server's own
endpoints (``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``, with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``), as an operator does with ``vllm
serve``: a real server through the plugin and a real daemon. An adapter
unloaded, retrained into the same folder and loaded again under the same
name must give the new adapter's tokens (stock vLLM's, from a fresh engine),
never blocks of the old one: the plugin keys LoRA blocks by the adapter's
content and forgets a fingerprint when vLLM removes the adapter."""

import pytest

pytest.importorskip("vllm")

from kvelastic_tools.vllm_bench.vllm_serve import VllmServer
from kvelastic_tools.vllm_bench.warm_run import QUESTIONS, SYSTEM
from tests.daemon_proc import DaemonProcess
from tests.vllm.adapters import write_adapter
from tests.vllm.run_engine import Stock

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
# The workload's prompts reach 1,620 tokens: the server takes 2,048, as weights_run.py's engine.
LORA_FLAGS = ["--enable-lora", "--max-lora-rank", "16", "--max-loras", "2", "--max-model-len", "2048"]


def completions(server: VllmServer, model: str) -> list[list[int]]:
    """The workload of ``weights_run.py`` (greedy, 16 tokens each), through the server."""
    return [server.token_ids(SYSTEM + question, model=model) for question in QUESTIONS]


def test_adapters_loaded_and_unloaded_through_the_server(tmp_path, tiny_model):
    adapter = write_adapter(tmp_path / "adapter", tiny_model, seed=1)
    expected = {}
    for seed in (1, 2):
        write_adapter(adapter, tiny_model, seed=seed)
        stock = Stock(tiny_model, "--lora")
        expected[seed] = stock.do(f"lora a {adapter}")["tokens"]
        stock.exit()
    assert expected[1] != expected[2]

    write_adapter(adapter, tiny_model, seed=1)
    daemon = DaemonProcess(tmp_path, memory="96MiB").start()
    server = VllmServer(tiny_model, tmp_path / "serve.log", flags=LORA_FLAGS, env={
        "KVELASTIC_ENABLE": "1", "KVELASTIC_SOCKET": daemon.socket, "KVELASTIC_ENGINE_ID": "lora-server",
        "KVELASTIC_METRICS_PORT": "0", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    try:
        server.start()
        server.post("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": str(adapter)})
        assert completions(server, "a") == expected[1]
        assert completions(server, "a") == expected[1]          # again, now from its own cache
        server.post("/v1/unload_lora_adapter", {"lora_name": "a"})
        write_adapter(adapter, tiny_model, seed=2)               # retrained, into the same folder
        server.post("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": str(adapter)})
        assert completions(server, "a") == expected[2], "blocks of the unloaded adapter served the new one"
        entry = next(e for e in daemon.status()["engines"] if e["engine_id"] == "lora-server")
        assert entry["slabs"] >= 1
    finally:
        server.stop()
        daemon.stop()
