"""Routers see the tier: in a real daemon process, a departed engine's kept
cache demoted into the tier is published as ``BlockStored`` with the medium
``STORAGE`` (the engine's own labels: vLLM's hashes, parents, token ids),
under the tier's pseudo-engine (topic ``kv@@NAMESPACE``) on the tier stream
(and on the node stream as its engines' blocks are: keys, no token ids);
``kvelastic invalidate`` publishes their ``BlockRemoved`` on both; a restarted
daemon publishes the blocks it rebuilt from disk (their labels are kept in
the files). Dynamo's
indexer, registered for the tier stream as a worker of its own, scores a
prefix held only in the tier there, on its disk tier; another user cannot
read the tier stream."""

from __future__ import annotations

import os
import subprocess
import sys

import msgspec
import pytest
import zmq

from kvelastic.daemon.events import END_SEQ
from kvelastic.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from tests.daemon.engines import EngineProcess
from tests.daemon_proc import DaemonProcess, short_dir, wait_for
from tests.tier.labelled_peer import BLOCK_TOKENS, published, tokens

pytestmark = pytest.mark.skipif(__import__("tests.backend").backend.TEST_BACKEND != "host",
                                reason="demotion source A reads memfd pages: host backend")

KEEP = {"grace": 60, "journal_interval": 3600}
TOPIC = b"kv@@llama-1"


class LabelledEngine(EngineProcess):
    """``peer.py`` with labelled keys (``labelled_peer.py``)."""

    def __init__(self, socket: str, engine_id: str, **cfg) -> None:
        import json

        self.engine_id, self.role = engine_id, "engine"
        cfg.update(socket=socket, engine_id=engine_id, user=None, vllm_keys=True)
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.tier.labelled_peer", json.dumps(cfg)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready = self.proc.stdout.readline()
        assert ready and json.loads(ready)["ready"], f"engine {engine_id} did not start"


def keys(prefix: str, n: int) -> list[bytes]:
    import hashlib

    return [hashlib.sha256(f"{prefix}-{i}".encode()).digest() + bytes(4) for i in range(n)]


def replay(endpoint: str) -> list[tuple[bytes, KVEventBatch]]:
    """Every batch the stream kept, through its replay socket (vLLM's protocol)."""
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        out = []
        while True:
            assert sock.poll(5000), "no replay answer"
            _, topic, seq, payload = sock.recv_multipart()
            if seq == END_SEQ:
                return out
            out.append((topic, decoder.decode(payload)))
    finally:
        sock.close(0)


def tier_events(endpoint: str) -> list:
    return [e for topic, batch in replay(endpoint) if topic == TOPIC for e in batch.events]


def run(daemon: DaemonProcess, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvelastic", *args], env=daemon.env, capture_output=True,
                          text=True, timeout=30)


def demoted(tmp_path, on_tier_stream=None, **env):
    """A daemon whose tier holds engine ``a``'s four blocks of prefix ``sys``
    (its kept cache, expired); ``on_tier_stream(endpoint)`` is called first
    (the default ipc endpoint); ``env``: more of the daemon's settings."""
    folder = short_dir(tmp_path) / "tier"
    folder.mkdir(mode=0o700)
    daemon = DaemonProcess(tmp_path, memory="8MiB", KVELASTIC_TIER_DIR=str(folder), KVELASTIC_TIER_SIZE="64MiB",
                           KVELASTIC_ORPHAN_CACHE_TTL="1s", **env).start()
    if on_tier_stream is not None:
        on_tier_stream(f"ipc://{daemon.socket}.kv-tier")
    a = LabelledEngine(daemon.socket, "a", namespace="llama-1", ppw=2, bps=4, **KEEP)
    try:
        assert a.do("ensure", n=4)["ok"]
        step = a.do("step")["step"]
        assert a.do("alloc", n=4)["ok"]
        a.do("cache", prefix="sys")
        a.do("seal")
        a.do("end_step", n=step)
        a.do("free")
        a.do("flush")
        a.kill()
        wait_for(lambda: daemon.status()["tier"]["blocks"] == 4 and daemon.status()["tier"]["writing"] == 0,
                 timeout=10, what="a's kept cache demoted and written")
    finally:
        a.close()
    return daemon


def test_tier_blocks_are_published_stored_and_removed(tmp_path):
    daemon = demoted(tmp_path)
    node, tier = f"ipc://{daemon.socket}.kv-events-replay", f"ipc://{daemon.socket}.kv-tier-replay"
    try:
        want = [published(k) for k in keys("sys", 4)]
        prompt = tokens("sys", 4)
        stored = tier_events(tier)
        assert all(isinstance(e, BlockStored) and e.medium == "STORAGE" for e in stored), stored
        assert [e.block_hashes[0] for e in stored] == want            # parents first
        assert [e.parent_block_hash for e in stored] == [None, *want[:-1]]
        assert [t for e in stored for t in e.token_ids] == prompt
        assert all(e.block_size == BLOCK_TOKENS and e.group_idx == 0 for e in stored)
        # The node stream: as its engines' blocks, the keys (less the group id), no token ids.
        stored = tier_events(node)
        assert all(isinstance(e, BlockStored) and e.medium == "STORAGE" and not e.token_ids for e in stored)
        assert [e.block_hashes[0] for e in stored] == [k[:-4] for k in keys("sys", 4)]
        # The tier stream holds the tier's blocks alone, numbered on their own.
        assert {topic for topic, _ in replay(tier)} == {b"kv@@", TOPIC}
        assert isinstance(replay(tier)[0][1].events[0], AllBlocksCleared)

        done = run(daemon, "invalidate", "llama-1")
        assert done.returncode == 0, done.stderr
        wait_for(lambda: daemon.status()["tier"]["blocks"] == 0, what="the tier's blocks invalidated")
        for endpoint, hashes in ((tier, want), (node, [k[:-4] for k in keys("sys", 4)])):
            def removed(endpoint=endpoint):
                return [h for e in tier_events(endpoint) if isinstance(e, BlockRemoved) for h in e.block_hashes]
            wait_for(lambda hashes=hashes: sorted(removed()) == sorted(hashes),
                     what="the tier's blocks published removed")
            assert all(e.medium == "STORAGE" for e in tier_events(endpoint) if isinstance(e, BlockRemoved))
    finally:
        daemon.stop()


