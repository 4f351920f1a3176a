"""A departed engine's valid cache stays with the daemon for its namespace:
the next engine of that namespace maps the same pages (not zeroed) and hits
its prefix; nobody else ever sees them. Valid means keyed in a step that
finished; a key the daemon was told is dropped is never kept. Real daemon,
engine and worker processes (host pages), engines killed with SIGKILL."""

import os
import signal
import subprocess
import sys

import pytest

from tests.daemon.books import parse_metrics, value
from tests.daemon_proc import wait_for

KEEP = {"grace": 60, "journal_interval": 3600}   # no idle return; the journal goes out only when asked


def orphans(daemon) -> list[dict]:
    return daemon.status().get("orphans", [])


def kept_blocks(daemon, namespace: str) -> int:
    return sum(o["blocks"] for o in orphans(daemon) if o["namespace"] == namespace)


def engine_stats(daemon, engine_id: str) -> dict:
    return next(e for e in daemon.status()["engines"] if e["engine_id"] == engine_id)["stats"]


def cache_in_a_step(engine, prefix: str, n: int, value: int, finish: bool = True) -> bool:
    """One model step: allocate ``n`` blocks, key them, write their KV, end the
    step (or not: the process dies in it), free them (they stay cached).
    True if the step needed its seal (its allocation evicted blocks the daemon keeps)."""
    step = engine.do("step")["step"]
    assert engine.do("alloc", n=n)["ok"]
    engine.do("cache", prefix=prefix)
    needed = engine.do("seal")["needed"]
    engine.do("write", value=value)
    if finish:
        engine.do("end_step", n=step)
        engine.do("free")
    return needed


def killed_with_cache(daemon, engines, keep: bool = True):
    """Engine ``a`` of llama-1 caches 4 blocks ("sys", bytes 7) in a finished
    step, its journal acknowledged, and is killed with SIGKILL; with ``keep``
    the test waits until the daemon kept them."""
    a = engines(daemon, "a", namespace="llama-1", **KEEP)
    assert a.do("ensure", n=4)["ok"]
    cache_in_a_step(a, "sys", 4, value=7)
    a.do("flush")
    a.kill()
    if keep:
        wait_for(lambda: kept_blocks(daemon, "llama-1") == 4, what="a's cache kept for llama-1")


def test_a_killed_engines_cache_warms_the_next_engine_of_its_namespace(daemon_factory, engines):
    daemon = daemon_factory(memory="4MiB")                       # two slabs of 4 blocks
    killed_with_cache(daemon, engines)
    status = daemon.status()
    assert status["memory"]["orphaned"] == 2 << 20 and status["memory"]["held"] == 0

    b = engines(daemon, "a", namespace="llama-1", **KEEP)      # the same engine, restarted
    assert b.do("ensure", n=1)["ok"]
    assert b.do("lookup", prefix="sys", n=4)["hits"] == 4
    assert sorted(b.do("read")["values"]) == [0, 7]            # the kept page as written; a fresh one
    assert orphans(daemon) == []
    b.do("flush")
    wait_for(lambda: engine_stats(daemon, "a")["adopted_blocks"] == 4, what="adoption in b's journal")


def test_keys_of_a_step_that_never_finished_are_not_kept(daemon_factory, engines):
    daemon = daemon_factory(memory="4MiB")
    a = engines(daemon, "a", namespace="llama-1", **KEEP)
    assert a.do("ensure", n=4)["ok"]
    cache_in_a_step(a, "done", 2, value=5)
    cache_in_a_step(a, "running", 2, value=6, finish=False)     # killed mid-step
    a.do("flush")
    a.kill()
    wait_for(lambda: kept_blocks(daemon, "llama-1") == 2, what="only the finished step's blocks kept")
    b = engines(daemon, "b", namespace="llama-1", **KEEP)
    assert b.do("ensure", n=1)["ok"]
    assert b.do("lookup", prefix="done", n=2)["hits"] == 2
    assert b.do("lookup", prefix="running", n=1)["hits"] == 0


def cached_then_stepping(daemon_factory, engines):
    """A daemon of one slab, and engine ``a`` in a new step over it: 4 blocks
    cached (prefix "old", KV 3) by a finished step, the daemon told so."""
    daemon = daemon_factory(memory="2MiB")                       # one slab
    a = engines(daemon, "a", namespace="llama-1", **KEEP)
    assert a.do("ensure", n=4)["ok"]
    cache_in_a_step(a, "old", 4, value=3)
    a.do("flush")
    a.do("step")
    return daemon, a


