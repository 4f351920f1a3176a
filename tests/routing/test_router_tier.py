"""``kvelastic router`` credits a prefix held in a node's tier to that node's engines.

Two "nodes" on this machine: daemon ``a`` with a tier (and a 1 s kept-cache
TTL, so a departed engine's cache reaches the tier at once) and daemon ``b``
without one, sharing one hash secret (docs/kv-events.md); real ``vllm
serve`` engines through the plugin with vLLM's KV events on; Dynamo's
indexer; ``kvelastic router`` with ``--tier`` for node a's tier stream.

An engine ``a0`` of node a, outside the router, serves two prompts and
exits: its kept cache expires into a's tier, which publishes it on the tier
stream. Then, with the router's engines being ``b1`` (engine 1, node b) and
``a1`` (engine 2, node a, started after a0 left, the tier connector on),
neither holding anything:

- a prompt held only in a's tier goes to a1 (without the tier's credit it is
  a tie, and a tie goes to engine 1 first), the router claims its full blocks
  as tier tokens, and a1 reports exactly those as cached: it loaded them;
- a prompt held in b1's device memory and in a's tier goes to b1, even
  where the round-robin turn is a1's (a device hit beats a load).
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import random
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from typing import Any

import pytest

from kvelastic_tools.vllm_bench.dynamo_indexer import DynamoIndexer, available
from kvelastic_tools.vllm_bench.kv_events import wait_for

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BLOCK = 32          # vllm_serve.SERVE_FLAGS' --block-size
MODEL = "tiny"      # its --served-model-name
TIER = 100          # node a's tier stream's worker id in the indexer
PROMPT = 6 * BLOCK + 8   # six full blocks


def _subscribed(indexer: DynamoIndexer, endpoint: str) -> bool:
    """Whether the indexer's subscriber is connected to ``endpoint`` (an
    ``ipc://`` path), from the kernel's table of AF_UNIX sockets in its namespace."""
    path = " " + endpoint.removeprefix("ipc://")
    assert indexer.proc is not None
    with open(f"/proc/{indexer.proc.pid}/net/unix") as table:
        return any(line.rstrip().endswith(path) and line.split()[5] == "03" for line in table)


