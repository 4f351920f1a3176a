"""``kvelastic bench route``: KV-aware routing against round-robin, across two nodes.

Two "nodes" on this machine: two kvelastic daemons (host backend), each with
two real ``vllm serve`` engines of the tiny model through the plugin, every
engine publishing vLLM's own KV events. Dynamo's KV indexer (in a network
namespace of its own, ``dynamo_indexer``) is registered by ``kvelastic
router`` exactly as docs/kv-events.md tells an operator. The same shape of
workload (``route_load``: tenants, system prompts, users arriving in a closed
loop and holding multi-turn conversations; fresh tokens per mode and seed)
runs through the router in two modes, for each of three seeds (one in
``--quick``), the order of the modes alternating from seed to seed:

- ``round_robin``: ``kvelastic router --policy round-robin``;
- ``kv``: ``kvelastic router --policy kv`` (the least work to wait for: prompt
  not matched plus the engine's queue).

Each mode starts with every engine's prefix cache reset. Its warm-up (the
first turns of the first users: all at once, nothing cached) is reported
apart from the measured part (the rest, at least 400 requests in the full
run). Per part: prefix hit tokens (vLLM's ``cached_tokens`` per request),
prefill tokens (prompt tokens not served from cache), TTFT p50/p90/p99
(client side, streaming). The *oracle* is an upper bound by construction
(``route_oracle``: an unbounded cache with perfect placement, computed
offline from the trace), so a router's hit rate over the oracle's is at most
1. Per seed: the kv mode's hit rate against the oracle, and its TTFT over
round-robin's at p50, p90 and p99; over the seeds: min, median and max.
Targets (judged on the median over the seeds): hit rate at least
0.9 of the oracle's, TTFT p90 at most 0.6x round-robin's.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import statistics
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
TARGETS = {"hit_rate_vs_oracle_min": 0.9, "ttft_p90_ratio_max": 0.6}
SEEDS = (1, 2, 3)
QUICK_SEEDS = (1,)
MODES = ("round-robin", "kv")
QUANTILES = {"p50": 0.5, "p90": 0.9, "p99": 0.99}


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
                sock, _, _, _ = stack.enter_context(daemon(nf, NODE_MEMORY))
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
                        self.model, nf / f"vllm-{name}.log",
                        # per request, the prompt tokens served from cache (usage.prompt_tokens_details)
                        flags=["--kv-events-config", json.dumps(cfg), "--enable-prompt-tokens-details"],
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


# ------------------------------------------------------------------ figures
def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(x, nd)


def _div(a: float | None, b: float | None, nd: int = 4) -> float | None:
    return round(a / b, nd) if a is not None and b else None


def phase_figures(turns: list[load.Turn]) -> dict[str, Any]:
    """One part of a mode's run (its warm-up or its measured part)."""
    ok = [t for t in turns if not t.error]
    ttft = [t.ttft for t in ok if t.ttft is not None]
    prompt = sum(t.prompt_tokens for t in ok)
    reported = all(t.cached is not None for t in ok)
    hits = sum(t.cached or 0 for t in ok) if reported else None
    oracle = sum(t.bound for t in ok)
    out: dict[str, Any] = {
        "requests": len(turns), "errors": len(turns) - len(ok),
        "prompt_tokens": prompt, "hit_tokens": hits, "oracle_hit_tokens": oracle,
        "prefill_tokens": None if hits is None else prompt - hits,
        "hit_rate": _div(hits, prompt), "oracle_hit_rate": _div(oracle, prompt),
        "hit_rate_vs_oracle": _div(hits, oracle),
        # Requests that vLLM served more cached tokens than the bound allows: 0 unless the bound is wrong.
        "requests_over_oracle": sum(1 for t in ok if t.cached is not None and t.cached > t.bound),
        **shortfall(ok),
        **{f"ttft_{q}_ms": _r(percentile(ttft, f) * 1e3, 1) if ttft else None for q, f in QUANTILES.items()},
        "ttft_max_ms": _r(max(ttft) * 1e3, 1) if ttft else None,
        "seconds": _r(max(t.answered for t in turns) - min(t.sent for t in turns), 1) if turns else None,
    }
    return out


