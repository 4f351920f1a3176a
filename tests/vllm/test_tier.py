"""The node's tier end to end with real vLLM (CPU build, its default
layout: EngineCore and worker in processes of their own, forked as on a GPU)
and a real daemon:
an engine serves a long shared prompt and exits; its kept cache expires
(``KVELASTIC_ORPHAN_CACHE_TTL=1s``) and the daemon demotes it to the tier;
an engine of the same model with ``KvelasticTierConnector`` configured
(under vLLM's ``MultiConnector``, beside vLLM's ``ExampleConnector``)
serves the same prompts, loading the blocks back (promotions counted), and
its greedy tokens equal stock vLLM's. An engine of another tenant salt finds
nothing; a block whose bytes were flipped on disk is dropped, counted, and
computed again, with the same tokens. And source B: an engine that keeps
running evicts the prompt's blocks under pressure; the daemon copied them
into the tier while they were cached, and another engine loads them back
while the first still runs, with stock's tokens. And an engine killed with ``kill -9``
in the middle of a load (``stalling_tier.py``: pinned, never fetched)
loses nothing but its load: the next engine loads the same blocks."""

import json
import pathlib

import pytest

pytest.importorskip("vllm")

from tests.daemon_proc import short_dir, wait_for
from tests.vllm import run_engine

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


class TierEngine(run_engine.Engine):
    """``tier_run.py``: ``weights_run`` with the tier connector configured."""

    script = [str(pathlib.Path(__file__).resolve().parent / "tier_run.py")]


def tier(daemon) -> dict:
    return daemon.status()["tier"]


def counters(daemon) -> dict:
    return tier(daemon)["counters"]


def settled(daemon) -> dict:
    """Once no engine is registered, no kept cache is left (expired: demoted)
    and no block is being written, the tier."""
    return wait_for(lambda: not daemon.status()["engines"] and not daemon.status().get("orphans")
                    and tier(daemon)["writing"] == 0 and tier(daemon), timeout=60,
                    what="the engine gone and its kept cache demoted")


def tier_daemon(daemon_factory, tmp_path, medium: str = "disk"):
    """A daemon with a tier whose kept cache expires in a second, so a
    departed engine's blocks reach the tier soon: on disk, or (``host+disk``)
    in host memory above the disk; its folder returned too."""
    if medium == "host+disk":     # host memory for a few of the tiny model's 32 KiB blocks: the rest on disk
        folder = short_dir(tmp_path) / "tier"
        folder.mkdir(mode=0o700)
        return daemon_factory(memory="64MiB", KVELASTIC_TIER_DIR=str(folder), KVELASTIC_TIER_SIZE="256MiB",
                              KVELASTIC_TIER_HOST_SIZE="128KiB", KVELASTIC_ORPHAN_CACHE_TTL="1s"), folder
    folder = short_dir(tmp_path) / "tier"
    folder.mkdir(mode=0o700)
    return daemon_factory(memory="64MiB", KVELASTIC_TIER_DIR=str(folder), KVELASTIC_TIER_SIZE="256MiB",
                          KVELASTIC_ORPHAN_CACHE_TTL="1s"), folder


def served_and_demoted(model, daemon, *args: str) -> dict:
    """An engine without the connector serves the workload and exits; once its
    kept cache expired into the tier: its tokens, and the tier."""
    first = run_engine.Engine(model, daemon, *args, KVELASTIC_ENGINE_ID="first")
    tokens = first.do("workload")["tokens"]
    first.exit()
    return {"tokens": tokens, "tier": settled(daemon)}


