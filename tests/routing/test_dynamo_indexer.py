"""Dynamo's standalone KV indexer indexes a vLLM engine that runs through kvelastic.

One real daemon, one real ``vllm serve`` (tiny model, CPU) through the plugin
with vLLM's own ZMQ KV event publisher (``--kv-events-config``), and Dynamo's
indexer (``ai-dynamo-runtime``) in a network namespace of its own
(``dynamo_indexer.py``), registered for the engine's ``ipc://`` endpoints.
Three views of the engine's prefix cache must agree: the indexer's ``/dump``,
vLLM's own events (a second SUB socket), and the daemon's node stream (the
core pool's journal: what the engine really caches). ``/query`` must rank the
engine by the prefix it holds, and its prediction must be the prefix-cache
hit vLLM then reports.

Then the daemon reclaims the engine's cached slabs for another engine while
the engine is idle. vLLM publishes its event queue only when the scheduler
finishes a step; the plugin publishes what a reclaim queued on its I/O
thread's tick, so the indexer drops the reclaimed blocks with no further
request; and after the next step it still agrees. Last, a router that asks
for a gap older than vLLM's replay buffer gets the newest batches, as from
stock vLLM, and nothing changes for the engine or the daemon.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import random
import shutil
import tempfile
import time

import pytest

from kvelastic_tools.vllm_bench.dynamo_indexer import DynamoIndexer, available
from kvelastic_tools.vllm_bench.kv_events import CacheModel, Subscriber, dump_hashes, ext_hash, wait_for
from kvelastic_tools.vllm_bench.kv_events import replay as replay_batches

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BLOCK = 32          # vllm_serve.SERVE_FLAGS' --block-size
MODEL = "tiny"      # its --served-model-name
INSTANCE = 1
BUFFER = 8          # vLLM's replay buffer (batches) in the first test: a late router's gap outgrows it


@pytest.fixture
def short_tmp():
    """ipc:// paths must fit a unix socket address (108 bytes): pytest's tmp_path may not.
    KVR_KEEP=1 keeps the folder (the indexer's, vLLM's and the daemon's logs)."""
    path = pathlib.Path(tempfile.mkdtemp(prefix="kvr-", dir="/tmp"))
    yield path
    if not os.environ.get("KVR_KEEP"):
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    pytest.importorskip("vllm")
    from kvelastic_tools.vllm_bench.tinymodel import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")


def wait_for_indexer_subscribed(indexer: DynamoIndexer, endpoint: str) -> None:
    """Until the indexer's subscriber is connected to vLLM's event publisher,
    read from the kernel's table of AF_UNIX sockets in the indexer's network
    namespace (an accepted connection lives in its connector's namespace and
    carries the listener's path)."""
    path = " " + endpoint.removeprefix("ipc://")
    assert indexer.proc is not None

    def connected() -> bool:
        with open(f"/proc/{indexer.proc.pid}/net/unix") as table:
            return any(line.rstrip().endswith(path) and line.split()[5] == "03" for line in table)

    wait_for(connected, 30, f"the indexer subscribed to {endpoint}")


def test_dynamo_indexer_tracks_an_engine_through_kvelastic(short_tmp, tiny_model, request):
    why = available()
    if why:
        pytest.skip(f"Dynamo's indexer cannot run here: {why}")
    from tests.daemon.engines import EngineProcess
    from tests.daemon_proc import DaemonProcess
    from tests.vllm.forked import ForkedServer

    t_start = time.monotonic()
    tmp = short_tmp
    endpoint, replay = f"ipc://{tmp}/ev.sock", f"ipc://{tmp}/ev-replay.sock"
    events_cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint,
                  "replay_endpoint": replay, "topic": "kv", "buffer_steps": BUFFER}
    daemon = DaemonProcess(tmp, memory="32MiB").start()
    indexer = server = hog = vllm_events = node_events = None
    try:
        indexer = DynamoIndexer(tmp / "indexer.log").start()
        node_events = Subscriber(f"ipc://{daemon.socket}.kv-events", topic=b"kv@e1@")
        server = ForkedServer(tiny_model, tmp / "vllm.log", flags=["--kv-events-config", json.dumps(events_cfg)],
                            env={"KVELASTIC_ENABLE": "1", "KVELASTIC_SOCKET": daemon.socket,
                                 "KVELASTIC_ENGINE_ID": "e1", "KVELASTIC_METRICS_PORT": "0"}).start()
        vllm_events = Subscriber(endpoint)
        # Batches published before the indexer's SUB connected are replayed
        # (from sequence 0) when the first live batch shows the gap: the
        # prompts wait for it to connect, or none of their batches might be live.
        indexer.register(INSTANCE, endpoint, MODEL, BLOCK, replay)
        wait_for_indexer_subscribed(indexer, endpoint)

        def truth() -> set[int]:
            """The engine's cached blocks per the daemon (its journal), as vLLM's 64-bit event hashes."""
            return {ext_hash(h) for h in node_events.model.blocks} if node_events else set()

        def indexed() -> set[int]:
            return dump_hashes(indexer.dump(), MODEL, INSTANCE)

        def agree() -> bool:
            t = truth()
            return bool(t) and indexed() == vllm_events.hashes() == t

        def explain() -> str:
            t, d, v = truth(), indexed(), vllm_events.hashes()
            return (f"daemon {len(t)}, indexer {len(d)}, vLLM events {len(v)} ({vllm_events.snapshot().counts}); "
                    f"indexer-daemon {sorted(d - t)[:4]}, daemon-indexer {sorted(t - d)[:4]}")

        rng = random.Random(7)

        def tokens(n: int) -> list[int]:
            return [rng.randrange(3, 500) for _ in range(n)]

        shared = tokens(2 * BLOCK)
        prompts = [shared + tokens(40), shared + tokens(40), tokens(100)]
        for prompt in prompts:
            server.complete(prompt, max_tokens=4)  # type: ignore[arg-type]
        try:
            wait_for(agree, 30, "indexer == vLLM's events == the daemon's journal")
        except AssertionError as exc:
            raise AssertionError(f"{exc}: {explain()}") from None
        # 104-token prompts: 3 full blocks each, the first 2 shared by prompts 0 and 1 (+ none of the 4 outputs).
        assert len(truth()) == 7, explain()

        # /query ranks by the prefix held, in tokens (blocks x block size).
        assert indexer.query(MODEL, shared + tokens(40)) == {INSTANCE: 2 * BLOCK}
        assert indexer.query(MODEL, prompts[0]) == {INSTANCE: 3 * BLOCK}
        assert indexer.query(MODEL, prompts[2][:BLOCK] + tokens(60)) == {INSTANCE: BLOCK}
        assert indexer.query(MODEL, tokens(100)) == {}
        # ... and its prediction is the hit vLLM then reports.
        probe = shared + tokens(50)
        predicted = indexer.query(MODEL, probe).get(INSTANCE, 0)
        _, hits_before = server.prefix_cache()
        server.complete(probe, max_tokens=1)  # type: ignore[arg-type]
        _, hits_after = server.prefix_cache()
        assert hits_after - hits_before == predicted == 2 * BLOCK
        wait_for(agree, 30, "the probe's blocks indexed")
        # Enough more cache to fill e1's first slab (128 blocks of 32 KiB in 4 MiB, the null
        # block among them: best fit fills it first) and spill into a second one, which a
        # reclaim can take (a slab goes back only with no live block: the first never does).
        for _ in range(6):
            server.complete(tokens(30 * BLOCK), max_tokens=1)  # type: ignore[arg-type]
        wait_for(lambda: len(truth()) > 128 and agree(), 60, "the filler indexed")
        cached_before = truth()

        # Another engine needs the memory: the daemon reclaims e1's cached slabs.
        hog = EngineProcess(daemon.socket, "hog", bps=4, grace=60)
        # All of the 32 MiB budget but e1's first slab (it holds the null block), in 2 MiB slabs of 4 blocks.
        hog.do("ensure", n=4 * 14, timeout=10.0)
        wait_for(lambda: len(truth()) < len(cached_before), 30, "e1's cached blocks reclaimed (daemon stream)")
        reclaimed = cached_before - truth()
        try:   # e1 stays idle: no step of its own publishes the removals
            wait_for(lambda: not (reclaimed & indexed()) and agree(), 30, "the reclaim indexed while e1 is idle")
        except AssertionError as exc:
            raise AssertionError(f"{exc}: {explain()}") from None
        print(f"reclaimed {len(reclaimed)} cached blocks; the indexer dropped them while e1 was idle")
        hog.close()
        hog = None

        # The next step publishes the queued BlockRemoved events.
        server.complete(tokens(20), max_tokens=1)  # type: ignore[arg-type]
        try:
            wait_for(agree if truth() else (lambda: indexed() == vllm_events.hashes() == set()), 30,
                     "the reclaim reaches the indexer after e1's next step")
        except AssertionError as exc:
            raise AssertionError(f"{exc}: {explain()}") from None
        assert not (reclaimed & indexed())
        # The indexer's prediction is vLLM's hit again, whatever the reclaim left.
        probe = shared + tokens(50)
        predicted = indexer.query(MODEL, probe).get(INSTANCE, 0)
        _, hits_before = server.prefix_cache()
        server.complete(probe, max_tokens=1)  # type: ignore[arg-type]
        _, hits_after = server.prefix_cache()
        assert hits_after - hits_before == predicted, explain()

        # A router asking for a gap older than the buffer gets what vLLM's own
        # publisher keeps: the newest batches, in order; the engine and the daemon go on.
        wait_for(agree, 30, "the probe indexed")
        seqs = [seq for seq, _ in replay_batches(replay, 0)]
        assert seqs == list(range(vllm_events.last_seq - BUFFER + 1, vllm_events.last_seq + 1))
        server.complete(tokens(2 * BLOCK + 5), max_tokens=1)  # type: ignore[arg-type]
        wait_for(agree, 30, "a request after the stale replay indexed")
        assert daemon.status()["engines"]
        print(f"test took {time.monotonic() - t_start:.1f} s")
    finally:
        for sub in (vllm_events, node_events):
            if sub is not None:
                sub.close()
        if hog is not None:
            hog.close()
        if server is not None:
            server.stop()
        if indexer is not None:
            indexer.stop()
        daemon.stop()


