"""The tiny test model: built offline, cached, and varied under greedy decoding.

Greedy decoding with plain transformers must give varied tokens, or output
equality tests between stock vLLM and kvelastic would prove nothing.
"""

from __future__ import annotations

import pathlib

import pytest

HERE = pathlib.Path(__file__).resolve().parent


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> pathlib.Path:
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from kvelastic_tools.vllm_bench.tinymodel import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")


def test_tiny_model_is_cached_and_varied(tiny_model):
    from kvelastic_tools.vllm_bench.tinymodel import build_tiny_llama, check_varied_greedy

    stamp = tiny_model / "kvelastic-tiny.json"
    mtime = stamp.stat().st_mtime_ns
    assert build_tiny_llama(tiny_model) == tiny_model
    assert stamp.stat().st_mtime_ns == mtime  # second call is a no-op
    check_varied_greedy(tiny_model)