def shortfall(turns: list[load.Turn]) -> dict[str, int]:
    """Where the hits short of the oracle's went. ``not_routed``: the router did not claim them for
    the request (the engine it chose held less, as far as the indexer knew: placement, load, or what
    no engine held yet); ``not_cached``: it claimed them, the engine did not serve them (evicted, or
    the indexer was stale). ``first_turns``: the part lost on users' first turns (the system prompt)."""
    not_routed = not_cached = first = 0
    for t in turns:
        if t.cached is None:
            continue
        claimed = min(t.matched, t.bound)
        lost_cache = max(0, claimed - t.cached)
        lost_route = max(0, t.bound - t.cached - lost_cache)
        not_cached, not_routed = not_cached + lost_cache, not_routed + lost_route
        first += (lost_cache + lost_route) if t.turn == 0 else 0
    return {"short_of_oracle_tokens": not_routed + not_cached, "short_not_routed_tokens": not_routed,
            "short_not_cached_tokens": not_cached, "short_on_first_turns_tokens": first}


def mode_figures(turns: list[load.Turn], names: dict[int, str],
                 counters: dict[str, int] | None = None, seconds: float | None = None) -> dict[str, Any]:
    """A mode's run: ``route_oracle.bound`` over its whole trace, then its warm-up and measured parts."""
    from kvelastic_tools.vllm_bench.route_oracle import Seen, bound

    turns = sorted(turns, key=lambda t: t.sent)
    for t, b in zip(turns, bound([Seen(t.prompt, t.reply, t.sent, t.answered) for t in turns], BLOCK)):
        t.bound = b
    return {"warmup": phase_figures([t for t in turns if t.warmup]),
            "measured": phase_figures([t for t in turns if not t.warmup]),
            "per_engine": {name: sum(1 for t in turns if t.engine == i) for i, name in names.items()},
            # vLLM's own counters over the whole mode (warm-up and measured): a check on the per-request figures.
            "engine_counters": counters or {}, "seconds": seconds}


def spread(values: list[float | None]) -> dict[str, Any]:
    """min, median and max over the seeds (None where a seed has no figure)."""
    have = [v for v in values if v is not None]
    return {"min": min(have) if have else None, "median": _r(statistics.median(have)) if have else None,
            "max": max(have) if have else None, "runs": values}


def report(seeds: list[dict[str, Any]]) -> dict[str, Any]:
    """Ratios per seed, their spread, the targets. ``seeds``: per seed, ``{"seed", "round_robin", "kv"}``
    with each mode's ``mode_figures``."""
    for run in seeds:
        rr, kv = run["round_robin"]["measured"], run["kv"]["measured"]
        run["hit_rate_vs_oracle"] = kv["hit_rate_vs_oracle"]
        run["ttft_ratios"] = {q: _div(kv[f"ttft_{q}_ms"], rr[f"ttft_{q}_ms"]) for q in QUANTILES}
        run["prefill_tokens_ratio"] = _div(kv["prefill_tokens"], rr["prefill_tokens"])
        run["comparable"] = all(run[m][p]["errors"] == 0 and run[m][p]["requests_over_oracle"] == 0
                                and run[m][p]["hit_tokens"] is not None
                                for m in ("round_robin", "kv") for p in ("warmup", "measured"))
    hit = spread([r["hit_rate_vs_oracle"] for r in seeds])
    ttft = {q: spread([r["ttft_ratios"][q] for r in seeds]) for q in QUANTILES}
    comparable = bool(seeds) and all(r["comparable"] for r in seeds)

    def target(value: dict[str, Any], goal: float, at_least: bool) -> dict[str, Any]:
        def ok(v: float | None) -> bool:
            return comparable and v is not None and (v >= goal if at_least else v <= goal)
        return {"value": value["median"], "worst": value["min"] if at_least else value["max"], "target": goal,
                "met": ok(value["median"]), "met_every_seed": all(ok(v) for v in value["runs"])}

    targets = {
        "hit_rate_ge_0.9x_oracle": target(hit, TARGETS["hit_rate_vs_oracle_min"], at_least=True),
        "ttft_p90_le_0.6x_round_robin": target(ttft["p90"], TARGETS["ttft_p90_ratio_max"], at_least=False),
    }
    return {
        "runs": seeds, "comparable": comparable,
        "hit_rate_vs_oracle": hit, "ttft_ratios": ttft,
        "prefill_tokens_ratio": spread([r["prefill_tokens_ratio"] for r in seeds]),
        "hit_rate": {m: spread([r[m]["measured"]["hit_rate"] for r in seeds]) for m in ("round_robin", "kv")},
        "oracle_hit_rate": {m: spread([r[m]["measured"]["oracle_hit_rate"] for r in seeds])
                            for m in ("round_robin", "kv")},
        "ttft_ms": {m: {q: spread([r[m]["measured"][f"ttft_{q}_ms"] for r in seeds]) for q in QUANTILES}
                    for m in ("round_robin", "kv")},
        "warmup_ttft_p99_ms": {m: spread([r[m]["warmup"]["ttft_p99_ms"] for r in seeds])
                               for m in ("round_robin", "kv")},
        "targets_rule": "met: the median over the seeds; met_every_seed: every seed (worst: the worst seed)",
        "targets": targets, "targets_met": all(t["met"] for t in targets.values()),
    }


