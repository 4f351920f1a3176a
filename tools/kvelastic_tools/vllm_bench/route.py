"""``kvelastic bench route``: KV-aware routing against round-robin, across two nodes.

Two "nodes" on this machine: two kvelastic daemons (host backend), each with
two real ``vllm serve`` engines of the tiny model through the plugin, every
engine publishing vLLM's own KV events. Dynamo's KV indexer (in a network
namespace of its own, ``dynamo_indexer``) is registered by ``kvelastic
router`` exactly as docs/kv-events.md tells an operator. The same shape of
workload (``route_load``: tenants, system prompts, multi-turn users; fresh
tokens per mode) runs through the router twice:

- ``round_robin``: ``kvelastic router --policy round-robin``;
- ``kv``: ``kvelastic router --policy kv`` (the longest indexed prefix, ties by load).

Per mode: vLLM's prefix-cache hit rate (every engine's counters), prefill
tokens (prompt tokens not served from cache), TTFT p50/p99 (client side,
streaming). In the kv mode an *oracle* that reads every engine's real cache
(the daemons' node streams: what each engine's core pool holds, named by the
token chains of vLLM's events) is asked before each request what the best
engine holds: the router's hit rate is compared with the oracle's, and each
choice with the oracle's best engines. Between the modes the engines' prefix
caches are reset. Targets (issue 23): hit rate at least 0.9 of the oracle's,
TTFT p99 at most 0.5x round-robin's.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

from kvelastic_tools.figures import percentile
from kvelastic_tools.vllm_bench import route_load as load
from kvelastic_tools.vllm_bench import vllm_serve
from kvelastic_tools.vllm_bench.elastic import daemon
from kvelastic_tools.vllm_bench.kv_events import Subscriber, ext_hash, wait_for

MiB = 1 << 20
BLOCK = 32                 # vllm_serve.SERVE_FLAGS' --block-size
MODEL = "tiny"
NODES = ("a", "b")
ENGINES_PER_NODE = 2
NODE_MEMORY = 96 * MiB
TARGETS = {"hit_rate_vs_oracle_min": 0.9, "ttft_p99_ratio_max": 0.5}


class Cluster:
    """Two daemons, four engines, their event subscribers and the indexer."""

    def __init__(self, folder: pathlib.Path, model: pathlib.Path, per_node: int = ENGINES_PER_NODE,
                 shared_secret: bool = True, command: list[str] | None = None,
                 popen: Callable[..., Any] = subprocess.Popen) -> None:
        self.folder, self.model, self.per_node, self.shared_secret = folder, model, per_node, shared_secret
        self.command = command                                 # the `vllm` command (None: VllmServer's)
        self.popen = popen                                     # how a server is started (VllmServer's popen)
        self.engines: dict[int, vllm_serve.VllmServer] = {}   # instance id -> server
        self.names: dict[int, str] = {}                       # instance id -> kvelastic engine id
        self.events: dict[int, tuple[str, str]] = {}          # instance id -> (endpoint, replay)
        self.vllm_streams: dict[int, Subscriber] = {}          # what each engine's vLLM publishes
        self.node_streams: dict[int, Subscriber] = {}          # what each engine's core pool holds (daemon)

    @contextlib.contextmanager
    def up(self) -> Iterator[Cluster]:
        from kvelastic_tools.vllm_bench.dynamo_indexer import DynamoIndexer

        with contextlib.ExitStack() as stack:
            self.indexer = DynamoIndexer(self.folder / "indexer.log").start()
            stack.callback(self.indexer.stop)
            self.indexer_url = self.indexer.loopback_url()
            instance = 0
            first_secret: pathlib.Path | None = None
            for node in NODES:
                nf = self.folder / node
                nf.mkdir()
                if first_secret is not None and self.shared_secret:
                    # Every node hashes a prefix alike (docs/kv-events.md): the first node's
                    # hash secret, copied before this daemon starts, as an operator would.
                    shutil.copy2(first_secret, nf / first_secret.name)
                sock, _, _ = stack.enter_context(daemon(nf, NODE_MEMORY))
                first_secret = first_secret or pathlib.Path(sock + ".hash-secret")
                for j in range(self.per_node):
                    instance += 1
                    name = f"{node}{j + 1}"
                    endpoint, replay = f"ipc://{nf}/{name}.ev", f"ipc://{nf}/{name}.replay"
                    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint,
                           "replay_endpoint": replay, "topic": f"kv@{name}@{MODEL}"}
                    self.node_streams[instance] = Subscriber(f"ipc://{sock}.kv-events", topic=f"kv@{name}@".encode())
                    stack.callback(self.node_streams[instance].close)
                    server = vllm_serve.VllmServer(
                        self.model, nf / f"vllm-{name}.log", flags=["--kv-events-config", json.dumps(cfg)],
                        command=self.command, popen=self.popen,
                        env={"KVELASTIC_ENABLE": "1", "KVELASTIC_SOCKET": sock, "KVELASTIC_ENGINE_ID": name,
                             "KVELASTIC_METRICS_PORT": "0", "VLLM_SERVER_DEV_MODE": "1"})
                    stack.callback(server.stop)
                    server.start(timeout=300)   # one after the other: on 2 cores starts starve each other
                    self.vllm_streams[instance] = Subscriber(endpoint)
                    stack.callback(self.vllm_streams[instance].close)
                    self.engines[instance], self.names[instance] = server, name
                    self.events[instance] = (endpoint, replay)
            yield self

    # ------------------------------------------------------------- truth
    def held(self, instance: int) -> set[int]:
        """The engine's cached blocks per the daemon, as vLLM's 64-bit event hashes."""
        return {ext_hash(h) for h in self.node_streams[instance].hashes()}

    def oracle(self, prompt: list[int]) -> tuple[int, frozenset[int]]:
        held = {i: self.vllm_streams[i].held_prefix(prompt, BLOCK, self.held(i)) for i in self.engines}
        best = max(held.values())
        return best, frozenset(i for i, n in held.items() if n == best)

    def indexed(self, instance: int) -> set[int]:
        from kvelastic_tools.vllm_bench.kv_events import dump_hashes

        return dump_hashes(self.indexer.dump(), MODEL, instance)

    def views(self) -> dict[int, tuple[set[int], set[int], set[int]]]:
        """Per engine: (the indexer's blocks, vLLM's events', the daemon's)."""
        from kvelastic_tools.vllm_bench.kv_events import dump_hashes

        dump = self.indexer.dump()
        return {i: (dump_hashes(dump, MODEL, i), self.vllm_streams[i].hashes(), self.held(i)) for i in self.engines}

    def settled(self) -> bool:
        """The indexer holds exactly each engine's real cache, and vLLM's events agree."""
        return all(a == b == c for a, b, c in self.views().values())

    def exactness(self, timeout: float = 30.0) -> dict[str, Any]:
        """Whether the indexer came to hold each engine's real cache, and if not, how far off."""
        try:
            wait_for(self.settled, timeout, "the indexer equal to every engine's cache")
        except AssertionError:
            pass
        out: dict[str, Any] = {"exact": True}
        views = self.views()
        for i, (indexed, published, held) in views.items():
            # Blocks the indexer files under this engine with the hash another engine gave the
            # same tokens (engines of two daemons hash with two seeds; /dump names one per node).
            others = set().union(*(v[2] for j, v in views.items() if j != i))
            if not indexed == published == held:
                out["exact"] = False
            out[self.names[i]] = {"indexer": len(indexed), "vllm_events": len(published), "daemon": len(held),
                                  "indexer_not_daemon": len(indexed - held), "daemon_not_indexer": len(held - indexed),
                                  "indexer_not_daemon_held_by_another": len((indexed - held) & others),
                                  "events_not_daemon": len(published - held),
                                  "daemon_not_events": len(held - published)}
        return out

    def counters(self) -> dict[int, tuple[float, float]]:
        return {i: s.prefix_cache() for i, s in self.engines.items()}

    def reset_caches(self) -> None:
        for server in self.engines.values():
            req = urllib.request.Request(server.base + "/reset_prefix_cache", b"", method="POST")
            with urllib.request.urlopen(req, timeout=30) as r:
                r.read()

    # ------------------------------------------------------------ router
    def router(self, policy: str) -> contextlib.AbstractContextManager[str]:
        engines = [f"{i}={s.base},{self.events[i][0]},{self.events[i][1]}" for i, s in self.engines.items()]
        return router(self.folder, self.indexer_url, engines, policy)