def test_dynamo_indexer_stays_exact_through_a_kill_and_warm_restart_and_a_daemon_restart(short_tmp, tiny_model):
    """kvelastic's moves stock vLLM never makes, each followed by the three
    views agreeing (the indexer's /dump, the daemon's journal, vLLM's events):

    The engine is registered with the indexer by ``kvelastic router``, as an
    operator runs it: Dynamo's indexer (1.6.1) does not resubscribe to an
    engine restarted on the same endpoint, so the router registers it again
    once it answers again; the indexer replays the new life from its start
    at the engine's next batch.

    1. ``kill -9`` of the engine and a new ``vllm serve`` of the same id and
       endpoints: the daemon kept the engine's valid cache; the new engine
       clears its old life's blocks and announces the blocks it adopts (token
       ids and parents from their labels; a replay from 0 shows them), so
       after its first request the indexer holds them and predicts the hit
       the restarted engine gives on them, which no request recomputed.
    2. ``kill -9`` of the daemon and a new one on the same socket: the engine
       keeps its cache and re-sends its index; nothing changes for the indexer.
    """
    why = available()
    if why:
        pytest.skip(f"Dynamo's indexer cannot run here: {why}")
    from kvelastic_tools.vllm_bench.route import router
    from tests.daemon_proc import DaemonProcess
    from tests.vllm.forked import ForkedServer

    tmp = short_tmp
    endpoint, replay = f"ipc://{tmp}/ev.sock", f"ipc://{tmp}/ev-replay.sock"
    flags = ["--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                               "endpoint": endpoint, "replay_endpoint": replay, "topic": "kv"})]
    env = {"KVELASTIC_ENABLE": "1", "KVELASTIC_ENGINE_ID": "e1", "KVELASTIC_METRICS_PORT": "0"}
    daemon = DaemonProcess(tmp, memory="32MiB").start()
    env["KVELASTIC_SOCKET"] = daemon.socket
    indexer = server = vllm_events = node_events = None
    routing = contextlib.ExitStack()
    rng = random.Random(11)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, 500) for _ in range(n)]

    def truth() -> set[int]:
        return {ext_hash(h) for h in node_events.model.blocks} if node_events else set()

    def agree() -> bool:
        t = truth()
        return bool(t) and dump_hashes(indexer.dump(), MODEL, INSTANCE) == vllm_events.hashes() == t

    def explain() -> str:
        t, d, v = truth(), dump_hashes(indexer.dump(), MODEL, INSTANCE), vllm_events.hashes()
        return f"daemon {len(t)}, indexer {len(d)}, vLLM events {len(v)}; indexer-daemon {len(d - t)}, " \
               f"daemon-indexer {len(t - d)}"

    def registered_again(base: str) -> float:
        from kvelastic_tools.vllm_bench.vllm_serve import counter, http_get

        return counter(http_get(base + "/metrics"), "kvelastic_router_registrations_total")

    def settle(what: str) -> None:
        try:
            wait_for(agree, 60, what)
        except AssertionError as exc:
            raise AssertionError(f"{exc}: {explain()}") from None

    try:
        indexer = DynamoIndexer(tmp / "indexer.log").start()
        node_events = Subscriber(f"ipc://{daemon.socket}.kv-events", topic=b"kv@e1@")
        server = ForkedServer(tiny_model, tmp / "vllm.log", flags=flags, env=env).start()
        vllm_events = Subscriber(endpoint)
        routing_base = routing.enter_context(
            router(tmp, indexer.loopback_url(), [f"{INSTANCE}={server.base},{endpoint},{replay}"]))
        wait_for_indexer_subscribed(indexer, endpoint)
        prompts = [tokens(3 * BLOCK + 10) for _ in range(4)]
        for prompt in prompts:
            server.complete(prompt, max_tokens=4)  # type: ignore[arg-type]
        settle("the first engine's blocks indexed")
        before = truth()

        # 1. kill -9 and a warm restart of the same engine.
        server.kill()
        wait_for(lambda: daemon.status()["orphans"], 30, "the daemon keeping e1's cache")
        port = server.port
        server = ForkedServer(tiny_model, tmp / "vllm-2.log", flags=flags, env=env)
        server.port, server.base = port, f"http://127.0.0.1:{port}"    # where the router knows it
        server.start()
        wait_for(lambda: registered_again(routing_base) >= 1, 30, "the router registering the engine again")
        # Every block kept and adopted, but those of a last step whose end the
        # daemon had not yet heard of when the engine died (the journal ships
        # every few ms: under load the last request's 3 blocks may miss it).
        kept = truth()
        assert kept <= before and len(kept) >= len(before) - 3, explain()
        before = kept
        # What a router that missed it all gets on replay: the new life from its start,
        # numbered above the old one's, clearing the old life, then the adopted blocks.
        batches = replay_batches(replay, 0)
        assert batches and batches[0][0] > 10**15           # wall-clock microseconds, not 0
        model = CacheModel()
        for _, payload in batches:
            model.apply(payload)
        assert model.counts["AllBlocksCleared"] == 1 and model.hashes() == before
        server.complete(tokens(2 * BLOCK + 5), max_tokens=2)  # type: ignore[arg-type]
        settle("the restarted engine's adopted blocks and first request indexed")
        assert len(truth()) == len(before) + 2, explain()
        before = truth()
        probe = prompts[1][:3 * BLOCK] + tokens(20)
        predicted = indexer.query(MODEL, probe).get(INSTANCE, 0)
        _, hits_before = server.prefix_cache()
        server.complete(probe, max_tokens=1)  # type: ignore[arg-type]
        _, hits_after = server.prefix_cache()
        assert hits_after - hits_before == predicted == 3 * BLOCK
        settle("the probe indexed")
        assert truth() == before, explain()     # the probe's blocks were all cached: nothing new

        # 2. kill -9 of the daemon and a new daemon on the same socket.
        daemon.kill()
        node_events.close()
        node_events = None
        daemon.start()
        # Replayed from the start: the engine may re-send its index before this subscriber connects.
        node_events = Subscriber(f"ipc://{daemon.socket}.kv-events", topic=b"kv@e1@",
                                 replay_endpoint=f"ipc://{daemon.socket}.kv-events-replay")
        settle("the engine's index re-sent to the new daemon")
        assert truth() == before, explain()
        server.complete(tokens(2 * BLOCK + 5), max_tokens=2)  # type: ignore[arg-type]
        settle("a request after the daemon restart indexed")
    finally:
        routing.close()
        for sub in (vllm_events, node_events):
            if sub is not None:
                sub.close()
        if server is not None:
            server.stop()
        if indexer is not None:
            indexer.stop()
        daemon.stop()