# --------------------------------------------------------------------- run
def run_mode(cluster: Cluster, base: str, conv: load.Conversations) -> dict[str, Any]:
    """``conv`` through the router at ``base``, every engine's prefix cache reset first."""
    cluster.reset_caches()
    wait_for(lambda: all(not cluster.held(i) for i in cluster.engines), 30, "the prefix caches reset")
    before = cluster.counters()
    began = time.monotonic()
    turns = load.run_conversations(base, conv)
    seconds = round(time.monotonic() - began, 1)
    after = cluster.counters()
    counters = {"prompt_tokens": int(sum(after[i][0] - before[i][0] for i in after)),
                "hit_tokens": int(sum(after[i][1] - before[i][1] for i in after))}
    out = mode_figures(turns, cluster.names, counters, seconds)
    out["errors"] = [t.error for t in turns if t.error][:5]
    return out


def run(quick: bool = False, workdir: str | None = None, per_node: int = ENGINES_PER_NODE,
        command: list[str] | None = None, popen: Callable[..., Any] = subprocess.Popen) -> dict[str, Any]:
    """``per_node``, ``command``, ``popen``: as ``Cluster``'s (the tests start fewer engines, their own way)."""
    from kvelastic_tools.vllm_bench.dynamo_indexer import available
    from kvelastic_tools.vllm_bench.tinymodel import build_tiny_llama

    why = available()
    if why:
        raise RuntimeError(f"bench route needs Dynamo's KV indexer: {why} (make setup installs ai-dynamo-runtime)")
    shape = load.QUICK if quick else load.FULL
    seeds = QUICK_SEEDS if quick else SEEDS
    folder = pathlib.Path(workdir or tempfile.mkdtemp(prefix="kvroute-", dir="/tmp"))  # short ipc:// paths
    started = time.monotonic()
    runs: list[dict[str, Any]] = []
    try:
        model = build_tiny_llama(folder / "tiny-llama")
        with Cluster(folder, model, per_node, command=command, popen=popen).up() as cluster, \
                contextlib.ExitStack() as stack:
            # One router per policy for the whole run: a second kv router would register the engines
            # with the indexer again, which refuses (HTTP 409, already registered).
            routers = {policy: stack.enter_context(cluster.router(policy)) for policy in MODES}
            cluster_start = round(time.monotonic() - started, 1)
            for n, seed in enumerate(seeds):
                one: dict[str, Any] = {"seed": seed, "order": list(MODES if n % 2 == 0 else MODES[::-1])}
                for policy in one["order"]:
                    # Fresh tokens per mode and seed: nothing one run cached can be a hit in another.
                    conv = load.make_conversations(shape, seed=2 * seed + (policy == "kv"))
                    one[policy.replace("-", "_")] = run_mode(cluster, routers[policy], conv)
                runs.append(one)
            exact = cluster.exactness()
    finally:
        if not os.environ.get("KVELASTIC_BENCH_KEEP"):
            shutil.rmtree(folder, ignore_errors=True)
    return {
        "benchmark": "route", "quick": quick,
        "shape": {**vars(shape), "requests_per_mode": shape.requests, "warmup_requests_per_mode": shape.warmup,
                  "measured_requests_per_mode": shape.requests - shape.warmup},
        "seeds": list(seeds), "nodes": len(NODES), "engines": len(NODES) * per_node,
        "oracle": "route_oracle.bound: an unbounded prefix cache with perfect placement, from the trace",
        "cluster_start_seconds": cluster_start, **report(runs), "indexer_exact": exact,
        "seconds": round(time.monotonic() - started, 1),
    }
