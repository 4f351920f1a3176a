"""kvelastic's tools: what develops and proves the runtime, never what a node
runs. ``bench`` (``kvelastic bench NAME``), ``sim`` (the node simulator),
``fuzz`` (the hostile-tenant fuzzer), ``gpucheck`` (``make gpu-check``) and
``vllm_bench`` (vLLM benchmarks and the tiny models and servers the tests
start). The runtime packages never import this one."""
