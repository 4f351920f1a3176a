"""``kvelastic status --json`` and ``/metrics`` agree with what the test did."""

import json
import subprocess
import sys

from kvelastic import protocol as p
from tests.daemon.books import SLAB, held, parse_metrics, quiet_status, value
from tests.daemon_proc import wait_for

ALLOWED_LABELS = {"device", "engine", "namespace", "reason", "state", "bound", "le"}


def test_status_and_metrics_agree_with_the_test(daemon_factory, engines):
    daemon = daemon_factory(memory="16MiB")
    a = engines(daemon, "a", grace=0.2, namespace="llama")
    b = engines(daemon, "b", grace=60, namespace="qwen")
    assert a.do("ensure", n=16)["ok"]                     # 4 slabs granted to a
    a.do("alloc", n=8)
    a.do("cache", prefix="x")
    a.do("free")                                           # 2 slabs cached, 2 idle -> returned
    wait_for(lambda: held(daemon, "a") == 2 * SLAB, what="a's idle slabs returned")
    assert a.do("lookup", prefix="x", n=10)["hits"] == 8   # 10 looked up, 8 hit
    assert b.do("ensure", n=32)["ok"]                      # 8 slabs: 6 free + 2 reclaimed from a
    daemon.request(p.Grow(engine_id="ghost", slabs=1))     # one rejected message

    wait_for(lambda: daemon.status()["engines"][0]["stats"].get("lookup_blocks") == 10, what="a's journal")
    status = wait_for(lambda: quiet_status(daemon), what="a quiet daemon")
    cli = subprocess.run([sys.executable, "-m", "kvelastic", "status", "--json"], env=daemon.env,
                         capture_output=True, text=True, check=True)
    assert json.loads(cli.stdout) == status
    by_id = {e["engine_id"]: e for e in status["engines"]}
    assert by_id["a"]["held_bytes"] == 0 and by_id["b"]["held_bytes"] == 8 * SLAB
    assert (by_id["a"]["grants"], by_id["a"]["returns"], by_id["a"]["reclaims"]) == (4, 2, 2)
    assert by_id["b"]["grants"] == 8
    assert status["memory"]["held"] == 8 * SLAB == status["budget_bytes"]

    m = parse_metrics(daemon.metrics())
    assert value(m, "kvelastic_budget_bytes", device="0") == 16 * 2**20
    assert value(m, "kvelastic_memory_bytes", device="0", state="held") == 8 * SLAB
    assert value(m, "kvelastic_engines_connected", device="0") == 2
    assert value(m, "kvelastic_engine_held_bytes", device="0", engine="b", namespace="qwen") == 8 * SLAB
    assert value(m, "kvelastic_slab_grants_total", device="0", engine="a") == 4
    assert value(m, "kvelastic_slab_returns_total", device="0", engine="a") == 2
    assert value(m, "kvelastic_slab_reclaims_total", device="0", engine="a") == 2
    assert value(m, "kvelastic_prefix_cache_lookup_blocks_total", device="0", engine="a") == 10
    assert value(m, "kvelastic_prefix_cache_hit_blocks_total", device="0", engine="a") == 8
    tokens = by_id["a"]["stats"]["query_tokens"] // 10                          # a block's tokens
    assert value(m, "kvelastic_prefix_cache_queries_total", device="0", engine="a") == 10 * tokens > 0
    assert value(m, "kvelastic_prefix_cache_hits_total", device="0", engine="a") == 8 * tokens
    assert value(m, "kvelastic_prefix_cache_evictions_total", device="0", engine="a", reason="reclaim") == 8
    assert value(m, "kvelastic_rejected_messages_total", reason="unknown_engine") == 1
    assert value(m, "kvelastic_grant_latency_seconds_count", device="0") == 2   # two grow requests
    for name, labels in m:
        assert name.startswith(("kvelastic_", "python_", "process_")), name
        assert {k for k, _ in labels} <= ALLOWED_LABELS, (name, labels)