@contextlib.contextmanager
def router(folder: pathlib.Path, indexer_url: str, engines: list[str], policy: str = "kv") -> Iterator[str]:
    """A ``kvelastic router`` process (``--engine`` values as given); yields its base URL."""
    port = vllm_serve.free_port()
    cmd = [sys.executable, "-m", "kvelastic", "router", "--listen", f"127.0.0.1:{port}",
           "--indexer", indexer_url, "--model", MODEL, "--block-size", str(BLOCK), "--policy", policy,
           *[a for e in engines for a in ("--engine", e)]]
    log_path = folder / f"router-{policy}.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _healthy(base) or proc.poll() is not None, 30, "the router's /health")
        if proc.poll() is not None:
            raise RuntimeError(f"kvelastic router exited:\n{log_path.read_text()}")
        yield base
    finally:
        proc.terminate()
        proc.wait(10)


def _healthy(base: str) -> bool:
    try:
        return bool(vllm_serve.http_get(base + "/health", 1.0))
    except OSError:
        return False


def _ms(values: list[float], q: float) -> float | None:
    return round(percentile(values, q) * 1e3, 1) if values else None


def run_mode(cluster: Cluster, policy: str, conv: load.Conversations, oracle: bool) -> dict[str, Any]:
    before = cluster.counters()
    with cluster.router(policy) as base:
        turns = load.run_conversations(base, conv, cluster.oracle if oracle else None)
    after = cluster.counters()
    queries = sum(after[i][0] - before[i][0] for i in after)
    hits = sum(after[i][1] - before[i][1] for i in after)
    ok = [t for t in turns if not t.error]
    ttft = [t.ttft for t in ok if t.ttft is not None]
    out: dict[str, Any] = {
        "requests": len(turns), "errors": [t.error for t in turns if t.error][:5],
        "prompt_tokens": int(queries), "hit_tokens": int(hits), "prefill_tokens": int(queries - hits),
        "hit_rate": round(hits / queries, 4) if queries else None,
        "ttft_p50_ms": _ms(ttft, 0.5), "ttft_p99_ms": _ms(ttft, 0.99),
        "per_engine": {cluster.names[i]: sum(1 for t in turns if t.engine == i) for i in cluster.engines},
    }
    if oracle:
        prompt = sum(t.prompt_tokens for t in ok)
        out["oracle_hit_rate"] = round(sum(t.oracle for t in ok) / prompt, 4) if prompt else None
        out["choices_matching_oracle"] = sum(1 for t in ok if t.engine in t.oracle_best)
    return out


