"""The plugin's benchmarks, run as ``kvelastic bench vllm`` and ``kvelastic bench elastic``.

They live here, not in ``kvelastic.bench``, because they need vLLM and the
plugin; the plugin declares them (entry point group ``kvelastic.benchmarks``)
and ``kvelastic bench`` finds them there. ``tinymodel`` and ``vllm_serve`` are
their fixtures, which the vLLM tests share.
"""
