"""The vLLM benchmarks: ``kvelastic bench vllm``, ``elastic``, ``warm`` and ``route``.

They live apart from ``kvelastic_tools.bench`` because they need vLLM and the
plugin; ``tools/pyproject.toml`` declares them (entry point group
``kvelastic.benchmarks``) and ``kvelastic bench`` finds them there.
``tinymodel`` and ``vllm_serve`` are their fixtures, which the vLLM tests share.
"""