@pytest.mark.parametrize("seal", [True, False])
def test_a_dropped_key_is_acknowledged_before_the_step_that_rewrites_its_block(daemon_factory, engines, seal):
    """The step evicts cached blocks and rewrites them, then the engine dies.
    Sealed (as the vLLM plugin always does), the daemon heard of the eviction
    before the step ran and keeps nothing; unsealed, it would believe the old
    keys and hand rewritten KV to the next engine: the case the seal exists for."""
    daemon, a = cached_then_stepping(daemon_factory, engines)
    assert a.do("alloc", n=4)["ok"]                              # evicts the 4 cached blocks
    if seal:
        a.do("seal")
    a.do("write", value=9)                                       # the step rewrites them, and dies
    a.kill()
    wait_for(lambda: not daemon.status()["engines"], what="a gone")
    b = engines(daemon, "b", namespace="llama-1", **KEEP)
    assert b.do("ensure", n=1)["ok"]
    hits = b.do("lookup", prefix="old", n=4)["hits"]
    if seal:
        assert hits == 0 and b.do("read")["values"] == [0]     # nothing kept: a fresh page
    else:
        assert hits == 4 and b.do("read")["values"] == [9]     # stale keys over rewritten KV


def test_demoted_blocks_are_rewritten_with_no_seal_and_never_kept(daemon_factory, engines):
    """Once a step had to be sealed, with a reserve watermark each journal
    also demotes the next blocks to be evicted (``SlabPool.demote``): they
    still hit in the engine, and the step that evicts and rewrites them has
    nothing to seal, yet the daemon keeps none of them when the engine dies
    in that step."""
    daemon = daemon_factory(memory="2MiB")                       # one slab of 4 blocks
    a = engines(daemon, "a", namespace="llama-1", low_watermark=4, **KEEP)
    assert a.do("ensure", n=4)["ok"]
    cache_in_a_step(a, "first", 4, value=1)
    assert a.do("flush")["state"]["demoted"] == 0                # no seal yet: nothing demoted
    assert cache_in_a_step(a, "old", 4, value=3)                 # evicts "first": sealed
    assert a.do("flush")["state"]["demoted"] == 4                # no free block: all 4 are next to go
    assert a.do("lookup", prefix="old", n=4)["hits"] == 4        # still this engine's cache
    a.do("step")
    assert a.do("alloc", n=4)["ok"]                              # evicts the 4 demoted blocks
    assert a.do("seal")["needed"] is False                       # nothing the daemon believes in was dropped
    a.do("write", value=9)
    a.kill()
    wait_for(lambda: not daemon.status()["engines"], what="a gone")
    assert kept_blocks(daemon, "llama-1") == 0
    b = engines(daemon, "b", namespace="llama-1", **KEEP)
    assert b.do("ensure", n=1)["ok"]
    assert b.do("lookup", prefix="old", n=4)["hits"] == 0
    assert b.do("read")["values"] == [0]                         # a fresh page, not the rewritten one


def demoted_old_and_new(daemon_factory, engines):
    """Engine ``a`` with a reserve watermark of 4 over two full slabs, under
    pressure: "old" cached first, then "new", each evicting what filled the
    slabs before ("old"'s step sealed, and its seal demoted the rest of
    "first", so "new"'s needed none); its journal shipped, which demoted the
    4 least recently used: "old"."""
    daemon = daemon_factory(memory="4MiB")                       # two slabs of 4 blocks
    a = engines(daemon, "a", namespace="llama-1", low_watermark=4, **KEEP)
    assert a.do("ensure", n=8)["ok"]
    cache_in_a_step(a, "first", 8, value=1)
    a.do("flush")                                                # the daemon keeps them: evicting them is sealed
    assert cache_in_a_step(a, "old", 4, value=3)
    assert not cache_in_a_step(a, "new", 4, value=5)             # the rest of "first", demoted by that seal
    assert a.do("flush")["state"]["demoted"] == 4
    return daemon, a


