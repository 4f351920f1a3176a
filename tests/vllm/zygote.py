"""A fork server for the tests' vLLM front ends: vLLM imported once per
pytest worker, each front end forked from it.

    launch([sys.executable, "-m", "tests.vllm.forked", ...], env=..., stdout=...)

Why: a front end of the tiny model spends 11 to 14 s of CPU importing vLLM
and its API server before it reads its first argument, and the suite starts
about fifty of them through ``tests.vllm.forked`` on two cores. This server
(``python -m tests.vllm.zygote``, one per pytest worker, started on first
use) imports what ``forked.py`` would import, then waits; ``launch`` hands
it a command line, an environment and the three standard streams (file
descriptors over a Unix socket), and it forks a child that runs the command
exactly as ``forked.py`` does. The child is a real front end: its EngineCore
and workers are vLLM's own processes, started by vLLM, talking to a real
daemon. What a test observes differs from a fresh ``python`` in one thing:
modules were imported before the test's environment was set.

So a command is forked only when that cannot matter: its environment
differs from the server's in no variable read at import (``AT_IMPORT``:
the interpreter's, the OpenMP and BLAS runtimes', torch's, Hugging Face's,
CUDA's, vLLM's logging). The child's environment is the one asked for, so
everything read when used (the plugin's settings, vLLM's ``envs``, what
the processes it starts inherit) sees it; ``PYTHONPATH`` is applied to
``sys.path`` as Python's start would. A command whose environment differs
in a variable read at import runs as a plain subprocess (the server's log
says which and why), as does every command that is not a script, ``-c``
or ``forked.py``'s, and everything when ``KVELASTIC_TEST_ZYGOTE=0``. The
tests that prove vLLM's own start (``test_readme.py``, ``test_default_layout.py``,
the spawned engines) never come here.

``ForkedProcess`` has the part of ``subprocess.Popen`` the tests use (pid,
streams, poll, wait, signals). The child is the server's, not the test's:
the server reaps it and sends its exit status back on the launch's socket.
"""

from __future__ import annotations

import atexit
import importlib
import io
import json
import os
import pathlib
import runpy
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback

from kvelastic_tools.vllm_bench.vllm_serve import VLLM_ENV, wait_or_kill

FORKED = ["-m", "tests.vllm.forked"]
# Read at import (or at the process's start) by what the server imported:
# a child asking for another value of one of these runs as a plain process.
# Everything else is read when used: vLLM's ``envs`` module is lazy, the
# plugin reads its settings at registration, a library's later imports read
# theirs in the child (cv2's LD_LIBRARY_PATH, say, which it sets for its
# subprocesses, and which the child's os.environ passes on to them).
AT_IMPORT = ("PYTHON", "OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_", "TORCH", "PYTORCH_", "HF_", "HUGGINGFACE_",
             "TRANSFORMERS_", "CUDA_", "NVIDIA_", "LD_PRELOAD", "MALLOC_", "VLLM_LOGGING", "VLLM_CONFIGURE_LOGGING",
             "VLLM_PROCESS_NAME_PREFIX", "VLLM_TARGET_DEVICE")
ROOT = pathlib.Path(__file__).resolve().parents[2]
# What the server imports, in this order: quick_exit first, as forked.py imports
# it (its atexit handler must run after vLLM's), then what a front end imports.
PRELOAD = ("kvelastic_tools.vllm_bench.quick_exit", "kvelastic_vllm.cli", "vllm.entrypoints.cli.main",
           "vllm.entrypoints.llm", "vllm.entrypoints.openai.api_server", "tests.vllm.forked")


def _server_env() -> dict[str, str]:
    """The environment the server imports vLLM in: the worker's, with what
    every front end script sets before it imports vLLM (``VLLM_ENV``)."""
    return {**VLLM_ENV, **os.environ}


