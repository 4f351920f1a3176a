"""Run a vLLM script with vLLM's engine processes forked, as vLLM starts
them on a GPU, instead of spawned, as its CPU build does.

    python -m tests.vllm.forked SCRIPT [ARGS...]
    python -m tests.vllm.forked -m MODULE [ARGS...]

Why: vLLM's CPU platform forces the ``spawn`` start method
(``CpuPlatform.check_and_update_config``), so each engine process, the
EngineCore and its worker, imports vLLM again: 13 s of a 16 s start of the
tiny model here, and most of the suite's time. On CUDA vLLM forks its
EngineCore (``VLLM_WORKER_MULTIPROC_METHOD`` defaults to ``fork``), so a
forked engine is the layout GPU users run: the same processes, sockets and
plugin hooks, only started by ``fork``. The tests that prove vLLM's CPU
defaults untouched (``test_default_layout.py``, the ``vllm serve`` tests,
``test_readme.py``) do not come through here."""

from __future__ import annotations

import os
import pathlib
import runpy
import sys

from kvelastic_tools.vllm_bench import quick_exit  # before vLLM: its handler runs after vLLM's
from kvelastic_tools.vllm_bench.vllm_serve import VllmServer

# `vllm` (the plugin's CLI) through this module: `vllm serve` with forked engine processes.
VLLM_FORKED = [sys.executable, "-m", "tests.vllm.forked", "-m", "kvelastic_vllm.cli"]


class ForkedServer(VllmServer):
    """``vllm serve`` whose engine processes are forked (``VLLM_FORKED``), its
    front end forked from this worker's fork server (``zygote.py``)."""

    def __init__(self, *args, **kwargs) -> None:
        from tests.vllm.zygote import launch  # it imports this module's main

        super().__init__(*args, command=VLLM_FORKED, popen=launch, **kwargs)


def fork_engine_processes() -> None:
    """After vLLM's CPU platform has set ``spawn``, set ``fork`` back."""
    from vllm.platforms import cpu

    original = cpu.CpuPlatform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config) -> None:
        original(cls, vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

    cpu.CpuPlatform.check_and_update_config = classmethod(check_and_update_config)


def main() -> None:
    fork_engine_processes()
    if sys.argv[1] == "-m":
        sys.argv = sys.argv[2:]
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
    else:
        script = pathlib.Path(sys.argv[1]).resolve()
        sys.argv = sys.argv[1:]
        sys.path.insert(0, str(script.parent))      # as `python SCRIPT` puts it first
        runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    try:
        main()
    except SystemExit as stop:   # `vllm serve` ends with sys.exit: status 0 is a normal end
        if stop.code not in (None, 0):
            raise
    quick_exit.finish()      # the script or server ended normally: no interpreter teardown (quick_exit.py)
