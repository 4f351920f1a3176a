import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """The tiny random-weight Llama (``kvelastic_tools.vllm_bench.tinymodel``), built once a session."""
    pytest.importorskip("transformers")
    from kvelastic_tools.vllm_bench.tinymodel import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")