def _command(argv: list[str]) -> list[str] | None:
    """What the server runs for ``argv``: the interpreter's arguments, for
    ``python -m tests.vllm.forked ...``, ``python SCRIPT.py ...`` and
    ``python -c CODE ...``; None for anything else (another interpreter, options)."""
    if len(argv) < 2 or argv[0] != sys.executable:
        return None
    if argv[1:3] == FORKED and len(argv) > 3 or argv[1] == "-c" and len(argv) > 2 or argv[1].endswith(".py"):
        return argv[1:]
    return None


def _forkable(argv: list[str], env: dict[str, str], started: dict[str, str], imported: dict[str, str]) -> str | None:
    """Why ``argv`` under ``env`` cannot be forked from the server, or None.
    ``started``: the server's environment at its start; ``imported``: after its imports."""
    if _command(argv) is None:
        return "not a script, -c or forked.py command"
    for key in set(env) | set(imported):
        if env.get(key) == imported.get(key) or not key.startswith(AT_IMPORT):
            continue
        if key not in env and (key in VLLM_ENV or key not in started):
            continue              # set before or by the imports, as the command's own would set it
        if key in ("PYTHONPATH", "PYTHONUNBUFFERED"):
            continue              # the child applies them as Python's start would (_python_path, its streams)
        return f"{key} differs"
    return None


# ---- the client side (in the pytest worker) ----