def test_a_demoted_block_hit_again_is_kept_again_and_the_next_oldest_demoted(daemon_factory, engines):
    daemon, a = demoted_old_and_new(daemon_factory, engines)
    step = a.do("step")["step"]
    assert a.do("hit", prefix="old", n=4)["hits"] == 4           # revived: stored again, in this step
    a.do("end_step", n=step)
    a.do("free")
    assert a.do("flush")["state"]["demoted"] == 4                # now "new" is the least recently used
    a.kill()
    wait_for(lambda: not daemon.status()["engines"], what="a gone")
    assert kept_blocks(daemon, "llama-1") == 4                   # "old"; the demoted "new" is not kept
    b = engines(daemon, "b", namespace="llama-1", **KEEP)
    assert b.do("ensure", n=4)["ok"]
    assert b.do("lookup", prefix="old", n=4)["hits"] == 4
    assert b.do("lookup", prefix="new", n=1)["hits"] == 0


def test_a_graceful_exit_keeps_the_demoted_blocks_too(daemon_factory, engines):
    daemon, a = demoted_old_and_new(daemon_factory, engines)
    a.close()                        # nothing will rewrite them now: the daemon hears of them again
    wait_for(lambda: kept_blocks(daemon, "llama-1") == 8, what="all of a's cache kept")
    b = engines(daemon, "b", namespace="llama-1", **KEEP)
    assert b.do("ensure", n=8)["ok"]
    assert b.do("lookup", prefix="old", n=4)["hits"] == 4
    assert b.do("lookup", prefix="new", n=4)["hits"] == 4


def test_a_sealed_drop_counts_even_if_the_daemon_reads_it_after_the_engine_died(daemon_factory, engines):
    """The seal does not wait for the daemon (protocol 3): it writes the
    journal on the engine's lifeline. Here the daemon is stopped from before
    the seal until after the engine (and its worker) died: on waking it finds
    the journal, the closed channels and the engine's messages all at once,
    and still applies the journal before it decides what to keep."""
    daemon, a = cached_then_stepping(daemon_factory, engines)
    os.kill(daemon.proc.pid, signal.SIGSTOP)
    try:
        assert a.do("alloc", n=4)["ok"]                          # evicts the 4 cached blocks
        a.do("seal")                                             # returns at once: nobody answers
        a.do("write", value=9)
        a.kill()
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
    wait_for(lambda: not daemon.status()["engines"], what="a gone")
    assert kept_blocks(daemon, "llama-1") == 0
    b = engines(daemon, "b", namespace="llama-1", **KEEP)
    assert b.do("ensure", n=1)["ok"]
    assert b.do("lookup", prefix="old", n=4)["hits"] == 0
    assert b.do("read")["values"] == [0]                         # a fresh page, not the rewritten one


@pytest.mark.parametrize("namespace", ["llama-1-tenant-b", "mistral-7"])
def test_another_namespace_never_gets_the_kept_cache(daemon_factory, engines, namespace):
    daemon = daemon_factory(memory="4MiB")
    killed_with_cache(daemon, engines)
    c = engines(daemon, "c", namespace=namespace, **KEEP)
    assert c.do("ensure", n=4)["ok"]                             # the other slab: free budget first
    assert c.do("lookup", prefix="sys", n=4)["hits"] == 0
    assert c.do("read")["values"] == [0]
    assert kept_blocks(daemon, "llama-1") == 4                   # still there for llama-1
    samples = parse_metrics(daemon.metrics())
    assert value(samples, "kvelastic_orphaned_cache_bytes", device="0", namespace="llama-1") == 2 << 20
    assert value(samples, "kvelastic_orphaned_cache_blocks", device="0", namespace="llama-1") == 4
    assert value(samples, "kvelastic_memory_bytes", device="0", state="orphaned") == 2 << 20
    out = subprocess.run([sys.executable, "-m", "kvelastic", "status"], env=daemon.env, capture_output=True,
                         text=True, timeout=20).stdout
    assert "orphaned 2.0 MiB" in out
    header = next(line for line in out.splitlines() if line.startswith("ORPHANED CACHE"))
    row = next(line for line in out.splitlines() if line.startswith("llama-1 "))
    assert header.split()[2:] == ["DEVICE", "SLABS", "BLOCKS", "BYTES", "AGE"]
    assert row.split()[:4] == ["llama-1", "0", "1", "4"]


