"""The tests' scripts (``offline_run.py``, ``settings_run.py``,
``replica_run.py``) start vLLM as the benches do: ``offline_llm``."""

from kvelastic_tools.vllm_bench.tinymodel import offline_llm as tiny_llm

__all__ = ["tiny_llm"]
