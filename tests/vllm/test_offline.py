"""Greedy outputs through kvelastic are token-identical to stock vLLM, and vLLM's
own prefix-cache counters see the same hits."""

import json
import os
import pathlib
import sys

import pytest

from tests.vllm import zygote

pytest.importorskip("vllm")

from kvelastic_tools.vllm_bench.tinymodel import build_tiny_llama

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
HERE = pathlib.Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")


def run(model, **env):
    # One process (EngineCore and worker in the caller) keeps the run short.
    full_env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **env}
    out = zygote.run([sys.executable, str(HERE / "offline_run.py"), str(model)], env=full_env, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def test_greedy_outputs_and_hits_match_stock_vllm(daemon_factory, tiny_model):
    daemon = daemon_factory(memory="256MiB")
    stock = run(tiny_model)
    elastic = run(tiny_model, KVELASTIC_ENABLE="1", KVELASTIC_SOCKET=daemon.socket, KVELASTIC_ENGINE_ID="offline")
    cold = stock["cold"]["tokens"]
    # the model is varied enough that equality means something
    assert all(len(set(t)) >= 8 for t in cold) and len({tuple(t) for t in cold}) == len(cold)
    for phase in ("cold", "warm", "reset"):
        assert elastic[phase]["tokens"] == stock[phase]["tokens"] == cold    # hit or miss: same tokens
        assert (elastic[phase]["queries"], elastic[phase]["hits"]) == \
            (stock[phase]["queries"], stock[phase]["hits"])                  # same hit rate as stock
    assert elastic["warm"]["hits"] > elastic["cold"]["hits"] > 0             # the warm run hits the cache
    assert elastic["reset"]["hits"] < elastic["warm"]["hits"]                # after a reset it misses
    engines = {e["engine_id"]: e for e in daemon.status()["engines"]}
    assert "offline" not in engines                                          # the engine left, memory back
    assert daemon.status()["memory"]["held"] == 0


def test_no_daemon_stops_vllm_with_a_clear_message(tmp_path, tiny_model):
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "KVELASTIC_ENABLE": "1",
           "KVELASTIC_SOCKET": str(tmp_path / "nobody-home.sock")}
    out = zygote.run([sys.executable, str(HERE / "offline_run.py"), str(tiny_model)], env=env, timeout=300)
    assert out.returncode != 0
    assert f"no kvelastic daemon answered on {tmp_path / 'nobody-home.sock'}" in out.stderr