def test_a_demand_takes_kept_cache_first_and_gets_fresh_pages(daemon_factory, engines):
    daemon = daemon_factory(memory="2MiB")                       # the kept slab fills the budget
    killed_with_cache(daemon, engines)
    c = engines(daemon, "c", namespace="mistral-7", **KEEP)
    assert c.do("ensure", n=4, timeout=5)["ok"]
    assert c.do("read")["values"] == [0]                         # a fresh page, never a's KV
    assert orphans(daemon) == []
    assert "kept cache slab(s) released (memory for engine c)" in daemon.log()


def test_a_graceful_exit_keeps_the_cache_and_the_ttl_ends_it(daemon_factory, engines):
    daemon = daemon_factory(memory="4MiB", KVELASTIC_ORPHAN_CACHE_TTL="2s")
    a = engines(daemon, "a", namespace="llama-1", **KEEP)
    assert a.do("ensure", n=4)["ok"]
    cache_in_a_step(a, "sys", 4, value=7)
    a.close()                        # unregisters; its last journal (the step's end) goes first
    # Read from what lasts (the TTL's eviction count, the log), not from a poll
    # that must land inside the 2 s the cache lives: a loaded machine misses it.
    ttl_evictions = lambda: daemon.status()["devices"][0]["kept_evictions"].get("ttl", 0)  # noqa: E731
    wait_for(lambda: ttl_evictions() > 0, timeout=15, what="a's kept cache to end by its TTL")
    assert ttl_evictions() == 4                  # the 4 blocks of a's step were kept, then expired
    assert orphans(daemon) == [] and daemon.status()["memory"]["orphaned"] == 0
    log = daemon.log()
    assert "engine a unregistered: returning its 1 slab(s), 1 with valid cache kept for namespace llama-1" in log
    assert "namespace llama-1: 1 kept cache slab(s) released (older than 2 s)" in log


def test_a_zero_ttl_keeps_nothing(daemon_factory, engines):
    daemon = daemon_factory(memory="4MiB", KVELASTIC_ORPHAN_CACHE_TTL="0")
    killed_with_cache(daemon, engines, keep=False)
    wait_for(lambda: daemon.status()["memory"]["held"] == 0, what="a's memory back")
    assert orphans(daemon) == []
    b = engines(daemon, "b", namespace="llama-1", **KEEP)
    assert b.do("ensure", n=1)["ok"]
    assert b.do("lookup", prefix="sys", n=4)["hits"] == 0


def test_a_key_two_blocks_hold_is_kept_once(daemon_factory, engines):
    daemon = daemon_factory(memory="4MiB")
    a = engines(daemon, "a", namespace="llama-1", **KEEP)
    assert a.do("ensure", n=4)["ok"]
    cache_in_a_step(a, "dup", 2, value=1)
    cache_in_a_step(a, "dup", 2, value=1)      # the same keys again, on two other blocks
    assert a.state()["cached"] == 4
    a.do("flush")
    a.kill()
    wait_for(lambda: kept_blocks(daemon, "llama-1") == 2, what="each key kept once")


def test_an_engine_killed_before_it_applied_an_invalidation_leaves_nothing_kept(daemon_factory, engines):
    """``kvelastic invalidate`` reaches an engine whose scheduler holds the
    pool (its ``ClearIndex`` waits; the daemon answered the CLI, so it was
    sent); killed before it cleared, its keys are of before the
    invalidation: none is kept (before the journal's ``scope``, its last
    journal's keys were)."""
    import subprocess
    import sys

    daemon = daemon_factory(memory="2MiB")
    a = engines(daemon, "a", namespace="llama-1", **KEEP)
    assert a.do("ensure", n=4)["ok"]
    cache_in_a_step(a, "sys", 4, value=7)
    a.do("flush")
    a.do("hold")                                                 # mid-step: the ClearIndex is deferred
    done = subprocess.run([sys.executable, "-m", "kvelastic", "invalidate", "llama-1"], env=daemon.env,
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    a.kill()
    wait_for(lambda: not daemon.status()["engines"], what="a gone")
    assert kept_blocks(daemon, "llama-1") == 0

    b = engines(daemon, "b", namespace="llama-1", **KEEP)
    assert b.do("ensure", n=4)["ok"]
    assert b.do("lookup", prefix="sys", n=4)["hits"] == 0
