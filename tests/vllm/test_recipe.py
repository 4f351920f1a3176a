"""The vLLM test recipe itself: tiny model, offline engine, vllm serve.

Skipped where transformers / vllm are not installed (the plain project venv).
Run with the vLLM venv:  /tmp/vllm-venv/bin/python -m pytest tests/vllm -m vllm
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> pathlib.Path:
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from tests.vllm.tinymodel import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")


def test_tiny_model_is_cached_and_varied(tiny_model):
    from tests.vllm.tinymodel import assert_varied_greedy, build_tiny_llama

    stamp = tiny_model / "kvelastic-tiny.json"
    mtime = stamp.stat().st_mtime_ns
    assert build_tiny_llama(tiny_model) == tiny_model
    assert stamp.stat().st_mtime_ns == mtime  # second call is a no-op
    assert_varied_greedy(tiny_model)


@pytest.mark.vllm
@pytest.mark.slow
def test_offline_llm_prefix_cache_inprocess(tiny_model):
    pytest.importorskip("vllm")
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    p = subprocess.run([sys.executable, str(HERE / "run_offline.py"), str(tiny_model)],
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    lines = [json.loads(ln) for ln in p.stdout.splitlines() if ln.startswith("{")]
    assert any(d.get("hf_match") for d in lines)
