"""``kvelastic bench tier``: the node tier (docs/tier.md) against
stock vLLM, kvelastic without the tier and vLLM's own KV offloading.

Three engines (real vLLM, CPU build, one process per engine life:
``tier_run.py``) serve one seeded trace (``tier_model.Workload``): rotating
long system prompts, each visited twice by a two-turn conversation, a
prefix working set ~4x the device memory (kvelastic's budget). Engines live
for the whole mode (``tier_model.FULL``): the blocks they are about to evict
under pressure are copied into the tier while still cached (demotion source
B), as are cached slabs reclaimed from them (source A) and, at the end,
their kept cache. A conversation's turns are interleaved with other visits
(think time: turn t+1 of a visit after the first turns of the next
``tier_model.INTERLEAVE`` visits), so that it has left device memory before
its next turn.

Modes, one after the other, the same requests in the same order, one
request at a time:

- ``stock``: vLLM alone, each engine ``memory / engines`` of KV;
- ``kvelastic``: the daemon (budget ``memory``), no tier;
- ``tier``: the daemon with ``KVELASTIC_TIER_DIR``, the engines with
  ``KvelasticTierConnector``;
- ``tier_host``: the same with the tier in the daemon's host memory
  (``KVELASTIC_TIER_HOST_SIZE``, the same budget);
- ``tier_restart_daemon``, ``tier_restart_engine``: the restart rounds,
  ``tier`` with a ``kill -9`` halfway through the trace of the daemon (started
  again at once, as a user starts it: the keeper it started holds its pages
  meanwhile) or of the engine about to serve (a new one takes its slot); the
  hit rate and TTFT after the restart against ``tier``'s over the same
  requests (``restart_rounds``), and the tokens against stock's;
- ``kvelastic_ttl10m``: kvelastic without the tier at its default kept-cache
  TTL (10 minutes: kept cache waits for a warm start, or yields to demand);
- ``offload``: stock vLLM with its ``OffloadingConnector`` (host memory as
  large as the budget), ``simple_offload`` (its ``SimpleCPUOffloadConnector``)
  and ``lmcache`` (``LMCacheConnectorV1``); a mode whose engine does not start
  on this build is recorded with its error;
- ``lmcache_mp``: stock vLLM engines sharing LMCache's multi-process server
  (``tier_lmcache``: ``make lmcache``), as much memory as the tier;
  ``lmcache_mp_restart_server`` and ``lmcache_mp_restart_engine``: its
  restart rounds, a ``kill -9`` of the server (started again on its ports)
  or of an engine halfway through, judged against ``lmcache_mp``.

Per mode: the hit rate (vLLM's prefix-cache hits, local plus a connector's,
over prompt tokens) and its ratio to the oracle's (the same prompts against a
cache that never evicts), TTFT p50/p90/p99, throughput (tokens in and out
over the time spent serving; engine start-ups excluded, the same in every
mode), and whether the greedy tokens equal stock's.

The crossover (``crossover``): per model, the TTFT of a prompt of L+1
tokens whose first L are computed (a fresh engine) against loaded from the
tier (another engine after the first's kept cache was demoted), over a sweep
of L (three prompts per L, medians); the smallest L from which loading wins.

Engines are forked from one fork server (``tier_run --server``) that
imported vLLM once: a start-up of 2 s instead of 12 to 20 s on two busy
cores. Options (environment):

- ``KVELASTIC_BENCH_TIER_INTERLEAVE``: K, the first turns of other visits
  sent between two turns of a conversation (``tier_model.INTERLEAVE`` by
  default); ``0``: each visit's turns back to back (the workload of the
  runs before 2026-11-29's third, ``tier_model.BACK_TO_BACK``);
- ``KVELASTIC_BENCH_TIER_VISITS_PER_LIFE``: visits an engine serves before
  it is replaced (it exits, a new one takes its slot; before a new one starts
  the bench waits for the departed engine's kept cache to be released, with
  ``KVELASTIC_ORPHAN_CACHE_TTL=200ms``); ``0`` (the default): never, engines
  live for the whole mode; ``1``: the runs before source B
  (``tier_model.LIFE1``);
- ``KVELASTIC_BENCH_TIER_WORKLOADS``: the workloads, comma-separated
  (``interleaved,multi_round_qa`` by default, ``--quick``: ``interleaved``):
  ``interleaved`` is the trace above, ``multi_round_qa`` the manner of
  LMCache's own benchmark (``tier_model.MULTI_ROUND_QA``: users sharing one
  system prompt, each with a context of its own, rounds of questions served
  round robin, each conversation growing); the first is reported at the top
  level, the others under ``workloads``;
- ``KVELASTIC_BENCH_TIER_MODES``: the modes to run, comma-separated (all of
  ``MODES`` by default);
- ``KVELASTIC_BENCH_TIER_CROSSOVER``: the models of the crossover,
  comma-separated (``tiny,bench`` by default; empty: none);
- ``KVELASTIC_BENCH_TIER_PNG``: where the plot goes (none if unset);
- ``KVELASTIC_BENCH_TIER_LOGS``: a directory where each mode's daemon and
  engine logs are kept (``LOGS/MODE/``; they go with the mode's temporary
  directory otherwise).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

from kvelastic.config import parse_size
from kvelastic_tools.vllm_bench import tier_lmcache, tier_model, vllm_serve
from kvelastic_tools.vllm_bench.tier_model import Workload
from kvelastic_tools.vllm_bench.tier_report import TARGETS, ms, part_of, report

MiB = 1 << 20
TTL = "200ms"
TIER_SIZE = "1GiB"
MODES = ("stock", "kvelastic", "tier", "tier_host", "tier_restart_daemon", "tier_restart_engine", "kvelastic_ttl10m",
         "offload", "simple_offload", "lmcache", "lmcache_mp", "lmcache_mp_restart_server",
         "lmcache_mp_restart_engine")
QUICK_MODES = ("stock", "tier", "tier_host", "tier_restart_daemon", "tier_restart_engine")
# The restart rounds: ``tier`` with, halfway through the trace, the daemon
# killed (``kill -9``) and started again as a user starts it (its keeper
# started by the first daemon: ``KVELASTIC_KEEPER=auto``), or one engine
# killed and a new one started in its slot.
# mode -> (what is killed, the mode it is judged against); LMCache's rounds kill its server or an engine.
RESTARTS = {"tier_restart_daemon": ("daemon", "tier"), "tier_restart_engine": ("engine", "tier"),
            "lmcache_mp_restart_server": ("server", "lmcache_mp"),
            "lmcache_mp_restart_engine": ("engine", "lmcache_mp")}
TIER_MEDIA = {"tier": "disk", "tier_host": "host", "tier_restart_daemon": "disk", "tier_restart_engine": "disk"}
SWEEP = (32, 128, 256, 512, 1024, 2016)   # L + 1 tokens within the tiny model's 2,048 positions
REPEATS = 3                               # prompts per L (the median is reported)
QUICK_SWEEP = (32, 256)
# The targets for the tier mode.
ENGINE_TIMEOUT = 180.0     # seconds an engine may take to start or to answer one request


class EngineFailed(RuntimeError):
    pass


class Engine:
    """One engine life: ``tier_run``'s engine, forked by its fork server (``server``)."""

    def __init__(self, server: str, model: pathlib.Path, mode: str, kv_bytes: int, max_len: int, log: pathlib.Path,
                 socket_path: str | None, engine_id: str, cpu_bytes: int = 0,
                 extra_env: dict[str, str] | None = None) -> None:
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "KVELASTIC_ENABLE": "0", **(extra_env or {})}
        if socket_path is not None:
            env.update(KVELASTIC_ENABLE="1", KVELASTIC_SOCKET=socket_path, KVELASTIC_ENGINE_ID=engine_id)
        self.engine_id = engine_id
        self.started = time.monotonic()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(ENGINE_TIMEOUT)
        self.sock.connect(server)
        self.sock.sendall((json.dumps({"argv": [str(model), mode, str(kv_bytes), str(max_len), str(cpu_bytes)],
                                       "env": env, "log": str(log)}) + "\n").encode())
        self.stream = self.sock.makefile("rw")
        line = self._read(("READY", "FAILED"))
        if line.startswith("FAILED"):
            self.exit()
            raise EngineFailed(json.loads(line[len("FAILED"):]))
        self.pid = int(line.split()[1])
        self.start_s = time.monotonic() - self.started

    def _read(self, prefixes: tuple[str, ...]) -> str:
        for line in self.stream:
            if line.startswith(prefixes):
                return line.strip()
        raise EngineFailed("the engine exited (its log says why)")

    def req(self, ids: list[int], max_tokens: int) -> dict[str, Any]:
        self.stream.write("req " + json.dumps({"ids": ids, "max_tokens": max_tokens}) + "\n")
        self.stream.flush()
        return json.loads(self._read(("RESULT ",))[len("RESULT "):])

    def kill(self) -> None:
        """``kill -9`` of the engine's process (between two requests), then its end of the socket."""
        os.kill(self.pid, signal.SIGKILL)
        self.exit()

    def exit(self) -> None:
        """End of input; returns once the engine's process is gone (its end of the socket closed)."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_WR)
            while self.sock.recv(65536):
                pass
        self.stream.close()
        self.sock.close()


@contextlib.contextmanager
def fork_server(folder: pathlib.Path, python: str = sys.executable,
                env: dict[str, str] | None = None) -> Iterator[str]:
    """``tier_run --server``: vLLM imported once, an engine forked per life; yields its socket."""
    path = str(folder / "fork.sock")
    with open(folder / "fork-server.log", "ab") as log:
        proc = subprocess.Popen([python, "-m", "kvelastic_tools.vllm_bench.tier_run", "--server", path],
                                stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    try:
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != "SERVING":
            raise RuntimeError(f"the fork server did not start: {proc.wait(30)}")
        yield path
    finally:
        proc.terminate()
        proc.wait(30)


class BenchDaemon:
    """A kvelastic daemon (host backend) with a tier of medium ``tier``
    (``"disk"``: in ``folder/tier``; ``"host"``: in its memory; None: none).
    ``keeper``: as a user starts it, with the keeper it starts (which lingers
    a few seconds after the last daemon stops); else none."""

    def __init__(self, folder: pathlib.Path, memory: int, tier: str | None, ttl: str, keeper: bool) -> None:
        self.sock = str(folder / "kvelastic.sock")
        self.log = folder / "daemon.log"
        env = dict(os.environ, KVELASTIC_SOCKET=self.sock, KVELASTIC_MEMORY=str(memory), KVELASTIC_BACKEND="host",
                   KVELASTIC_METRICS_PORT="0", KVELASTIC_LOG_LEVEL="info", KVELASTIC_ORPHAN_CACHE_TTL=ttl,
                   KVELASTIC_IDLE_GRACE="1s", KVELASTIC_HOLD_DOWN="2s")
        if keeper:
            env.update(KVELASTIC_KEEPER="auto", KVELASTIC_KEEPER_LINGER="5s")
        if tier == "disk":
            (folder / "tier").mkdir(mode=0o700)
            env.update(KVELASTIC_TIER_DIR=str(folder / "tier"), KVELASTIC_TIER_SIZE=TIER_SIZE)
        elif tier == "host":
            env.update(KVELASTIC_TIER_HOST_SIZE=TIER_SIZE)
        self.env = env
        self.proc = vllm_serve.start_daemon(env, self.log)

    def kill_and_restart(self) -> float:
        """``kill -9``, then a new daemon with the same settings; the seconds until it answers."""
        self.proc.kill()
        self.proc.wait()
        started = time.monotonic()
        self.proc = vllm_serve.start_daemon(self.env, self.log)
        return time.monotonic() - started

    def stop(self) -> None:
        vllm_serve.stop_daemon(self.proc)


@contextlib.contextmanager
def daemon(folder: pathlib.Path, memory: int, tier: str | None, ttl: str = TTL,
           keeper: bool = False) -> Iterator[BenchDaemon]:
    d = BenchDaemon(folder, memory, tier, ttl, keeper)
    try:
        yield d
    finally:
        d.stop()


def _tier_counters(sock: str) -> dict[str, Any]:
    """The tier's counters: demotions (of them from blocks running engines were about to evict, source B,
    and from reclaimed cached slabs; the rest kept cache), promotions, lookups and failures by reason."""
    from kvelastic.ctl import get_status

    tier = get_status(sock).get("tier") or {}
    counters = tier.get("counters", {})
    out = {"blocks": tier.get("blocks", 0), "medium": tier.get("medium")}
    for name in ("demotions", "demotions_evicted", "demotions_reclaimed", "already_held", "rejected_full",
                 "promotions", "hit_blocks", "lookups", "lookup_blocks"):
        out[name] = counters.get(name, 0)
    out["failures"] = {k[len("failures_"):]: n for k, n in counters.items() if k.startswith("failures_") and n}
    return out


def _settle(sock: str, timeout: float = 20.0, gone: str | None = None) -> None:
    """Until no kept cache is left (released: demoted, with a tier) and no engine is registered
    (only engine ``gone`` is not, if given)."""
    from kvelastic.ctl import get_status

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = get_status(sock)
        ids = {e["engine_id"] for e in status["engines"]}
        if (gone not in ids if gone is not None else not ids) and not status.get("orphans"):
            return
        time.sleep(0.05)


def run_mode(w: Workload, model: pathlib.Path, mode: str, folder: pathlib.Path, server: str,
             extra_env: dict[str, str] | None = None, restart_server: Callable[[], float] | None = None
             ) -> dict[str, Any]:
    """The whole trace in ``mode``: per-request results and the mode's figures."""
    elastic = mode in ("kvelastic", "kvelastic_ttl10m", *TIER_MEDIA)
    kv_bytes = w.per_engine
    requests: list[dict[str, Any]] = []
    starts: list[float] = []
    lives = 0
    restart = RESTARTS[mode][0] if mode in RESTARTS else None
    total = len(w.requests())
    restart_at = total // 2 if restart else total
    restarted: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        ttl = "10m" if mode == "kvelastic_ttl10m" else TTL
        d = stack.enter_context(daemon(folder, w.memory, TIER_MEDIA.get(mode), ttl, keeper=restart == "daemon")) \
            if elastic else None
        sock = d.sock if d is not None else None

        def start(slot: int) -> Engine:
            nonlocal lives
            lives += 1
            engine = Engine(server, model, mode, kv_bytes, w.max_model_len, folder / f"engine-{mode}.log", sock,
                            f"{mode}-{slot}-{lives}", cpu_bytes=w.memory, extra_env=extra_env)
            starts.append(engine.start_s)
            return engine

        slots: list[Engine | None] = [None] * w.engines
        served = [0] * w.engines
        def exit_all() -> None:
            for e in slots:
                if e is not None:
                    e.exit()

        stack.callback(exit_all)
        started = time.monotonic()
        visits = w.visits()
        history: dict[int, list[int]] = {}
        for v, turn in w.requests():
            slot, p, index = visits[v]
            if len(requests) == restart_at and restart == "daemon" and d is not None:
                restarted = {"kind": "daemon", "at_request": restart_at, "daemon_start_s": round(
                    d.kill_and_restart(), 2)}
            elif len(requests) == restart_at and restart == "server" and restart_server is not None:
                restarted = {"kind": "server", "at_request": restart_at, "server_start_s": round(restart_server(), 2)}
            elif len(requests) == restart_at and restart == "engine":
                alive = [i for i, e in enumerate(slots) if e is not None]
                victim = slot if slot in alive else (alive[0] if alive else None)
                if victim is not None:       # the next request of its slot starts a new engine there
                    slots[victim].kill()     # type: ignore[union-attr]
                    slots[victim] = None
                restarted = {"kind": "engine", "at_request": restart_at, "slot": victim}
            engine = slots[slot]
            if turn == 0 and engine is not None and 0 < w.visits_per_life <= served[slot]:
                # Replaced before a visit begins; later turns of its visits go to the next engine of the slot.
                engine.exit()
                gone, slots[slot], engine = engine.engine_id, None, None
                if sock is not None and ttl == TTL:
                    # Its kept cache released (demoted, with the tier) before the next engine starts: an
                    # engine that grows would otherwise adopt the namespace's kept slabs first (warm start).
                    _settle(sock, gone=gone)
            if engine is None:
                slots[slot] = engine = start(slot)
                served[slot] = 0
            if turn == 0:
                served[slot] += 1
            prompt = history.pop(v, w.system_prompt(index)) + w.user_turn(index, p, turn)
            out = engine.req(prompt, w.answer_tokens)
            requests.append({"prompt": prompt, "pass": p, "turn": turn, "visit": v, **out})
            if turn + 1 < w.turns:
                history[v] = prompt + out["tokens"]
        wall = time.monotonic() - started
        tier = _tier_counters(sock) if mode in TIER_MEDIA and sock else None
    oracle = tier_model.oracle_hits([(r["prompt"], r["tokens"]) for r in requests])
    queries = sum(len(r["prompt"]) for r in requests)
    hits = sum(r["hits"] + r["external"] for r in requests)
    serving = sum(r["seconds"] for r in requests)
    ttfts = [r["ttft_s"] for r in requests]
    revisits = [r["ttft_s"] for r in requests if r["pass"] > 0 and r["turn"] == 0]
    later = [r["ttft_s"] for r in requests if r["turn"] > 0]
    tokens_out = sum(len(r["tokens"]) for r in requests)
    result: dict[str, Any] = {
        "requests": len(requests), "engine_lives": lives,
        "engine_start_s_median": round(sorted(starts)[len(starts) // 2], 2) if starts else None,
        "prompt_tokens": queries, "hit_tokens": int(hits),
        "external_hit_tokens": int(sum(r["external"] for r in requests)),
        "hit_rate": round(hits / queries, 4), "oracle_hit_rate": round(sum(oracle) / queries, 4),
        "hit_rate_over_oracle": round(hits / sum(oracle), 4) if sum(oracle) else None,
        "ttft_p50_ms": ms(ttfts, 0.5), "ttft_p90_ms": ms(ttfts, 0.9), "ttft_p99_ms": ms(ttfts, 0.99),
        # The requests the tier is for: a system prompt's first turn on its second visit.
        "ttft_revisit_p50_ms": ms(revisits, 0.5), "ttft_revisit_p90_ms": ms(revisits, 0.9),
        # A conversation's later turns (interleaved: its prefix left device memory meanwhile).
        "ttft_later_turn_p50_ms": ms(later, 0.5),
        "serving_s": round(serving, 2), "wall_s": round(wall, 2),
        "throughput_tok_s": round((queries + tokens_out) / serving, 1) if serving else None,
        "requests_per_s": round(len(requests) / serving, 3) if serving else None,
    }
    if tier is not None:
        result["tier"] = tier
    if restarted:
        result["restart"] = {**restarted, "before": part_of(requests[:restart_at]),
                             "after": part_of(requests[restart_at:])}
    result["_requests"] = [(r["hits"] + r["external"], len(r["prompt"]), r["ttft_s"]) for r in requests]
    result["_tokens"] = [r["tokens"] for r in requests]
    result["_ttfts"] = ttfts
    return result


def crossover(name: str, sweep: tuple[int, ...], folder: pathlib.Path, server: str) -> dict[str, Any]:
    """TTFT of L computed against L loaded from the tier, per L of ``sweep``, for model ``name``."""
    model, shape = tier_model.build(name)
    per_token = tier_model.kv_bytes_per_token(shape)
    repeats = 1 if sweep == QUICK_SWEEP else REPEATS
    memory = max(32 * MiB, 2 * per_token * repeats * (sum(sweep) + 64 * len(sweep)))
    memory = -(-memory // (2 * MiB)) * 2 * MiB
    max_len = min(shape.max_pos, max(sweep) + 64)
    rng = random.Random(11)
    prompts = [[[rng.randrange(3, tier_model.VOCAB_SIZE) for _ in range(n + 1)] for n in sweep] for _ in range(repeats)]
    warm = [rng.randrange(3, tier_model.VOCAB_SIZE) for _ in range(40)]
    with daemon(folder, memory, tier="disk") as d:
        sock = d.sock
        log = folder / "engine-crossover.log"
        first = Engine(server, model, "kvelastic", memory, max_len, log, sock, f"{name}-compute")
        first.req(warm, 1)      # the first step's one-off costs, outside the figures
        computed = [[first.req(ids, 1) for ids in rep] for rep in prompts]
        first.exit()
        _settle(sock)
        demoted = _tier_counters(sock)
        second = Engine(server, model, "tier", memory, max_len, log, sock, f"{name}-load")
        second.req(warm, 1)
        loaded = [[second.req(ids, 1) for ids in rep] for rep in prompts]
        second.exit()

    def median_ms(runs: list[list[dict[str, Any]]], i: int) -> float:
        return round(sorted(r[i]["ttft_s"] for r in runs)[len(runs) // 2] * 1e3, 2)

    points = []
    for i, n in enumerate(sweep):
        points.append({"tokens": n, "computed_ms": median_ms(computed, i), "loaded_ms": median_ms(loaded, i),
                       "loaded_tokens": min(int(r[i]["external"]) for r in loaded),
                       "same_tokens": all(c[i]["tokens"] == ld[i]["tokens"] for c, ld in zip(computed, loaded))})
    wins = [p["loaded_ms"] < p["computed_ms"] and p["loaded_tokens"] > 0 for p in points]
    at = next((points[i]["tokens"] for i in range(len(points)) if all(wins[i:])), None)
    return {"model": name, "params": tier_model.params(shape), "kv_bytes_per_token": per_token,
            "demoted_blocks": demoted["demotions"], "points": points, "loading_wins_from_tokens": at}


def _keep_logs(folder: pathlib.Path, to: pathlib.Path) -> None:
    to.mkdir(parents=True, exist_ok=True)
    for log in folder.glob("*.log"):
        shutil.copyfile(log, to / log.name)


def workloads(quick: bool) -> dict[str, Workload]:
    """The workloads to run by name (``KVELASTIC_BENCH_TIER_WORKLOADS``; the
    first is the report's main one): ``interleaved`` (with the options
    above; ``--quick``: ``tier_model.QUICK``) and ``multi_round_qa``."""
    w = tier_model.QUICK if quick else tier_model.FULL
    life = os.environ.get("KVELASTIC_BENCH_TIER_VISITS_PER_LIFE")    # e.g. 1: tier_model.LIFE1
    if life:
        w = dataclasses.replace(w, visits_per_life=int(life))
    interleave = os.environ.get("KVELASTIC_BENCH_TIER_INTERLEAVE")   # 0: tier_model.BACK_TO_BACK
    if interleave:
        w = dataclasses.replace(w, interleave=int(interleave))
    chosen = os.environ.get("KVELASTIC_BENCH_TIER_WORKLOADS") or ("interleaved" if quick else
                                                                   "interleaved,multi_round_qa")
    return {name: w if name == "interleaved" else tier_model.WORKLOADS[name] for name in chosen.split(",") if name}


def lmcache_mode(w: Workload, model: pathlib.Path, mode: str, folder: pathlib.Path) -> dict[str, Any]:
    """``lmcache_mp``: stock vLLM engines (their static shares) sharing LMCache's
    server, its memory the tier's budget; engines forked from LMCache's environment."""
    missing = tier_lmcache.installed()
    if missing:
        return {"error": missing}
    env = {**os.environ, "PYTHONPATH": tier_lmcache.engine_path()}
    with fork_server(folder, str(tier_lmcache.PYTHON), env) as server, \
            tier_lmcache.lmcache_server(folder, parse_size(TIER_SIZE)) as lmc:
        return run_mode(w, model, mode, folder, server, {"KVELASTIC_BENCH_LMCACHE_PORT": str(lmc.port)},
                        restart_server=lmc.kill_and_restart)


def run_workload(w: Workload, modes: tuple[str, ...], server: str, logs: str | None) -> dict[str, dict[str, Any]]:
    """Every mode over ``w``'s trace: per mode its figures (``_`` keys: per request)."""
    model, _ = tier_model.build(w.model)
    results: dict[str, dict[str, Any]] = {}
    for mode in modes:
        with tempfile.TemporaryDirectory(prefix="kvt-") as folder:
            try:
                where = pathlib.Path(folder)
                results[mode] = lmcache_mode(w, model, mode, where) if mode.startswith("lmcache_mp") else \
                    run_mode(w, model, mode, where, server)
            except (EngineFailed, RuntimeError, OSError) as e:     # OSError: an engine stuck past its timeout
                results[mode] = {"error": f"{type(e).__name__}: {e}"}
            finally:
                if logs:
                    _keep_logs(pathlib.Path(folder), pathlib.Path(logs) / mode)
    stock = results.get("stock", {}).get("_tokens")
    for r in results.values():
        if "_tokens" in r:
            r["same_tokens_as_stock"] = r["_tokens"] == stock if stock is not None else None
    return results


def run(quick: bool = False, png: str | None = None, modes: tuple[str, ...] | None = None,
        crossover_models: tuple[str, ...] | None = None) -> dict[str, Any]:
    """The main workload's report at the top level; every other one's under its name in ``workloads``."""
    chosen = workloads(quick)
    env_modes = os.environ.get("KVELASTIC_BENCH_TIER_MODES")
    modes = modes or (tuple(m for m in env_modes.split(",") if m) if env_modes else None) or \
        (QUICK_MODES if quick else MODES)
    env_curves = os.environ.get("KVELASTIC_BENCH_TIER_CROSSOVER")
    if crossover_models is None and env_curves is not None:
        crossover_models = tuple(m for m in env_curves.split(",") if m)
    crossover_models = crossover_models if crossover_models is not None else (() if quick else ("tiny", "bench"))
    logs = os.environ.get("KVELASTIC_BENCH_TIER_LOGS")
    results: dict[str, dict[str, dict[str, Any]]] = {}
    curves = {}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvt-") as top, fork_server(pathlib.Path(top)) as server:
        for name, w in chosen.items():
            results[name] = run_workload(w, modes, server, f"{logs}/{name}" if logs else None)
        for name in crossover_models:
            with tempfile.TemporaryDirectory(prefix="kvt-") as folder:
                try:
                    curves[name] = crossover(name, QUICK_SWEEP if quick else SWEEP, pathlib.Path(folder), server)
                except (EngineFailed, RuntimeError, OSError) as e:
                    curves[name] = {"model": name, "error": f"{type(e).__name__}: {e}"}
    (main, w), *others = chosen.items()
    def figures(name: str, workload: Workload) -> dict[str, Any]:
        return report(workload, results[name], {m: base for m, (_, base) in RESTARTS.items()}, TTL, TIER_SIZE)

    out = {"benchmark": "tier", "quick": quick, "workload_name": main, **figures(main, w),
           "workloads": {name: figures(name, ow) for name, ow in others},
           "crossover": curves, "targets": TARGETS, "total_s": round(time.monotonic() - started, 1)}
    if png is None:
        png = os.environ.get("KVELASTIC_BENCH_TIER_PNG")
    if png:
        from kvelastic_tools.vllm_bench.tier_plot import plot

        plot(png, out, {m: r.get("_ttfts", []) for m, r in results[main].items()})
    return out


if __name__ == "__main__":
    print(json.dumps(run(quick="--quick" in sys.argv), indent=2))