def test_kept_cache_is_demoted_and_promoted_by_the_next_engine(daemon_factory, tiny_model, tmp_path):
    stock = run_engine.Stock(tiny_model)
    expected = stock.do("workload")["tokens"]
    stock.exit()
    daemon, folder = tier_daemon(daemon_factory, tmp_path)
    first = served_and_demoted(tiny_model, daemon)
    demoted = first["tier"]
    assert first["tokens"] == expected and demoted["blocks"] > 0 and counters(daemon)["demotions"] == demoted["blocks"]
    (namespace,) = demoted["namespaces"]

    # As a deployment composes connectors: vLLM's MultiConnector, the tier's
    # first (the first child with a hit loads it), vLLM's ExampleConnector
    # second (it saves what it sees). The plain connector: the engines below.
    saved = tmp_path / "example-connector"
    saved.mkdir()
    second = TierEngine(tiny_model, daemon, "--multi", str(saved), KVELASTIC_ENGINE_ID="second")
    out = second.do("workload")
    assert out["tokens"] == expected
    promoted = counters(daemon)["promotions"]
    assert promoted > 0 and counters(daemon)["hit_blocks"] >= promoted
    assert any(saved.rglob("*.safetensors"))                # the other child ran beside it
    print(f"tier: {demoted['blocks']} block(s) demoted, {promoted} promoted; tokens equal stock's")
    second.exit()
    settled(daemon)

    lookups = counters(daemon)["lookups"]
    hits = counters(daemon)["hit_blocks"]
    other = TierEngine(tiny_model, daemon, KVELASTIC_ENGINE_ID="other",
                       KVELASTIC_TENANT_SALT="another-tenant")
    assert other.do("workload")["tokens"] == expected
    assert counters(daemon)["lookups"] > lookups and counters(daemon)["hit_blocks"] == hits
    other.exit()
    after = settled(daemon)
    assert len(after["namespaces"]) == 2 and after["namespaces"][namespace] > 0    # the other's: its own

    for path in folder.glob("*.kvb"):                     # the last byte of every block's payload flipped
        data = bytearray(path.read_bytes())
        data[-1] ^= 0x5A
        path.write_bytes(bytes(data))
    third = TierEngine(tiny_model, daemon, KVELASTIC_ENGINE_ID="third")
    assert third.do("workload")["tokens"] == expected
    assert counters(daemon)["failures_checksum"] > 0
    assert counters(daemon)["promotions"] == promoted    # nothing that failed its check was served
    third.exit()


def test_a_host_memory_tier_serves_the_next_engine_and_an_invalidation_reaches_it(daemon_factory, tiny_model,
                                                                                   tmp_path):
    """The tier in the daemon's own memory (``KVELASTIC_TIER_HOST_SIZE``), as
    on a GPU node, above the disk with room for a few blocks (the rest lie on
    disk, so a load spans both; host memory alone: ``test_bench_tier``'s
    ``tier_host`` mode): what the first engine left is promoted by the next
    with stock's tokens; another tenant finds nothing; ``invalidate`` of the
    namespace empties it of that namespace, and the engine after promotes
    nothing and still computes stock's tokens."""
    medium = "host+disk"
    from kvelastic import protocol as p

    stock = run_engine.Stock(tiny_model)
    expected = stock.do("workload")["tokens"]
    stock.exit()
    daemon, folder = tier_daemon(daemon_factory, tmp_path, medium)
    first = served_and_demoted(tiny_model, daemon)
    demoted = first["tier"]
    assert first["tokens"] == expected and demoted["medium"] == medium and demoted["blocks"] > 0
    on = {level["medium"]: level["bytes"] for level in demoted["levels"]}
    assert on["host"] > 0 and on["disk"] > 0 and len(list(folder.glob("*.kvb"))) == on["disk"] // (32 << 10)
    (namespace,) = demoted["namespaces"]

    second = TierEngine(tiny_model, daemon, KVELASTIC_ENGINE_ID="second")
    assert second.do("workload")["tokens"] == expected
    promoted = counters(daemon)["promotions"]
    assert promoted > 0 and counters(daemon)["hit_blocks"] >= promoted
    second.exit()
    settled(daemon)

    hits = counters(daemon)["hit_blocks"]
    other = TierEngine(tiny_model, daemon, KVELASTIC_ENGINE_ID="other", KVELASTIC_TENANT_SALT="another-tenant")
    assert other.do("workload")["tokens"] == expected and counters(daemon)["hit_blocks"] == hits
    other.exit()
    settled(daemon)

    done = daemon.request(p.Invalidate(target=namespace), timeout=30)
    assert isinstance(done, p.Invalidated) and done.tier_blocks > 0
    assert namespace not in tier(daemon)["namespaces"]
    # What is left on disk is the other tenant's: one file a block of the books.
    wait_for(lambda: len(list(folder.glob("*.kvb"))) * (32 << 10) == next(
        level["bytes"] for level in tier(daemon)["levels"] if level["medium"] == "disk"),
        what="the namespace's files deleted")
    third = TierEngine(tiny_model, daemon, KVELASTIC_ENGINE_ID="third")
    assert third.do("workload")["tokens"] == expected and counters(daemon)["promotions"] == promoted
    print(f"host tier: {demoted['blocks']} block(s) demoted, {promoted} promoted, {done.tier_blocks} invalidated")
    third.exit()