class ForkedProcess:
    """A front end forked by the server: the ``subprocess.Popen`` calls the tests make."""

    def __init__(self, argv: list[str], conn: socket.socket, pid: int, stdin, stdout, stderr) -> None:
        self.args, self.pid, self.returncode = argv, pid, None
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self._conn, self._lock, self._buf = conn, threading.Lock(), b""

    def poll(self) -> int | None:
        return self._status(0.0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._status(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code

    def _status(self, timeout: float | None) -> int | None:
        with self._lock:
            deadline = None if timeout is None else time.monotonic() + timeout
            while self.returncode is None:
                if b"\n" in self._buf:
                    line, self._buf = self._buf.split(b"\n", 1)
                    if line.startswith(b"EXIT "):
                        self.returncode = int(line[5:])
                        self._conn.close()
                    continue
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                self._conn.settimeout(left)
                try:
                    data = self._conn.recv(4096)
                except (TimeoutError, BlockingIOError):
                    return None
                if not data:              # the server died: the child's status is lost with it
                    raise RuntimeError(f"the fork server ended before process {self.pid}; see {_client.log}")
                self._buf += data
            return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _Client:
    """This pytest worker's server: started on the first launch, ended at exit."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.folder = ""
        self._env: dict[str, str] | None = None

    @property
    def log(self) -> str:
        return f"{self.folder}/log"

    def env(self) -> dict[str, str]:
        """The server's environment once its imports ran (torch's set some variables)."""
        if self._env is None:
            self.connect().close()
            self._env = json.loads(pathlib.Path(self.folder, "env").read_text())
        return self._env

    def note(self, line: str) -> None:
        """A line in the server's log (which commands were not forked, and why)."""
        if self.folder:
            with open(self.log, "a") as log:
                log.write(line + "\n")

    def why_not(self, argv: list[str], env: dict[str, str]) -> str | None:
        """Why ``argv`` runs as a plain subprocess (``_forkable``), or None."""
        if os.environ.get("KVELASTIC_TEST_ZYGOTE", "1") == "0":
            return "KVELASTIC_TEST_ZYGOTE=0"
        if _command(argv) is None:
            return "not a script, -c or forked.py command"
        return _forkable(argv, env, _server_env(), self.env())

    def connect(self) -> socket.socket:
        if self.proc is None:
            self.folder = tempfile.mkdtemp(prefix="kvelastic-zygote-")
            with open(self.log, "wb") as log:
                self.proc = subprocess.Popen([sys.executable, "-m", "tests.vllm.zygote", self.folder], cwd=ROOT,
                                             env=_server_env(), stdin=subprocess.DEVNULL, stdout=log,
                                             stderr=subprocess.STDOUT, start_new_session=True)
            atexit.register(self.proc.kill)
        deadline = time.monotonic() + 300.0      # its imports: ~12 s quiet, minutes on a loaded machine
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the fork server exited with {self.proc.returncode}; see {self.log}")
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                conn.connect(f"{self.folder}/sock")
                return conn
            except (FileNotFoundError, ConnectionRefusedError):
                conn.close()
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the fork server did not listen in 300 s; see {self.log}") from None
                time.sleep(0.05)


_client = _Client()


def _stream(spec, std: int, read: bool, text: bool, opened: list[int]):
    """(the fd the child gets, the file the caller keeps or None) for a Popen stream argument."""
    if spec is None:
        return std, None
    if spec == subprocess.PIPE:
        r, w = os.pipe()
        child, mine = (r, w) if not read else (w, r)
        opened.append(child)
        mode = ("r" if read else "w") + ("" if text else "b")
        return child, open(mine, mode, **({"encoding": "utf-8", "errors": "strict"} if text else {}),
                           **({"buffering": 1} if text and not read else {}))
    if spec == subprocess.DEVNULL:
        fd = os.open(os.devnull, os.O_RDWR)
        opened.append(fd)
        return fd, None
    return (spec if isinstance(spec, int) else spec.fileno()), None


def launch(argv: list[str], *, env: dict[str, str], stdin=None, stdout=None, stderr=None, text: bool = False,
           start_new_session: bool = False):
    """``subprocess.Popen(argv, env=env, ...)``, forked from the server when
    that cannot change what the command does (``_forkable``)."""
    popen = {"env": env, "stdin": stdin, "stdout": stdout, "stderr": stderr, "text": text,
             "start_new_session": start_new_session}
    why = _client.why_not(argv, env)
    if why:
        _client.note(f"plain subprocess ({why}): {' '.join(argv)[:200]}")
        return subprocess.Popen(argv, **popen)
    opened: list[int] = []
    try:
        fd0, in_file = _stream(stdin, 0, False, text, opened)
        fd1, out_file = _stream(stdout, 1, True, text, opened)
        fd2, err_file = ((fd1, None) if stderr == subprocess.STDOUT else _stream(stderr, 2, True, text, opened))
        conn = _client.connect()
        request = json.dumps({"argv": _command(argv), "env": env, "cwd": os.getcwd(),
                              "new_session": start_new_session}).encode()
        socket.send_fds(conn, [len(request).to_bytes(4, "big") + request], [fd0, fd1, fd2])
    finally:
        for fd in opened:
            os.close(fd)
    reply = b""
    while b"\n" not in reply:
        data = conn.recv(64)
        if not data:
            raise RuntimeError(f"the fork server refused {argv}; see {_client.log}")
        reply += data
    line, rest = reply.split(b"\n", 1)
    proc = ForkedProcess(argv, conn, int(line.removeprefix(b"PID ")), in_file, out_file, err_file)
    proc._buf = rest
    return proc


def run(argv: list[str], *, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """``subprocess.run(argv, env=env, timeout=timeout, capture_output=True,
    text=True)`` through ``launch``: a finished command's output and status;
    one still running at ``timeout`` is killed and ``TimeoutExpired`` raised."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:   # files: no pipe to fill
        code = wait_or_kill(launch(argv, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err), timeout)
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(argv, code, out.read(), err.read())


# ---- the server side ----

def _serve(folder: str) -> None:
    for module in PRELOAD:
        importlib.import_module(module)
    parent = os.getppid()
    pathlib.Path(folder, "env").write_text(json.dumps(dict(os.environ)))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(f"{folder}/sock")
    listener.listen(16)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: dict[int, socket.socket] = {}
    events = selectors.DefaultSelector()
    events.register(listener, selectors.EVENT_READ)
    events.register(wake_r, selectors.EVENT_READ)
    print(f"fork server {os.getpid()} ready in {folder}", flush=True)
    while os.getppid() == parent:        # the pytest worker is gone: so is its server
        for key, _ in events.select(timeout=1.0):
            if key.fileobj is listener:
                conn, _ = listener.accept()
                pid = _fork(conn, [listener, events, *children.values()], [wake_r, wake_w])
                if pid is None:           # a readiness probe, or a launcher that died mid-request
                    conn.close()
                    continue
                children[pid] = conn
                conn.sendall(f"PID {pid}\n".encode())
            else:
                os.read(wake_r, 4096)
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(f"EXIT {os.waitstatus_to_exitcode(status)}\n".encode())
                except OSError:
                    pass          # the test that launched it is gone
                conn.close()


def _fork(conn: socket.socket, server_files: list, server_fds: list[int]) -> int | None:
    """Receive one launch on ``conn`` and fork its child, which closes the
    server's files (a sibling's socket held open would hide the server's end
    from that sibling's launcher) and never returns."""
    head, fds, _, _ = socket.recv_fds(conn, 4, 3)
    size = int.from_bytes(head, "big") if len(head) == 4 and len(fds) == 3 else 0
    body = b""
    while len(body) < size:
        data = conn.recv(size - len(body))
        if not data:
            break
        body += data
    if not size or len(body) < size:
        for fd in fds:
            os.close(fd)
        return None
    request = json.loads(body)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        for fd in fds:
            os.close(fd)
        return pid
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for f in (*server_files, conn):
            f.close()
        for fd in server_fds:
            os.close(fd)
        if request["new_session"]:
            os.setsid()
        for std, fd in enumerate(fds):
            os.dup2(fd, std)
        for fd in set(fds):
            if fd > 2:
                os.close(fd)
        os.chdir(request["cwd"])
        _python_path(os.environ.get("PYTHONPATH", ""), request["env"].get("PYTHONPATH", ""))
        os.environ.clear()
        os.environ.update(request["env"])
        if os.environ.get("PYTHONUNBUFFERED"):
            for stream in (sys.stdout, sys.stderr):
                if isinstance(stream, io.TextIOWrapper):
                    stream.reconfigure(write_through=True)
        code = _run(request["argv"])
    finally:
        os._exit(code)


def _python_path(old: str, new: str) -> None:
    """``sys.path`` as Python's start would have made it under ``PYTHONPATH=new``
    rather than ``old``: its entries right after the script's folder."""
    def entries(value: str) -> list[str]:
        return [os.path.abspath(e) for e in value.split(os.pathsep) if e]

    if entries(old) == entries(new):
        return
    for entry in entries(old):
        if entry in sys.path:
            sys.path.remove(entry)
    sys.path[1:1] = entries(new)


def _run(argv: list[str]) -> int:
    """The interpreter's arguments ``argv`` as ``python`` runs them, and the
    end of an interpreter: non-daemon threads joined, ``atexit`` run
    (quick_exit's handler ends a finished script there), streams flushed.
    ``forked.py`` as its ``__main__`` (engine processes forked, a normal end
    without teardown); a script or ``-c`` with ``sys.path[0]`` as Python sets it."""
    from kvelastic_tools.vllm_bench import quick_exit
    from tests.vllm import forked

    code = 0
    try:
        try:
            if argv[:2] == FORKED:
                sys.path[0] = os.getcwd()            # as `python -m` sets it
                forked.fork_engine_processes()
                sys.argv = ["forked.py", *argv[2:]]
                forked.main()
            elif argv[0] == "-c":
                sys.path[0] = ""
                sys.argv = ["-c", *argv[2:]]
                exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
            else:
                sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
                sys.argv = list(argv)
                runpy.run_path(argv[0], run_name="__main__")
        except SystemExit as stop:      # as forked.py's `__main__`: status 0 is a normal end
            if stop.code not in (None, 0) or argv[:2] != FORKED:
                raise
        if argv[:2] == FORKED:
            quick_exit.finish()
    except SystemExit as stop:
        code = 0 if stop.code is None else stop.code if isinstance(stop.code, int) else 1
        if not isinstance(stop.code, int) and stop.code is not None:
            print(stop.code, file=sys.stderr)          # sys.exit("message"), as Python prints it
    except BaseException:  # noqa: BLE001 - as the interpreter: the traceback on stderr, status 1
        traceback.print_exc()
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    return code


if __name__ == "__main__":
    _serve(sys.argv[1])
