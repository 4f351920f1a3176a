"""``weights_run.py`` in a process of its own, driven line by line: the
engine the weight, model and mode tests compare with stock vLLM.

An engine through kvelastic runs in vLLM's default layout (the EngineCore in
a process of its own, as ``LLM()`` and every RL framework run it), unless
``in_process``: only for a command that reads the engine's objects
(``warm-up``, ``poison``). Stock vLLM, the oracle the tests compare with,
runs in-process unless told otherwise: its tokens and hits are the same in
either layout, and it starts in half the time (one process, not three)."""

import json
import os
import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parent / "weights_run.py"


class Engine:
    """``weights_run.py`` in its own process: stock vLLM, or through the plugin with ``daemon``."""

    script: list[str] = [str(SCRIPT)]      # what the interpreter runs (a subclass may run another driver)

    def __init__(self, model, daemon=None, *args: str, in_process: bool | None = None, **env: str) -> None:
        if in_process is None:
            in_process = daemon is None          # stock in-process, kvelastic in vLLM's default layout
        full = {**os.environ, **env, "VLLM_ENABLE_V1_MULTIPROCESSING": "0" if in_process else "1"}
        if daemon is not None:
            full.update(KVELASTIC_ENABLE="1", KVELASTIC_SOCKET=daemon.socket)
        else:
            full["KVELASTIC_ENABLE"] = "0"
        self.proc = subprocess.Popen([sys.executable, *self.script, str(model), *args], env=full, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self._read("READY")

    def _read(self, prefix: str) -> str:
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line[len(prefix):].strip()
        self.proc.wait(timeout=60)
        raise AssertionError(f"engine exited with {self.proc.returncode}:\n{self.proc.stderr.read()[-4000:]}")

    def do(self, command: str) -> dict:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return json.loads(self._read("RESULT "))

    def exit(self) -> None:
        self.proc.stdin.close()
        assert self.proc.wait(timeout=120) == 0, self.proc.stderr.read()[-4000:]
