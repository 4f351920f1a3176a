import os
import pathlib

import pytest

from tests.daemon_proc import DaemonProcess

# The suite's daemons start no keeper of their own (each would outlive its
# test by KVELASTIC_KEEPER_LINGER); a test of a keeper starts one, and
# tests/daemon/test_started_keeper.py sets "auto", the default users get.
os.environ.setdefault("KVELASTIC_KEEPER", "external")


@pytest.fixture(autouse=True)
def _environment_restored():
    """``os.environ`` as it was before each test: what a test, or vLLM run
    in its process (its CPU platform sets variables of torch's and its own),
    sets there never reaches the next test's processes (the fork server,
    tests/vllm/zygote.py, forks only for an environment like its own)."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture
def daemon(tmp_path):
    """A running daemon (host backend, 64 MiB budget, metrics on a free port)."""
    proc = DaemonProcess(tmp_path).start()
    yield proc
    proc.stop()


@pytest.fixture
def daemon_factory(tmp_path):
    """Start daemons with custom settings: ``daemon_factory(memory="32MiB")``."""
    started = []

    def make(**kw):
        proc = DaemonProcess(tmp_path, **kw).start()
        started.append(proc)
        return proc

    yield make
    for proc in started:
        proc.stop()


# Two real vLLM runs through the plugin (tests/vllm/settings_run.py), shared by
# the settings walk (tests/daemon/test_settings.py) and the namespace identity
# tests (tests/vllm/test_identity.py). Each reports the engine's entry of the
# daemon's status, read while it is registered, and vLLM's block-hash root.
# "plain" sets only what is needed to use kvelastic (and a prefix-cache size
# limit of nothing); "tuned" sets every other plugin setting.
PLUGIN_TUNED = {"KVELASTIC_ENGINE_ID": "tuned-engine", "KVELASTIC_ENGINE_MIN_MEMORY": "4MiB",
                "KVELASTIC_ENGINE_MAX_MEMORY": "40MiB", "KVELASTIC_TENANT_SALT": "tenant-a",
                "KVELASTIC_PREFIX_CACHE_TTL": "1s", "KVELASTIC_PRIVATE_CACHE": "1",
                "KVELASTIC_WORKER_DEVICES": "1"}     # the daemon has two host devices
PLUGIN_PLAIN = {"KVELASTIC_PREFIX_CACHE_MAX_SIZE": "1"}     # one byte: no block may stay cached


@pytest.fixture(scope="session")
def plugin_runs(tmp_path_factory, worker_id) -> dict:
    """``{"plain"|"tuned": {"engine": status entry, "none_hash": hex}, "hash_secret": bytes,
    "model": path}``. Once a session: under pytest-xdist the first worker that
    needs them runs them and the others read its results (a file lock)."""
    pytest.importorskip("vllm")
    import json

    from filelock import FileLock

    if worker_id == "master":
        return _plugin_runs(tmp_path_factory.mktemp("plugin"))
    shared = tmp_path_factory.getbasetemp().parent           # one folder for all workers of this session
    with FileLock(str(shared / "plugin-runs.lock")):
        saved = shared / "plugin-runs.json"
        if not saved.is_file():
            runs = _plugin_runs(shared / "plugin")
            saved.write_text(json.dumps({**runs, "model": str(runs["model"]),
                                         "hash_secret": runs["hash_secret"].hex()}))
    runs = json.loads(saved.read_text())
    return {**runs, "model": pathlib.Path(runs["model"]), "hash_secret": bytes.fromhex(runs["hash_secret"])}


def _plugin_runs(tmp: pathlib.Path) -> dict:
    import json
    import os
    import sys

    from kvelastic_tools.vllm_bench.tinymodel import build_tiny_llama
    from tests.vllm import zygote

    tmp.mkdir(parents=True, exist_ok=True)
    model = build_tiny_llama(tmp / "tiny-llama")
    daemon = DaemonProcess(tmp, memory="256MiB", KVELASTIC_HOST_DEVICES="2").start()
    script = pathlib.Path(__file__).resolve().parent / "vllm" / "settings_run.py"
    runs: dict = {"model": model}
    try:
        for name, env in (("plain", PLUGIN_PLAIN), ("tuned", PLUGIN_TUNED)):
            full = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "KVELASTIC_ENABLE": "1",
                    "KVELASTIC_SOCKET": daemon.socket, **env}
            out = zygote.run([sys.executable, str(script), str(model), daemon.socket], env=full, timeout=300)
            assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
            runs[name] = json.loads(next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT "))[7:])
        with open(daemon.socket + ".hash-secret", "rb") as f:
            runs["hash_secret"] = f.read()
    finally:
        daemon.stop()
    return runs


# The slowest folders first (real vLLM engines, routers): under pytest-xdist
# the short tests then fill the workers' gaps at the end instead of one long
# engine test running alone last. A stable sort: each module stays together.
SLOW_FIRST = ("tests/vllm/", "tests/routing/", "tests/observability/")


def pytest_collection_modifyitems(items):
    def rank(item) -> int:
        return next((i for i, folder in enumerate(SLOW_FIRST) if item.nodeid.startswith(folder)), len(SLOW_FIRST))

    items.sort(key=rank)
