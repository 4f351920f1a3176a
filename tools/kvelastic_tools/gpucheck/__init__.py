"""The GPU kit: one command that proves the CUDA path on a bare GPU machine.

GPU time comes rarely and without warning, and no CUDA code path of kvelastic
has run yet; this package turns the first minutes on a GPU into a report
instead of set-up. ``python -m kvelastic_tools.gpucheck`` (``make gpu-check``) runs:

1. the CUDA backend's tests (``pytests.part1``),
2. the daemon's flows with real processes on CUDA pages (``pytests.part2``),
3. KV correctness: paged attention over arena KV, bitwise (``kvcheck``,
   with ``kvpeer`` as its engine processes),
4. the CUDA figures beside kvcached's anchors (``cudabench``),

each under its own budget (``proc``), and writes the report (``report``).
``wheels`` makes pyzmq and msgspec importable offline. Without a GPU the same
command runs in host mode, which CI runs so the kit cannot rot.

Nothing here is imported by the daemon, the client or the vLLM plugin, and
importing this package imports nothing beyond the standard library.
"""