def test_dynamo_indexer_stays_exact_through_a_hand_off_and_an_invalidation(short_tmp, tiny_model):
    """Two replicas of the model on one daemon whose memory holds two slabs.

    1. Hand-off: ``e1`` fills both slabs with cache and idles; ``e2`` starts,
       and the slab it needs is ``e1``'s second one, whose cached blocks come
       along (same namespace). ``e1`` publishes their removal on its I/O
       thread's tick, ``e2`` their storage (token ids and parents from the
       blocks' labels) as it starts, before any router can subscribe: the
       indexer, registered once ``e2`` answers, replays them at ``e2``'s first
       batch. It then moves them from one worker to the other, and its
       prediction for ``e2`` is the hit ``e2`` reports on KV it never computed.
    2. ``kvelastic invalidate e2``: ``e2`` clears its index and publishes
       ``AllBlocksCleared``; the indexer forgets ``e2``'s blocks, keeps
       ``e1``'s, and ``e2`` hits nothing.
    """
    why = available()
    if why:
        pytest.skip(f"Dynamo's indexer cannot run here: {why}")
    from kvelastic import protocol as p
    from tests.daemon_proc import DaemonProcess
    from tests.vllm.forked import ForkedServer

    tmp = short_tmp
    rng = random.Random(13)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, 500) for _ in range(n)]

    daemon = DaemonProcess(tmp, memory="8MiB", KVELASTIC_IDLE_GRACE="1s").start()  # two slabs of 128 blocks
    indexer = None
    servers: dict[int, ForkedServer] = {}
    subs: list[Subscriber] = []
    node: dict[int, Subscriber] = {}
    events: dict[int, Subscriber] = {}

    def start(instance: int) -> ForkedServer:
        endpoint, replay = f"ipc://{tmp}/ev{instance}.sock", f"ipc://{tmp}/ev{instance}-replay.sock"
        cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint,
               "replay_endpoint": replay, "topic": "kv"}
        node[instance] = Subscriber(f"ipc://{daemon.socket}.kv-events", topic=f"kv@e{instance}@".encode())
        subs.append(node[instance])
        server = ForkedServer(tiny_model, tmp / f"vllm-{instance}.log", flags=["--kv-events-config", json.dumps(cfg)],
                            env={"KVELASTIC_ENABLE": "1", "KVELASTIC_SOCKET": daemon.socket,
                                 "KVELASTIC_ENGINE_ID": f"e{instance}", "KVELASTIC_METRICS_PORT": "0"})
        servers[instance] = server.start()
        events[instance] = Subscriber(endpoint, replay_endpoint=replay)   # from the engine's start
        subs.append(events[instance])
        indexer.register(instance, endpoint, MODEL, BLOCK, replay)
        wait_for_indexer_subscribed(indexer, endpoint)
        return server

    def truth(instance: int) -> set[int]:
        return {ext_hash(h) for h in node[instance].model.blocks}

    def views(instance: int) -> tuple[set[int], set[int], set[int]]:
        return truth(instance), dump_hashes(indexer.dump(), MODEL, instance), events[instance].hashes()

    def hittable(instance: int) -> set[int]:
        """The engine's cached blocks vLLM could hit: parents as e1 first stored them."""
        model = events[1].snapshot()
        return model.reachable(truth(instance))

    def agree(*instances: int) -> bool:
        """The indexer holds what the engine announced: every block it could
        hit and no block it does not cache (a handed-on block whose parent
        stayed behind is announced when the engine computes the parent again)."""
        return all(d == v and hittable(i) <= d <= t for i, (t, d, v) in zip(instances, map(views, instances)))

    def settle(what: str, *instances: int) -> None:
        try:
            wait_for(lambda: agree(*instances), 60, what)
        except AssertionError as exc:
            told = {i: tuple(len(s) for s in views(i)) for i in instances}
            raise AssertionError(f"{exc}: (daemon, indexer, vLLM events) per engine {told}") from None

    def hit(server: ForkedServer, prompt: list[int]) -> float:
        _, before = server.prefix_cache()
        server.complete(prompt, max_tokens=1)  # type: ignore[arg-type]
        return server.prefix_cache()[1] - before

    try:
        indexer = DynamoIndexer(tmp / "indexer.log").start()
        e1 = start(1)
        # Fill e1's first slab (it also holds vLLM's null block, so it never moves) and spill into the second.
        fillers = [tokens(30 * BLOCK) for _ in range(6)]
        for prompt in fillers:
            e1.complete(prompt, max_tokens=1)  # type: ignore[arg-type]
        wait_for(lambda: len(truth(1)) > 128, 60, "e1's cache in both slabs")
        settle("e1's blocks indexed", 1)
        before = truth(1)

        # 1. e2's demand takes e1's second slab with its cache.
        e2 = start(2)
        wait_for(lambda: truth(2) & before, 60, "e1's cached blocks handed on to e2 (daemon stream)")
        moved = truth(2) & before
        assert not (moved & truth(1)) and truth(1) | moved == before, "a handed-on block stays on one engine"
        e2.complete(tokens(2 * BLOCK + 5), max_tokens=1)  # type: ignore[arg-type]
        settle("the hand-off indexed: out of e1, into e2", 1, 2)
        assert len(truth(2) - moved) == 2
        assert views(1)[1] == truth(1)
        waiting = truth(2) - views(2)[1]
        print(f"{len(moved)} blocks handed on; {len(waiting)} wait for a parent that stayed with e1")
        # A filler whose first block went to e2: the indexer credits e2, and e2 hits on it.
        probe = next(f for f in fillers if indexer.query(MODEL, f).get(2, 0) >= BLOCK) + tokens(5)
        predicted = indexer.query(MODEL, probe)[2]
        assert hit(e2, probe) == predicted
        settle("e2's probe indexed", 1, 2)
        # e2 computes the head of a chain whose tail it adopted: the tail is announced, and hit.
        chain = events[1].snapshot().chain

        def blocks_of(prompt: list[int]) -> list[int]:
            out, parent = [], None
            for i in range(len(prompt) // BLOCK):
                parent = chain[(parent, tuple(prompt[i * BLOCK:(i + 1) * BLOCK]))]
                out.append(parent)
            return out

        split = next(f for f in fillers if set(blocks_of(f)) & waiting)
        assert hit(e2, split + tokens(5)) < len(split)          # the head is computed again
        settle("the adopted tail announced after its head", 1, 2)
        assert views(2)[1] == truth(2) >= set(blocks_of(split))
        assert hit(e2, split + tokens(5)) == len(split)

        # 2. The operator invalidates e2's cache; e1's stays.
        kept = truth(1)
        assert daemon.request(p.Invalidate(target="e2")).engines == 1
        wait_for(lambda: not truth(2) and agree(1, 2), 60, "e2's cache invalidated, indexed while e2 idles")
        assert truth(1) == kept and events[2].snapshot().counts["AllBlocksCleared"] >= 1
        assert 2 not in indexer.query(MODEL, probe)
        assert hit(e2, probe) == 0
        settle("e2's first request after the invalidation indexed", 1, 2)
    finally:
        for sub in subs:
            sub.close()
        for server in servers.values():
            server.stop()
        if indexer is not None:
            indexer.stop()
        daemon.stop()
