"""Data parallel through kvelastic: ``vllm serve --data-parallel-size 2``
starts an EngineCore per rank, and each is an engine of its own in the
daemon, of one namespace (hand-off and warm restarts across ranks), with
its own worker. Greedy completions equal stock vLLM's. Real vLLM (CPU
build), real daemon."""

import json

import pytest

pytest.importorskip("vllm")

from kvelastic_tools.vllm_bench.tinymodel import build_tiny_llama
from tests.daemon_proc import wait_for
from tests.vllm.forked import ForkedServer
from tests.vllm.run_engine import Stock

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
PROMPTS = [f"the cache block page {i} memory token prefix " * 6 for i in range(4)]


def test_each_data_parallel_rank_is_an_engine_and_tokens_equal_stock(tmp_path, daemon_factory):
    model = build_tiny_llama(tmp_path / "tiny-llama")
    stock = Stock(model)
    expected = stock.do("prompts " + json.dumps(PROMPTS))["tokens"]
    stock.exit()
    assert len({t for tokens in expected for t in tokens}) >= 8, "the model must give varied tokens"

    daemon = daemon_factory(memory="128MiB")
    server = ForkedServer(model, tmp_path / "dp.log", flags=["--data-parallel-size", "2"],
                        env={"KVELASTIC_ENABLE": "1", "KVELASTIC_SOCKET": daemon.socket,
                             "KVELASTIC_ENGINE_ID": "dp"}).start(timeout=300)
    try:
        engines = wait_for(lambda: {e["engine_id"]: e for e in daemon.status()["engines"]
                                    if len(daemon.status()["engines"]) == 2}, timeout=30,
                           what="both ranks registered")
        assert set(engines) == {"dp", "dp-dp1"}, engines
        assert len({e["namespace"] for e in engines.values()}) == 1      # one model: one namespace
        assert all(e["workers"] == 1 for e in engines.values())
        for _ in range(2):                                              # the front ends spread requests
            assert [server.token_ids(p) for p in PROMPTS] == expected
    finally:
        server.stop()
