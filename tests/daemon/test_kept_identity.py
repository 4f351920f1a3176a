"""Kept cache is never served to weights other than the ones that computed it.

- ``kvelastic invalidate`` reaches the kept cache of departed engines, with
  no engine running, counts what it drops, and is refused to anyone but the
  operator or the namespace's owner (a tenant of another uid).
- An engine whose weights may have changed in memory diverges (the vLLM
  plugin does it on a prefix-cache reset or a collective RPC): it moves to
  a namespace of its own, so its cache is never handed to an engine of the
  checkpoint nor kept for one, and it adopts nothing of theirs.

Real daemon, engine and worker processes (host pages). A tenant invalidating
another's kept cache: ``test_tenants.py``.
"""

import os
import subprocess
import sys

import pytest

from kvelastic import protocol as p
from tests.daemon.books import parse_metrics, value
from tests.daemon.test_orphan_cache import KEEP, cache_in_a_step, kept_blocks, killed_with_cache, orphans
from tests.daemon_proc import wait_for


def kvelastic(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvelastic", *args], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=60)


def invalidate_evictions(daemon) -> float:
    samples = parse_metrics(daemon.metrics())
    return value(samples, "kvelastic_prefix_cache_evictions_total", device="0", engine="", reason="invalidate")


# ------------------------------------------------------------ invalidation
@pytest.mark.parametrize("target", ["llama-1", "a"])       # the namespace, or the engine that left it
def test_invalidate_drops_kept_cache_with_no_engine_running(daemon_factory, engines, target):
    daemon = daemon_factory(memory="4MiB", metrics=True)
    killed_with_cache(daemon, engines)
    assert invalidate_evictions(daemon) == 0
    assert not daemon.status()["engines"]

    result = kvelastic(daemon.env, "invalidate", target)
    assert result.returncode == 0, result.stderr
    assert "0 running engine(s), 4 kept block(s) dropped" in result.stdout
    assert orphans(daemon) == [] and daemon.status()["memory"]["orphaned"] == 0
    wait_for(lambda: invalidate_evictions(daemon) == 4, timeout=30, what="the 4 kept blocks counted as invalidated")

    b = engines(daemon, "b", namespace="llama-1", **KEEP)       # the next engine of the namespace
    assert b.do("ensure", n=1)["ok"]
    assert b.do("lookup", prefix="sys", n=4)["hits"] == 0
    assert b.do("read")["values"] == [0]                         # a fresh page, not the kept one

    again = kvelastic(daemon.env, "invalidate", "no-such-namespace")
    assert again.returncode == 1 and "no-such-namespace" in again.stderr


def test_invalidate_reaches_running_engines_and_kept_cache_together(daemon_factory, engines):
    daemon = daemon_factory(memory="6MiB", metrics=True)                # three slabs
    killed_with_cache(daemon, engines)
    b = engines(daemon, "b", namespace="llama-1", **KEEP)
    assert b.do("ensure", n=1)["ok"]                             # warm: adopts a's slab
    assert b.do("lookup", prefix="sys", n=4)["hits"] == 4
    c = engines(daemon, "c", namespace="llama-1", **KEEP)
    assert c.do("ensure", n=2)["ok"]                             # the third slab
    cache_in_a_step(c, "own", 2, value=3)
    c.do("flush")
    c.close()                                                    # graceful: its cache is kept
    wait_for(lambda: kept_blocks(daemon, "llama-1") == 2, timeout=30, what="c's cache kept")

    reply = daemon.request(p.Invalidate(target="llama-1"))
    assert isinstance(reply, p.Invalidated) and (reply.engines, reply.kept_blocks) == (1, 2)
    wait_for(lambda: b.state()["cached"] == 0, timeout=30, what="b's index cleared")
    assert b.do("lookup", prefix="sys", n=4)["hits"] == 0 and orphans(daemon) == []
    wait_for(lambda: invalidate_evictions(daemon) == 2, timeout=30, what="the kept blocks counted")


# --------------------------------------------------------------- diverging
def test_a_diverged_engine_adopts_nothing_and_leaves_nothing(daemon_factory, engines):
    daemon = daemon_factory(memory="6MiB")                       # three slabs of 4 blocks
    killed_with_cache(daemon, engines)                           # a's 4 blocks kept for llama-1
    b = engines(daemon, "b", namespace="llama-1", **KEEP)
    namespace = b.do("diverge", reason="weights updated")["namespace"]
    assert namespace.startswith("llama-1~") and len(namespace) <= 128
    entry = next(e for e in daemon.status()["engines"] if e["engine_id"] == "b")
    assert entry["namespace"] == namespace and entry["private"]
    assert b.do("ensure", n=1)["ok"]
    assert b.do("lookup", prefix="sys", n=4)["hits"] == 0        # the checkpoint's kept cache: not for b
    assert b.do("read")["values"] == [0]
    assert kept_blocks(daemon, "llama-1") == 4
    cache_in_a_step(b, "updated", 4, value=9)                    # KV of the new weights
    b.do("flush")
    b.kill()
    wait_for(lambda: not daemon.status()["engines"], timeout=30, what="b gone")
    wait_for(lambda: daemon.status()["memory"]["held"] == 0, timeout=30,
             what="b's slab unmapped and not held")
    assert [o["namespace"] for o in orphans(daemon)] == ["llama-1"]   # nothing of b's kept

    c = engines(daemon, "c", namespace="llama-1", **KEEP)       # the checkpoint again: a's cache, not b's
    assert c.do("ensure", n=1)["ok"]
    assert c.do("lookup", prefix="sys", n=4)["hits"] == 4
    assert c.do("lookup", prefix="updated", n=4)["hits"] == 0


@pytest.mark.parametrize("who", ["giver", "taker"])
def test_no_cache_moves_between_a_diverged_engine_and_its_checkpoint(daemon_factory, engines, who):
    daemon = daemon_factory(memory="2MiB")                       # one slab: the taker's demand moves it
    a = engines(daemon, "a", namespace="llama-1", grace=60)
    assert a.do("ensure", n=4)["ok"]
    a.do("alloc", n=4)
    a.do("write", value=7)
    a.do("cache", prefix="sys")
    a.do("free")
    b = engines(daemon, "b", namespace="llama-1", grace=60)
    (a if who == "giver" else b).do("diverge")
    assert b.do("ensure", n=4, timeout=5)["ok"]                  # hard demand: a's slab moves to b
    assert a.state()["slabs"] == []
    assert b.do("lookup", prefix="sys", n=4)["hits"] == 0
    assert b.do("read")["values"] == [0]                         # fresh pages: the KV did not travel
    stats = next(e for e in daemon.status()["engines"] if e["engine_id"] == "b")["stats"]
    assert stats["adopted_blocks"] == 0


def test_a_private_engine_registers_alone_and_a_taken_namespace_is_refused(daemon_factory, engines):
    daemon = daemon_factory(memory="4MiB")
    killed_with_cache(daemon, engines)
    b = engines(daemon, "b", namespace="llama-1", private=True, **KEEP)     # KVELASTIC_PRIVATE_CACHE=1
    entry = next(e for e in daemon.status()["engines"] if e["engine_id"] == "b")
    assert entry["private"] and entry["namespace"].startswith("llama-1~")
    assert b.do("ensure", n=1)["ok"] and b.do("lookup", prefix="sys", n=4)["hits"] == 0
    # A diverging engine may not join a namespace in use (here, the kept cache's).
    reply = b.send(p.Diverge(engine_id="b", namespace="llama-1"))
    assert isinstance(reply, p.Error) and reply.reason == p.Reason.BAD_REQUEST.value
    assert kept_blocks(daemon, "llama-1") == 4