def run(quick: bool = False, workdir: str | None = None) -> dict[str, Any]:
    from kvelastic_tools.vllm_bench.dynamo_indexer import available
    from kvelastic_tools.vllm_bench.tinymodel import build_tiny_llama

    why = available()
    if why:
        raise RuntimeError(f"bench route needs Dynamo's KV indexer: {why} (make setup installs ai-dynamo-runtime)")
    shape = load.QUICK if quick else load.FULL
    folder = pathlib.Path(workdir or tempfile.mkdtemp(prefix="kvroute-", dir="/tmp"))  # short ipc:// paths
    started = time.monotonic()
    try:
        model = build_tiny_llama(folder / "tiny-llama")
        with Cluster(folder, model).up() as cluster:
            cluster_start = round(time.monotonic() - started, 1)
            rr = run_mode(cluster, "round-robin", load.make_conversations(shape, seed=1), oracle=False)
            cluster.reset_caches()
            wait_for(lambda: all(not cluster.held(i) for i in cluster.engines), 30, "the prefix caches reset")
            kv = run_mode(cluster, "kv", load.make_conversations(shape, seed=2), oracle=True)
            exact = cluster.exactness()
    finally:
        if not os.environ.get("KVELASTIC_BENCH_KEEP"):
            shutil.rmtree(folder, ignore_errors=True)
    hit_vs_oracle = round(kv["hit_rate"] / kv["oracle_hit_rate"], 4) \
        if kv["hit_rate"] is not None and kv["oracle_hit_rate"] else None
    ttft_ratio = round(kv["ttft_p99_ms"] / rr["ttft_p99_ms"], 4) if kv["ttft_p99_ms"] and rr["ttft_p99_ms"] else None
    return {
        "benchmark": "route", "quick": quick, "shape": vars(shape), "nodes": len(NODES),
        "engines": len(NODES) * ENGINES_PER_NODE, "cluster_start_seconds": cluster_start,
        "round_robin": rr, "kv": kv, "indexer_exact": exact,
        "hit_rate_vs_oracle": hit_vs_oracle, "ttft_p99_ratio": ttft_ratio,
        "prefill_tokens_ratio": round(kv["prefill_tokens"] / rr["prefill_tokens"], 4) if rr["prefill_tokens"] else None,
        "targets": TARGETS,
        "targets_met": {
            "hit_rate_vs_oracle": hit_vs_oracle is not None and hit_vs_oracle >= TARGETS["hit_rate_vs_oracle_min"],
            "ttft_p99_ratio": ttft_ratio is not None and ttft_ratio <= TARGETS["ttft_p99_ratio_max"]},
        "seconds": round(time.monotonic() - started, 1),
    }
