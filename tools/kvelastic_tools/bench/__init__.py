"""Benchmarks of the daemon and its parts: ``kvelastic bench NAME --json``.

Each module named here exposes ``run(quick: bool) -> dict``; the dict holds
the figures, the baseline measured in the same run, and their ratio. The CLI
finds them through the entry points ``tools/pyproject.toml`` declares
(``kvelastic.benchmarks``) and prints the dict as one JSON object on the
last line of output. The vLLM benchmarks are ``kvelastic_tools.vllm_bench``.
"""