def test_two_tensor_parallel_workers_each_load_their_part(daemon_factory, tiny_model, tmp_path):
    """TP=2: the daemon demotes both workers' halves of each block (rank
    after rank); each worker of the next engine copies its own half back.
    A worker that took the wrong half would compute other tokens."""
    stock = run_engine.Stock(tiny_model, "--tp2")
    expected = stock.do("workload")["tokens"]
    stock.exit()
    daemon, _ = tier_daemon(daemon_factory, tmp_path)
    first = served_and_demoted(tiny_model, daemon, "--tp2")
    assert first["tokens"] == expected and first["tier"]["blocks"] > 0

    second = TierEngine(tiny_model, daemon, "--tp2", KVELASTIC_ENGINE_ID="second")
    out = second.do("workload")
    assert out["tokens"] == expected
    assert counters(daemon)["promotions"] > 0
    second.exit()


# Prompts that share nothing with the workload's (``warm_run.SYSTEM``) nor
# with each other's first block: enough of them to push the workload's
# blocks out of a 4 MiB budget (128 blocks of the tiny model's 32 KiB).
PUSHERS = [f"{i} unrelated " + " ".join(f"w{i}x{j}" for j in range(300)) for i in range(12)]


def test_blocks_a_running_engine_evicts_reach_the_tier_while_it_runs(daemon_factory, tiny_model, tmp_path):
    stock = run_engine.Stock(tiny_model)
    expected = stock.do("workload")["tokens"]
    stock.exit()
    folder = short_dir(tmp_path) / "tier"
    folder.mkdir(mode=0o700)
    # No kept cache at all (TTL 0): only source B can bring the blocks down.
    daemon = daemon_factory(memory="8MiB", KVELASTIC_TIER_DIR=str(folder), KVELASTIC_TIER_SIZE="256MiB",
                            KVELASTIC_ORPHAN_CACHE_TTL="0")
    first = run_engine.Engine(tiny_model, daemon, KVELASTIC_ENGINE_ID="first")
    assert first.do("workload")["tokens"] == expected
    for prompt in PUSHERS:                        # other work: the workload's blocks are evicted
        first.do("prompts " + json.dumps([prompt]))
    demoted = wait_for(lambda: counters(daemon)["demotions_evicted"] >= 40 and counters(daemon), timeout=30,
                       what="first's evicted blocks in the tier")
    assert demoted["demotions_reclaimed"] == 0 and demoted["demotions"] == demoted["demotions_evicted"]

    second = TierEngine(tiny_model, daemon, KVELASTIC_ENGINE_ID="second")       # first still runs
    out = second.do("workload")
    assert out["tokens"] == expected
    assert counters(daemon)["promotions"] > 0
    print(f"source B: {demoted['demotions_evicted']} evicted block(s) demoted, "
          f"{counters(daemon)['promotions']} promoted, {demoted['failures_raced']} raced; tokens equal stock's")
    second.exit()
    first.exit()


def test_an_engine_killed_in_the_middle_of_a_load_loses_nothing_but_its_load(daemon_factory, tiny_model, tmp_path):
    """``kill -9`` of the engine process holding a lease on the tier's blocks,
    mid-load: its lease ends with it (counted as a failed load), the blocks
    stay in the tier, and the next engine loads them with stock's tokens.
    The tier in host memory above the disk, the blocks on both."""
    medium = "host+disk"
    import os
    import signal

    stock = run_engine.Stock(tiny_model)
    expected = stock.do("workload")["tokens"]
    stock.exit()
    daemon, _ = tier_daemon(daemon_factory, tmp_path, medium)
    demoted = served_and_demoted(tiny_model, daemon)["tier"]
    assert demoted["medium"] == medium
    marker = tmp_path / "stalled"
    stalled = TierEngine(tiny_model, daemon, "--stall", KVELASTIC_ENGINE_ID="stalled",
                         KVELASTIC_TEST_STALLED=str(marker))
    try:
        stalled.proc.stdin.write("workload\n")
        stalled.proc.stdin.flush()
        wait_for(marker.exists, timeout=60, what="the engine pinned its blocks and stalled")
        pinned = int(marker.read_text().split()[1])
        assert pinned > 0 and counters(daemon)["hit_blocks"] >= pinned and counters(daemon)["promotions"] == 0
        (engine,) = daemon.status()["engines"]
        os.kill(engine["pid"], signal.SIGKILL)              # the process that holds the lease (its scheduler)
        gone = wait_for(lambda: not daemon.status()["engines"] and counters(daemon), timeout=60,
                        what="the engine gone and its lease ended")
        assert gone["failures_load"] >= pinned and gone["promotions"] == 0
    finally:
        stalled.proc.kill()
        stalled.proc.wait(30)
    after = tier(daemon)
    assert after["blocks"] == demoted["blocks"] and after["bytes"] == demoted["bytes"]   # nothing lost, nothing pinned

    third = TierEngine(tiny_model, daemon, KVELASTIC_ENGINE_ID="third")
    assert third.do("workload")["tokens"] == expected
    assert counters(daemon)["promotions"] > 0
    third.exit()
