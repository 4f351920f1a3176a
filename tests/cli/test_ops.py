"""``kvelastic status|top|limit|invalidate`` against a real daemon and real engines."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from kvelastic import ctl
from kvelastic.client.connection import DaemonError, DaemonUnavailable
from kvelastic.client.engine import EngineClient
from kvelastic.client.worker import WorkerClient
from kvelastic.core.pool import SlabPool
from kvelastic.vmm import get_backend
from tests.daemon_proc import wait_for

MiB = 1 << 20
PAGE = 2 * MiB
NO_DAEMON = "no daemon is running on"


def kvelastic(env, *args, timeout=20):
    return subprocess.run([sys.executable, "-m", "kvelastic", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


@pytest.fixture
def engine(daemon):
    """Engine ``e1`` in namespace ``m1`` with one in-process worker mapping host
    pages, holding two 2 MiB slabs of 8 blocks."""
    pool = SlabPool(8)
    eng = EngineClient(pool, socket_path=daemon.socket, engine_id="e1", namespace="m1", page_size=PAGE,
                       pages_per_worker=1, num_workers=1, block_bytes=PAGE // 8,
                       low_watermark=0, shrink_grace=60).start()   # no prefetch, no return: exact counts
    worker = WorkerClient(get_backend("host"), socket_path=daemon.socket, engine_id="e1", rank=0,
                          token=eng.token).start()
    try:
        assert eng.ensure(16)
        yield eng
    finally:
        eng.close()
        worker.close()


def engine_status(daemon, engine_id="e1"):
    return next(e for e in daemon.status()["engines"] if e["engine_id"] == engine_id)


def test_status_json_matches_what_the_engine_did(daemon, engine):
    result = kvelastic(daemon.env, "status", "--json")
    assert result.returncode == 0, result.stderr
    status = json.loads(result.stdout)
    assert status["budget_bytes"] == 64 * MiB and status["backend"] == "host"
    (e,) = status["engines"]
    assert (e["engine_id"], e["namespace"]) == ("e1", "m1")
    assert e["slabs"] == len(engine.pool.slab_ids()) == 2
    assert e["held_bytes"] == e["slabs"] * e["slab_bytes"] == 2 * PAGE
    assert status["memory"]["held"] == 2 * PAGE
    # exactly the daemon's dict, nothing added or dropped
    assert set(status) == set(daemon.status())


def test_status_human_lists_engines_and_memory(daemon, engine):
    result = kvelastic(daemon.env, "status")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "budget       64.0 MiB" in out and "held 4.0 MiB" in out
    row = next(line for line in out.splitlines() if line.startswith("e1 "))
    assert row.split()[:5] == ["e1", "m1", str(engine_status(daemon)["pid"]), "1", "2"]


def test_render_status_hit_rate_and_limits():
    status = {"device": "host", "backend": "host", "page_size": PAGE, "budget_bytes": 8 << 30,
              "memory": {"held": 2 << 30, "cached": 512 * MiB, "free": 0, "unallocated": 6 << 30},
              "pages": {"created": 1024, "free": 0, "adopted": 0},
              "engines": [{"engine_id": "a", "namespace": "llama", "pid": 7, "workers": 2, "slabs": 512,
                           "slab_bytes": 4 * MiB, "held_bytes": 2 << 30, "cached_bytes": 512 * MiB,
                           "live_blocks": 3, "cached_blocks": 4, "min_bytes": 1 << 30, "max_bytes": 0,
                           "grants": 5, "returns": 1, "reclaims": 2,
                           "stats": {"lookup_blocks": 1, "hit_blocks": 1, "query_tokens": 8000, "hit_tokens": 6000,
                                     "adopted_blocks": 61, "adopted_hits": 42}}]}
    text = ctl.render_status(status)
    assert "budget       8.00 GiB" in text and "25.0% held" in text
    row = text.splitlines()[-1].split()
    assert row[:3] == ["a", "llama", "7"]
    assert "1.00 GiB" in text.splitlines()[-1] and "none" in row and "75.0%" in row
    assert row[-3:] == ["5", "1", "2"] and "61 (42 hit)" in text   # blocks adopted from replicas
    status["engines"] = []
    assert "no engines registered" in ctl.render_status(status)


def test_limit_changes_min_and_max(daemon, engine):
    result = kvelastic(daemon.env, "limit", "e1", "4MiB", "16MiB")
    assert result.returncode == 0, result.stderr
    e = engine_status(daemon)
    assert (e["min_bytes"], e["max_bytes"]) == (4 * MiB, 16 * MiB)
    result = kvelastic(daemon.env, "limit", "e1", "0", "0")   # MAX 0: no cap
    assert result.returncode == 0, result.stderr
    e = engine_status(daemon)
    assert (e["min_bytes"], e["max_bytes"]) == (0, 0)
    assert kvelastic(daemon.env, "limit", "e1", str(2 * MiB), "1gib").returncode == 0
    e = engine_status(daemon)
    assert (e["min_bytes"], e["max_bytes"]) == (2 * MiB, 1 << 30)


def test_limit_refused_changes_nothing(daemon, engine):
    assert kvelastic(daemon.env, "limit", "e1", "2MiB", "32MiB").returncode == 0
    before = limits(daemon)

    result = kvelastic(daemon.env, "limit", "e1", "16MiB", "8MiB")      # min > max
    assert result.returncode == 1
    assert result.stderr.startswith("kvelastic limit: ") and "min" in result.stderr and "max" in result.stderr
    assert result.stdout == ""

    result = kvelastic(daemon.env, "limit", "nope", "0", "8MiB")        # unknown engine
    assert result.returncode == 1
    assert result.stderr.startswith("kvelastic limit: ") and "'nope'" in result.stderr

    # What a limit could change: every engine's limits (and no engine added).
    # Not the memory they hold: an idle engine's reserve decays on its own
    # time, which a slow machine can reach in the middle of the test.
    assert limits(daemon) == before


def limits(daemon) -> dict[str, tuple[int, int]]:
    return {e["engine_id"]: (e["min_bytes"], e["max_bytes"]) for e in daemon.status()["engines"]}


@pytest.mark.parametrize("args, named", [(("e1", "lots", "8MiB"), "MIN"), (("e1", "0", "8XB"), "MAX")])
def test_limit_bad_size_is_a_usage_error(daemon, args, named):
    result = kvelastic(daemon.env, "limit", *args)
    assert result.returncode == 2
    assert f"argument {named}" in result.stderr


def test_invalidate_namespace_drops_cached_blocks(daemon, engine):
    pool = engine.pool
    with engine.lock:
        blocks = pool.allocate(2)
        pool.cache(blocks, [b"k1", b"k2"])
        pool.free(blocks)
    wait_for(lambda: pool.num_cached == 2, what="two cached blocks")
    wait_for(lambda: engine_status(daemon)["cached_blocks"] == 2, what="the daemon's mirror")

    result = kvelastic(daemon.env, "invalidate", "m1")
    assert result.returncode == 0, result.stderr
    wait_for(lambda: pool.num_cached == 0, what="the engine to drop its cache")
    wait_for(lambda: engine_status(daemon)["cached_blocks"] == 0, what="the mirror to follow")
    assert engine_status(daemon)["slabs"] == 2      # memory stays; only the cache goes

    assert kvelastic(daemon.env, "invalidate", "e1").returncode == 0   # an engine id works too


def test_invalidate_unknown_target_fails(daemon, engine):
    result = kvelastic(daemon.env, "invalidate", "no-such-model")
    assert result.returncode == 1
    assert result.stderr.startswith("kvelastic invalidate: ") and "no-such-model" in result.stderr


def test_top_refreshes_and_exits(daemon, engine):
    result = kvelastic(daemon.env, "top", "--iterations", "2", "--interval", "0.1")
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("kvelastic top") == 2
    assert result.stdout.count("\ne1 ") == 2


def test_top_quits_cleanly_on_sigint(daemon):
    proc = subprocess.Popen([sys.executable, "-m", "kvelastic", "top", "--interval", "0.1"], env=daemon.env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().startswith("kvelastic top")   # one frame drawn
        time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=10)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "Traceback" not in err


@pytest.mark.parametrize("args", [("status",), ("status", "--json"), ("top", "--iterations", "1"),
                                  ("limit", "e1", "0", "1GiB"), ("invalidate", "m1")])
def test_every_command_says_when_no_daemon_runs(tmp_path, args):
    socket_path = tmp_path / "k.sock"
    env = dict(os.environ, KVELASTIC_SOCKET=str(socket_path))
    result = kvelastic(env, *args)
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.strip() == (f"kvelastic: {NO_DAEMON} {socket_path} (start it with 'make run' or "
                                     "'kvelastic daemon'; KVELASTIC_SOCKET selects the socket)")


def test_stale_socket_and_silent_daemon(tmp_path):
    stale = tmp_path / "stale.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(stale))
    s.close()                                   # the file stays, nobody listens: a killed daemon
    with pytest.raises(DaemonUnavailable, match=NO_DAEMON):
        ctl.request(str(stale), ctl.p.Status(), timeout=1)

    silent = tmp_path / "silent.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(silent))
    listener.listen()                           # accepts connections, never answers
    try:
        with pytest.raises(DaemonUnavailable, match="no daemon answered within 0.3 s"):
            ctl.request(str(silent), ctl.p.Status(), timeout=0.3)
    finally:
        listener.close()


def test_request_raises_typed_errors(daemon):
    assert ctl.get_status(daemon.socket)["budget_bytes"] == 64 * MiB
    with pytest.raises(DaemonError) as info:
        ctl.set_limit(daemon.socket, "ghost", 0, 0)
    assert info.value.reason == "unknown_engine" and "ghost" in info.value.message
