"""``weights_run.py`` in a process of its own, driven line by line: the
engine the weight, model and mode tests compare with stock vLLM.

An engine through kvelastic (``Engine``) runs in vLLM's default layout (the
EngineCore in a process of its own, as ``LLM()`` and every RL framework run
it), unless ``in_process``: only for a command that reads the engine's
objects (``warm-up``, ``poison``). Its engine processes are forked, as vLLM
starts them on a GPU (``forked.py``), unless ``forked=False``: spawned, as
vLLM's CPU build starts them (``test_default_layout.py``). A forked engine's
front end is itself forked from this worker's fork server (``zygote.py``),
which imported vLLM once, as is an engine in one process and the oracle;
an engine in vLLM's CPU layout (``forked=False``) is a fresh process. Stock vLLM, the oracle the tests compare
with (``Stock``), runs in one process per pytest worker that opens engines
one after another in-process: its tokens and hits are those of a fresh
process in any layout (each engine starts with an empty cache and the
checkpoint's weights), and vLLM's imports, most of a start on these CPUs,
are paid once a worker instead of once a comparison."""

from __future__ import annotations

import atexit
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import threading
from typing import IO

from tests.vllm.zygote import launch

SCRIPT = pathlib.Path(__file__).resolve().parent / "weights_run.py"


class Engine:
    """``weights_run.py`` in its own process, through the plugin and ``daemon``."""

    script: list[str] = [str(SCRIPT)]      # what the interpreter runs (a subclass may run another driver)

    def __init__(self, model, daemon, *args: str, in_process: bool = False, forked: bool = True,
                 **env: str) -> None:
        full = {**os.environ, **env, "VLLM_ENABLE_V1_MULTIPROCESSING": "0" if in_process else "1",
                "KVELASTIC_ENABLE": "1", "KVELASTIC_SOCKET": daemon.socket}
        starter = ["-m", "tests.vllm.forked"] if forked and not in_process else []
        start = launch if forked or in_process else subprocess.Popen    # vLLM's own start: a fresh process
        self.proc = start([sys.executable, *starter, *self.script, str(model), *args], env=full, text=True,
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self._read("READY")

    def _read(self, prefix: str) -> str:
        return _read(self.proc, prefix, self.proc.stderr.read)

    def do(self, command: str) -> dict:
        return _ask(self.proc, command, self.proc.stderr.read)

    def exit(self) -> None:
        self.proc.stdin.close()
        assert self.proc.wait(timeout=120) == 0, self.proc.stderr.read()[-4000:]


class Stock:
    """Stock vLLM over ``model`` with ``weights_run``'s ``flags``: an engine
    of this worker's oracle process (``weights_run.py --many``), with the
    interface of ``Engine``. ``exit`` shuts it down; an engine a failed test
    left open is shut down by the next ``Stock``.

    vLLM keeps some state per process across engines (each adds a prefix to
    its log lines; after a dozen engines one failed to start here, in the
    CPU worker's kernel-override binding), so an oracle serves
    ``_Oracle.ENGINES`` engines, and an engine that fails to start in a used
    oracle is started again in a fresh one: what a fresh process does is
    what stock vLLM does."""

    def __init__(self, model, *flags: str) -> None:
        self.oracle = _Oracle.get()
        try:
            self.oracle.open(str(model), flags)
        except AssertionError:
            if self.oracle.opened == 1:
                raise                            # a fresh oracle: stock vLLM itself fails
            self.oracle = _Oracle.get()
            self.oracle.open(str(model), flags)

    def do(self, command: str) -> dict:
        return self.oracle.ask(command)

    def exit(self) -> None:
        self.oracle.close()


class _Oracle:
    """The one ``weights_run.py --many`` process of this (pytest worker) process.
    Its log goes to a file: a pipe nobody reads would fill and stop it."""

    current: _Oracle | None = None
    ENGINES = 8                              # engines an oracle opens before a fresh one takes over

    @classmethod
    def get(cls) -> _Oracle:
        old = cls.current
        if old is None or old.proc.poll() is not None or old.opened >= cls.ENGINES:
            if old is not None:
                old.stop()
            cls.current = cls()
        return cls.current

    def __init__(self) -> None:
        self.log: IO[str] = tempfile.NamedTemporaryFile("w+", prefix="stock-oracle-", suffix=".log")
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "KVELASTIC_ENABLE": "0"}
        self.proc = launch([sys.executable, str(SCRIPT), "--many"], env=env, text=True,
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log)
        self.open_engine = False
        self.opened = 0
        _read(self.proc, "READY", self._log_tail)
        atexit.register(self.stop)

    def _log_tail(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def ask(self, command: str) -> dict:
        try:
            return _ask(self.proc, command, self._log_tail)
        except AssertionError:
            _Oracle.current = None               # the next Stock starts a fresh oracle
            raise

    def open(self, model: str, flags: tuple[str, ...]) -> None:
        if self.open_engine:
            self.close()
        self.opened += 1
        self.ask(" ".join(["open", model, *flags]))
        self.open_engine = True

    def close(self) -> None:
        self.open_engine = False
        self.ask("close")

    def stop(self) -> None:
        if self.log.closed:
            return
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


ANSWER_TIMEOUT = 600.0   # s: the longest start or command (a compiled engine on a loaded 2-core machine: ~150 s)


def _read(proc: subprocess.Popen, prefix: str, log) -> str:
    """The rest of the next line of ``proc``'s output that starts with ``prefix``.
    A process silent for ``ANSWER_TIMEOUT`` is killed: the read ends, and the test fails with its log."""
    watchdog = threading.Timer(ANSWER_TIMEOUT, proc.kill)
    watchdog.start()
    try:
        for line in proc.stdout:
            if line.startswith(prefix):
                return line[len(prefix):].strip()
    finally:
        watchdog.cancel()
    proc.wait(timeout=60)
    raise AssertionError(f"engine exited with {proc.returncode}:\n{log()[-4000:]}")


def _ask(proc: subprocess.Popen, command: str, log) -> dict:
    try:
        proc.stdin.write(command + "\n")
        proc.stdin.flush()
    except BrokenPipeError:
        proc.wait(timeout=60)
        raise AssertionError(f"engine exited with {proc.returncode}:\n{log()[-4000:]}") from None
    return json.loads(_read(proc, "RESULT ", log))