def test_a_restarted_daemon_publishes_the_blocks_it_rebuilt_from_disk(tmp_path):
    """The labels are kept on disk with the blocks: a new daemon on the same
    tier publishes what it rebuilt as the first one published it."""
    daemon = demoted(tmp_path)
    tier = f"ipc://{daemon.socket}.kv-tier-replay"
    try:
        before = [e for e in tier_events(tier) if isinstance(e, BlockStored)]
        daemon.stop()
        daemon.start()
        assert daemon.status()["tier"]["blocks"] == 4
        after = tier_events(tier)
        assert isinstance(replay(tier)[0][1].events[0], AllBlocksCleared)     # a new stream
        assert after == before and len(after) == 4                            # parents first, as before
        assert [e.block_hashes[0] for e in after] == [published(k) for k in keys("sys", 4)]
        assert [t for e in after for t in e.token_ids] == tokens("sys", 4)
        node = [e for e in tier_events(f"ipc://{daemon.socket}.kv-events-replay") if isinstance(e, BlockStored)]
        assert [e.block_hashes[0] for e in node] == [k[:-4] for k in keys("sys", 4)]
    finally:
        daemon.stop()


def test_dynamos_indexer_scores_a_prefix_held_only_in_the_tier(tmp_path):
    from kvelastic_tools.vllm_bench.dynamo_indexer import DynamoIndexer, available

    why = available()
    if why:
        pytest.skip(why)
    indexer = DynamoIndexer(short_dir(tmp_path) / "indexer.log").start()
    TIER_WORKER = 7

    def register(endpoint: str) -> None:
        indexer.register(TIER_WORKER, endpoint, "tiny", BLOCK_TOKENS, replay_endpoint=endpoint + "-replay")
        path = " " + endpoint.removeprefix("ipc://")

        def subscribed() -> bool:
            with open(f"/proc/{indexer.proc.pid}/net/unix") as table:
                return any(line.rstrip().endswith(path) and line.split()[5] == "03" for line in table)

        wait_for(subscribed, 30, what="the indexer subscribed to the tier stream")

    def scores(prompt: list[int]) -> dict:
        status, reply = indexer.query_raw("/query", {"model_name": "tiny", "token_ids": prompt})
        assert status == 200, reply
        return reply.get("instances", {})

    daemon = None
    try:
        daemon = demoted(tmp_path, register)
        prompt = tokens("sys", 4) + [5]
        wait_for(lambda: scores(prompt).get(str(TIER_WORKER), {}).get("disk") == 4 * BLOCK_TOKENS, timeout=10,
                 what="the indexer scores the tier's prefix")
        tier = scores(prompt)[str(TIER_WORKER)]
        assert tier["gpu"] == 0 and tier["longest_matched"] == 4 * BLOCK_TOKENS, tier
        assert scores(tokens("new", 4)).get(str(TIER_WORKER), {}).get("disk", 0) == 0
        assert scores(tokens("sys", 2))[str(TIER_WORKER)]["disk"] == 2 * BLOCK_TOKENS

        assert run(daemon, "invalidate", "llama-1").returncode == 0
        wait_for(lambda: scores(prompt).get(str(TIER_WORKER), {}).get("disk", 0) == 0, timeout=10,
                 what="the indexer forgets the invalidated prefix")
    except BaseException:
        if os.environ.get("KVR_KEEP"):
            print(indexer.log()[-3000:])
        raise
    finally:
        if daemon is not None:
            daemon.stop()
        indexer.stop()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a process as another user")
def test_only_the_daemons_user_reads_the_tier_stream(tmp_path):
    """Its events carry tenants' token ids: a process of another user is
    refused by the socket itself (``IPC_FILTER_UID``), even one whose
    permissions on the socket file would let it connect."""
    import pathlib
    import shutil
    import tempfile

    from tests.daemon.hostile import tenant_script

    folder = pathlib.Path(tempfile.mkdtemp(prefix="kvelastic-tier-"))
    folder.chmod(0o755)
    (folder / "tier").mkdir(mode=0o700)
    daemon = DaemonProcess(folder, KVELASTIC_TIER_DIR=str(folder / "tier"), KVELASTIC_TIER_SIZE="64MiB").start()
    try:
        endpoint = f"{daemon.socket}.kv-tier-replay"
        os.chmod(endpoint, 0o777)
        assert replay(f"ipc://{endpoint}"), "the daemon's user reads it"
        code = (f"s = zmq.Context.instance().socket(zmq.DEALER); s.setsockopt(zmq.LINGER, 0)\n"
                f"s.connect('ipc://{endpoint}'); s.send_multipart([b'', bytes(8)])\n"
                f"print('answered' if s.poll(3000) else 'refused')\n")
        out = subprocess.run(tenant_script((6001, 6001), code, pathlib.Path(__file__).resolve().parents[2]),
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "refused"
    finally:
        daemon.stop()
        shutil.rmtree(folder, ignore_errors=True)