def _route(base: str, prompt: list[int]) -> tuple[int, int, int, int]:
    """A completion through the router: (engine, matched tokens, tier tokens) it
    decided, and the tokens the engine reports cached."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    req = urllib.request.Request(base + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        headers = resp.headers
        reply = json.loads(resp.read())
    cached = (reply["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return (int(headers["x-kvelastic-engine"]), int(headers["x-kvelastic-matched-tokens"]),
            int(headers["x-kvelastic-tier-tokens"]), int(cached))


@contextlib.contextmanager
def _router(folder: pathlib.Path, indexer_url: str, args: list[str]):
    from kvelastic_tools.vllm_bench.vllm_serve import free_port, http_get

    port = free_port()
    cmd = [sys.executable, "-m", "kvelastic", "router", "--listen", f"127.0.0.1:{port}", "--indexer", indexer_url,
           "--model", MODEL, "--block-size", str(BLOCK), *args]
    log_path = folder / "router.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"

    def up() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"kvelastic router exited:\n{log_path.read_text()}")
        try:
            return bool(http_get(base + "/health", 1.0))
        except OSError:
            return False

    try:
        wait_for(up, 30, "the router's /health")
        yield base
    finally:
        proc.terminate()
        proc.wait(10)


def test_router_sends_a_prefix_held_in_a_nodes_tier_to_that_nodes_engine(tmp_path_factory):
    why = available()
    if why:
        pytest.skip(f"Dynamo's indexer cannot run here: {why}")
    from kvelastic_tools.vllm_bench.tinymodel import build_tiny_llama
    from kvelastic_tools.vllm_bench.vllm_serve import counter, http_get
    from tests.daemon_proc import DaemonProcess
    from tests.vllm.forked import ForkedServer
    from tests.vllm.tier_run import TIER_CONNECTOR

    model = build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")
    folder = pathlib.Path(tempfile.mkdtemp(prefix="kvrt-", dir="/tmp"))     # short ipc:// paths
    rng = random.Random(43)
    held_in_tier = [rng.randrange(3, 500) for _ in range(PROMPT)]
    also_on_b1 = [rng.randrange(3, 500) for _ in range(PROMPT)]
    tier_tokens = PROMPT // BLOCK * BLOCK

    def engine(node: DaemonProcess, name: str, tier_connector: bool = False) -> tuple[ForkedServer, str]:
        events = f"ipc://{folder}/{name}.ev"
        cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": events,
               "replay_endpoint": f"ipc://{folder}/{name}.replay", "topic": f"kv@{name}@{MODEL}"}
        flags = ["--kv-events-config", json.dumps(cfg), "--enable-prompt-tokens-details"]
        if tier_connector:
            flags += ["--kv-transfer-config", json.dumps(TIER_CONNECTOR)]
        server = ForkedServer(model, folder / f"vllm-{name}.log", flags=flags,
                              env={"KVELASTIC_ENABLE": "1", "KVELASTIC_SOCKET": node.socket,
                                   "KVELASTIC_ENGINE_ID": name, "KVELASTIC_METRICS_PORT": "0"})
        return server, events

    def indexed(prompt: list[int]) -> dict[str, Any]:
        status, reply = indexer.query_raw("/query", {"model_name": MODEL, "token_ids": prompt})
        assert status == 200, reply
        return reply

    def tier_match(prompt: list[int]) -> int:
        return int(indexed(prompt).get("instances", {}).get(str(TIER), {}).get("disk", 0))

    def device_match(prompt: list[int], worker: int) -> int:
        return int(indexed(prompt)["scores"].get(str(worker), {}).get("0", 0))

    try:
        with contextlib.ExitStack() as stack:
            (folder / "a").mkdir()
            (folder / "b").mkdir()
            (folder / "tier").mkdir(mode=0o700)
            a = DaemonProcess(folder / "a", memory="96MiB", KVELASTIC_TIER_DIR=str(folder / "tier"),
                              KVELASTIC_TIER_SIZE="256MiB", KVELASTIC_ORPHAN_CACHE_TTL="1s").start()
            stack.callback(a.stop)
            # Every node hashes a prefix alike: a's hash secret, copied before b starts.
            shutil.copy2(a.socket + ".hash-secret", folder / "b" / "kvelastic.sock.hash-secret")
            b = DaemonProcess(folder / "b", memory="96MiB").start()
            stack.callback(b.stop)
            indexer = DynamoIndexer(folder / "indexer.log").start()
            stack.callback(indexer.stop)

            b1, b1_events = engine(b, "b1")
            stack.callback(b1.stop)
            b1.start()
            a1, a1_events = engine(a, "a1", tier_connector=True)     # started once a0 has gone
            stack.callback(a1.stop)
            a1_replay = a1_events.replace(".ev", ".replay")
            b1_replay = b1_events.replace(".ev", ".replay")
            tier = f"ipc://{a.socket}.kv-tier"
            base = stack.enter_context(_router(folder, indexer.loopback_url(), [
                "--engine", f"1={b1.base},{b1_events},{b1_replay}",
                "--engine", f"2={a1.base},{a1_events},{a1_replay}",
                "--tier", f"{TIER}=2,{tier},{tier}-replay"]))
            assert json.loads(http_get(base + "/health"))["tiers"] == {str(TIER): [2]}
            wait_for(lambda: _subscribed(indexer, tier), 30, "the indexer subscribed to node a's tier stream")
            wait_for(lambda: _subscribed(indexer, b1_events), 30, "the indexer subscribed to b1")

            # a0 (no engine of the router's) fills node a's tier, then leaves.
            a0, _ = engine(a, "a0")
            a0.start()
            try:
                for prompt in (held_in_tier, also_on_b1):
                    a0.complete(prompt, max_tokens=2)  # type: ignore[arg-type]
                # The daemon has heard of every block before a0 goes (its journal ships them every
                # few ms: a block it has not heard of when the engine leaves is not kept).
                wait_for(lambda: sum(e["cached_blocks"] for e in a.status()["engines"]) == 2 * tier_tokens // BLOCK,
                         30, "a0's 12 blocks in its daemon's books")
            finally:
                a0.stop()
            try:
                wait_for(lambda: tier_match(held_in_tier) == tier_match(also_on_b1) == tier_tokens, 120,
                         "a0's blocks in node a's tier, as the indexer's tier worker")
            except AssertionError as exc:
                raise AssertionError(f"{exc}: the tier {a.status().get('tier')}, the indexer's tier worker "
                                     f"{indexed(held_in_tier)}, {indexed(also_on_b1)}") from None

            a1.start()
            wait_for(lambda: counter(http_get(base + "/metrics"), "kvelastic_router_registrations_total") >= 1, 30,
                     "the router registering a1 once it answers")
            wait_for(lambda: _subscribed(indexer, a1_events), 30, "the indexer subscribed to a1")
            # Nobody holds either prompt in device memory: only the tier's credit tells the engines apart.
            assert device_match(held_in_tier, 1) == device_match(held_in_tier, 2) == 0

            # 1. Held only in a's tier: to a1 (a tie would go to engine 1, b1), which loads it.
            promoted = a.status()["tier"]["counters"].get("promotions", 0)
            assert _route(base, held_in_tier) == (2, 0, tier_tokens, tier_tokens)
            assert a.status()["tier"]["counters"]["promotions"] - promoted == tier_tokens // BLOCK

            # 2. Held in b1's device memory and in a's tier: to b1, also when a tie would go to a1.
            b1.complete(also_on_b1, max_tokens=2)  # type: ignore[arg-type]
            wait_for(lambda: device_match(also_on_b1, 1) == tier_tokens, 30, "b1's blocks indexed")
            unheld = [rng.randrange(3, 500) for _ in range(PROMPT)]
            assert _route(base, unheld)[0] == 1     # a tie, to engine 1: the next tie's turn is engine 2's
            assert _route(base, also_on_b1) == (1, tier_tokens, 0, tier_tokens)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
