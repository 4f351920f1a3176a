"""``kvelastic bench elastic``: elastic memory against a static split and
against the limit, on real servers, with a verdict that does not follow the
machine's speed.

Three modes, each N tiny ``vllm serve`` instances kept up for the whole run:

- ``static``: stock vLLM (plugin off), the budget T split, ``T/N`` each;
- ``elastic``: one kvelastic daemon with T (host backend) and N engines with
  the plugin;
- ``limit``: stock vLLM with the whole budget T each, N x T in all: one
  unsplit pool, which no real node has; what kvelastic at best reaches.

First the bench measures what one engine serves here (``elastic_calibrate``:
a stock engine of the limit mode, the others idle), then sizes two scenarios
from it (``elastic_load.Scenario``): CONTENDED (the hot phase needs about two
static shares of KV memory) and UNCONTENDED (half a share: every mode keeps
up), both below the saturated throughput (0.85 of what the engine served at
the scenario's concurrency with the cold trickle on the others, measured
again before each repetition), so that memory is what is contended. Each
repetition draws a fresh workload per scenario (a seed of its own: no prefix
carries over from one repetition to the next; the same seed in every mode,
so tokens compare) and offers it to the three modes in turn,
the order rotating from repetition to repetition (A B C, B C A, C A B, ...).
Five repetitions (``--quick``: one, a shorter request and load, two engines).

Reported per scenario and mode: the spread (median, min, max over the
repetitions) of TTFT p50/p90/p99 and mean, time per output token,
throughput, preemptions, prefix hits and the requests the hot engine ran and
queued; elastic also: the share of the budget held under load and every
stretch of memory held by no engine while an engine had requests waiting,
the idle footprint 2 s after each run against the packed floor, slab moves
and thrash, the daemon's demand-wait histogram. Ratios per repetition
(elastic over limit, elastic over static) with their spread; the verdicts in
``targets`` per scenario (``elastic_report.targets``), the one-slab hand-off
(``elastic_handoff``) measured apart. Plots: one per scenario
(``elastic_plot``), ``elastic-contended.png`` and ``elastic-uncontended.png``
beside ``KVELASTIC_BENCH_ELASTIC_PNG`` (default ``elastic.png``: the
scenario goes before the suffix). ``KVELASTIC_BENCH_ELASTIC_DIR``: a folder
kept with the logs and every run's samples (``runs.json``).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

from kvelastic_tools.vllm_bench import elastic_calibrate as calibration
from kvelastic_tools.vllm_bench import elastic_cpu as cpu
from kvelastic_tools.vllm_bench import elastic_load as load
from kvelastic_tools.vllm_bench import elastic_report as report
from kvelastic_tools.vllm_bench import vllm_serve

MiB = 1 << 20
KiB = 1 << 10
BLOCK_BYTES = 32 * KiB         # the tiny model: 2 layers x K,V x 32 tokens x 2 heads x 32 x fp32
# 256 KiB pages: a slab (one page per layer) of 16 blocks, about one request of the workload,
# as a request spans a few slabs of a real model on a GPU. With 2 MiB pages one slab of the tiny
# model is 128 blocks, six requests: a share of a few slabs is all or nothing.
PAGE_BYTES = 256 * KiB
SLAB_BYTES = 2 * PAGE_BYTES
SHARE = 4 * MiB                # T/N: 128 blocks, 5 running requests of the full shape
IDLE_GRACE = "1s"
IDLE_GRACE_S = 1.0
HOLD_DOWN = "2s"
MAX_NUM_SEQS = 32
# Every mode's scheduler budget: vLLM's CPU default (2048 tokens) would make an elastic engine's
# reserve (a step's tokens and a slab: 80 blocks) and the grow of a running request short of a
# step's blocks (65) more than half a 4 MiB share, where on a GPU they are a few per cent of an
# engine's memory; 512 keeps them at 32 and 17 blocks. Stock runs with the same flag.
MAX_NUM_BATCHED_TOKENS = 512
SERVER_BYTES = 1800 * MiB      # one tiny `vllm serve` (API server, EngineCore, worker): 1,706 MiB measured
HANDOFF_SLABS = 16
MODES = ("static", "elastic", "limit")
SCENARIOS = ("contended", "uncontended")
REPS, QUICK_REPS = 5, 1        # the quick run: the test's (its rotation is plan()'s, tested apart)
# Of the calibrated X(L): a margin, so that a machine a little slower than when calibrated still
# keeps up in the limit mode (the CPU is not the bottleneck; the drain says whether it was).
LOAD_FRACTION = 0.85
SETTLE = 2.0                   # seconds after a run's last request: engines idle, footprint read
TARGETS = report.TARGETS
QUANTILES = report.QUANTILES


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def group_rss(pid: int) -> int:
    """Resident memory of a process group (a server: API server, EngineCore, worker)."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.getpgid(int(entry)) != pid:
                continue
            with open(f"/proc/{entry}/status") as f:
                total += next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:")), 0)
        except (OSError, ProcessLookupError):
            continue
    return total


def loadavg() -> list[float]:
    with open("/proc/loadavg") as f:
        return [float(x) for x in f.read().split()[:3]]


# --------------------------------------------------------------- processes
@contextlib.contextmanager
def daemon(folder: pathlib.Path, memory: int,
           page_size: int | None = None) -> Iterator[tuple[str, int, pathlib.Path, int]]:
    """A kvelastic daemon (host backend); yields its socket, metrics port, log and pid."""

    sock = str(folder / "kvelastic.sock")
    port = vllm_serve.free_port()
    log_path = folder / "daemon.log"
    env = dict(os.environ, KVELASTIC_SOCKET=sock, KVELASTIC_MEMORY=str(memory), KVELASTIC_BACKEND="host",
               KVELASTIC_METRICS_PORT=str(port), KVELASTIC_METRICS_ADDR="127.0.0.1", KVELASTIC_LOG_LEVEL="info",
               KVELASTIC_IDLE_GRACE=IDLE_GRACE, KVELASTIC_HOLD_DOWN=HOLD_DOWN)
    if page_size:
        env["KVELASTIC_PAGE_SIZE"] = str(page_size)
    proc = vllm_serve.start_daemon(env, log_path, timeout=20)
    try:
        yield sock, port, log_path, proc.pid
    finally:
        vllm_serve.stop_daemon(proc)


@contextlib.contextmanager
def servers(model: pathlib.Path, folder: pathlib.Path, n: int, per_engine: int, env: dict[str, str] | None = None,
            prefix: str = "e", command: list[str] | None = None,
            popen: Callable[..., Any] = subprocess.Popen) -> Iterator[list[vllm_serve.VllmServer]]:
    """``n`` tiny ``vllm serve`` instances, stopped (by process group) on the
    way out whatever happened. Started one after the other: on 2 cores three
    at once take as long in all, and each start-up starves the others."""
    flags = ["--max-model-len", "2048", "--max-num-seqs", str(MAX_NUM_SEQS), "--max-num-batched-tokens",
             str(MAX_NUM_BATCHED_TOKENS), "--kv-cache-memory-bytes", str(per_engine)]
    group = [vllm_serve.VllmServer(model, folder / f"vllm-{prefix}{i}.log", flags=flags, command=command, popen=popen,
                                   env={**(env or {}), "KVELASTIC_ENGINE_ID": f"{prefix}{i}"}) for i in range(n)]
    try:
        for server in group:
            server.start(timeout=300)
        yield group
    finally:
        for server in group:
            server.stop()


class Mode:
    """One mode's servers (and daemon), up for the whole bench."""

    def __init__(self, name: str, group: list[vllm_serve.VllmServer], per_engine: int, started_s: float,
                 sock: str | None = None, port: int | None = None, daemon_log: pathlib.Path | None = None,
                 daemon_pid: int | None = None) -> None:
        self.name, self.group, self.per_engine, self.started_s = name, group, per_engine, started_s
        self.sock, self.port, self.daemon_log, self.daemon_pid = sock, port, daemon_log, daemon_pid
        self.bases = [s.base for s in group]

    def cpu(self) -> dict[str, float]:
        """CPU seconds so far of its servers and daemon (``elastic_cpu``)."""
        return cpu.group_cpu([s.process().pid for s in self.group], (self.daemon_pid,) if self.daemon_pid else ())

    def dead(self) -> list[str]:
        return [f"{self.name}/e{i}" for i, s in enumerate(self.group) if s.process().poll() is not None]


def _scrape(group: list[vllm_serve.VllmServer]) -> list[dict[str, float]]:
    """vLLM's counters of each server (NaN for one that no longer answers)."""
    names = ("num_preemptions_total", "prefix_cache_hits_total", "prefix_cache_queries_total")
    out = []
    for server in group:
        try:
            text = server.metrics()
        except OSError:
            out.append(dict.fromkeys(names, math.nan))
            continue
        out.append({name: vllm_serve.counter(text, f"vllm:{name}") for name in names})
    return out


def _buckets(metrics: str, name: str) -> list[tuple[float, float]]:
    return sorted((float("inf") if le == "+Inf" else float(le), float(v)) for le, v in
                  re.findall(rf'^{re.escape(name)}_bucket{{[^}}]*le="([^"]+)"[^}}]*}} (\S+)$', metrics, re.M))


def _histogram_quantile(metrics: str, name: str, q: float, before: str = "") -> tuple[float | None, int]:
    """The upper bound of the bucket holding quantile ``q`` of a Prometheus
    histogram (of what it gained since ``before``, another scrape), and its count."""
    then = dict(_buckets(before, name))
    buckets = [(le, v - then.get(le, 0.0)) for le, v in _buckets(metrics, name)]
    total = buckets[-1][1] if buckets else 0
    if not total:
        return None, 0
    return next(le for le, count in buckets if count >= q * total), int(total)


def _pct(values: list[float], q: float) -> float | None:
    return report._pct(values, q)


# ------------------------------------------------------------------ a run
def run_once(mode: Mode, workload: load.Workload, timeout: float) -> dict[str, Any]:
    """``workload`` offered to ``mode``'s servers: results, counters, gauges,
    and for elastic the daemon's status every 150 ms and 2 s after the end."""
    from kvelastic.ctl import get_status

    before = _scrape(mode.group)
    hist_before = vllm_serve.http_get(f"http://127.0.0.1:{mode.port}/metrics") if mode.port else ""
    status_before = get_status(mode.sock, timeout=2.0) if mode.sock else None
    cpu_before = mode.cpu()
    t0 = time.monotonic() + 0.5
    with contextlib.ExitStack() as stack:
        gauges = stack.enter_context(load.GaugePoller(mode.bases))
        poller = stack.enter_context(load.StatusPoller(mode.sock)) if mode.sock else None
        stalls = stack.enter_context(load.StallMonitor())
        results = load.run_load(mode.bases, workload, t0, timeout=timeout)
        finished = [r for r in results if r.ok]
        t_end = max((t0 + r.sent + r.e2e for r in finished if r.e2e is not None), default=time.monotonic())
        cpu_at_end = mode.cpu()      # the load's CPU, not the settling's
        time.sleep(max(0.0, t_end + SETTLE - time.monotonic()))
        at_2s = get_status(mode.sock, timeout=2.0) if mode.sock else None
    out: dict[str, Any] = {"results": results, "t_end": t_end - t0,
                           "load_start_wall": time.time() - (time.monotonic() - t0),
                           "gauges": [(round(t - t0, 3), g) for t, g in gauges.samples],
                           "gauge_errors": gauges.errors, "worst_stall_ms": round(stalls.worst * 1e3, 1),
                           "stalls_over_1s": stalls.over_1s, "cpu_s": cpu.spent(cpu_at_end, cpu_before)}
    after = _scrape(mode.group)
    out["counters"] = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before)]
    if poller is not None and at_2s is not None and status_before is not None:
        metrics = vllm_serve.http_get(f"http://127.0.0.1:{mode.port}/metrics")
        out["status_samples"] = [(round(t - t0, 3), s) for t, s in poller.samples]
        out["status_errors"] = poller.errors
        out["status_latency_max_ms"] = round(max(poller.latencies, default=0.0) * 1e3, 1)
        out["status_2s_after"] = at_2s
        d0, d1 = status_before["devices"][0], at_2s["devices"][0]
        out["slab_moves"] = d1["slab_moves"] - d0["slab_moves"]
        out["thrash"] = d1["thrash"] - d0["thrash"]
        out["demand_wait"] = {f"p{int(q * 100)}_le_s": _histogram_quantile(
            metrics, "kvelastic_demand_wait_seconds", q, hist_before)[0] for q in (0.5, 0.99)}
        out["demand_wait"]["count"] = _histogram_quantile(metrics, "kvelastic_demand_wait_seconds", 0.5,
                                                          hist_before)[1]
    return out


def figures(mode: Mode, run: dict[str, Any], workload: load.Workload, total: int) -> dict[str, Any]:
    """One run's figures (``elastic_report.summarize``), elastic's own beside them."""
    out = report.summarize(run["results"], workload, run["t_end"], run["counters"], run["gauges"])
    done = max(1, sum(1 for r in run["results"] if r.ok))
    out.update(cpu_s=run["cpu_s"], cpu_ms_per_request=round(run["cpu_s"]["total"] * 1e3 / done, 1),
               kvelastic_cpu_ms_per_request=round(run["cpu_s"]["kvelastic"] * 1e3 / done, 1))
    out.update(worst_stall_ms=run["worst_stall_ms"], stalls_over_1s=run["stalls_over_1s"],
               load_start=time.strftime("%H:%M:%S", time.localtime(run["load_start_wall"])))
    if "status_samples" in run:
        foot = report.footprint(run["status_2s_after"], SLAB_BYTES // BLOCK_BYTES)
        out.update(held_under_load=report.held_under_load(run["status_samples"], run["gauges"], run["results"],
                                                          total, SLAB_BYTES),
                   idle_footprint_over_packed_floor=foot["idle_footprint_over_packed_floor"],
                   idle_footprint_over_strict_floor=foot["idle_footprint_over_strict_floor"],
                   slab_moves=run["slab_moves"], thrash=run["thrash"], demand_wait=run["demand_wait"],
                   status_errors=run["status_errors"], status_latency_max_ms=run["status_latency_max_ms"])
    return out


def handoff(folder: pathlib.Path, quick: bool) -> dict[str, Any]:
    from kvelastic_tools.vllm_bench import elastic_handoff

    folder.mkdir(parents=True, exist_ok=True)
    slab = elastic_handoff.PAGE * elastic_handoff.PAGES_PER_SLAB
    with daemon(folder, HANDOFF_SLABS * slab) as (sock, port, _log, _pid):
        got = elastic_handoff.measure(sock, HANDOFF_SLABS, cycles=8 if quick else 16)
        metrics = vllm_serve.http_get(f"http://127.0.0.1:{port}/metrics")
    ms = [s * 1e3 for s in got["samples"]]
    return {"handoff_samples": len(ms), "handoff_refused": got["refused"], "handoff_slab_bytes": slab,
            "handoff_p50_ms": report._r(_pct(ms, 0.5), 3), "handoff_p99_ms": report._r(_pct(ms, 0.99), 3),
            "handoff_max_ms": report._r(max(ms) if ms else None, 3),
            "handoff_daemon_demand_wait_p99_le_s": _histogram_quantile(metrics, "kvelastic_demand_wait_seconds",
                                                                       0.99)[0],
            "handoff_slab_moves": got["slab_moves"], "handoff_thrash": got["thrash"]}


def evidence(folder: pathlib.Path) -> str:
    """The telling lines of the logs (the folder may be temporary)."""
    lines = []
    for log in sorted(folder.rglob("*.log")):
        hits = [line for line in log.read_text(errors="replace").splitlines()
                if re.search(r"WARNING kvelastic|ERROR|Segfault|Error:|gone \(|failed \(|lost the daemon", line)]
        lines += [f"{log.name}: {line[:300]}" for line in hits[-12:]]
    return "\n".join(lines)


# --------------------------------------------------------------- the plan
def choose_engines(quick: bool) -> tuple[int, int]:
    """3 engines a mode when the machine holds 9 servers with 4 GiB to
    spare, else 2 (the quick run: 2)."""
    avail = mem_available()
    return (2 if quick or avail < 3 * len(MODES) * SERVER_BYTES + 4096 * MiB else 3), avail


def need_over_share(n: int) -> float:
    """How many static shares the contended hot phase needs: 2, but with two
    engines the cold one holds its system prompt and trickle (a quarter of a
    share or so) of the two shares there are: 1.5."""
    return 2.0 if n >= 3 else 1.5


def rotated(order: tuple[str, ...], rep: int) -> list[str]:
    k = rep % len(order)
    return list(order[k:] + order[:k])


def plan(reps: int) -> list[tuple[int, str, list[str]]]:
    """(repetition, scenario, order of the modes): the scenarios alternate
    which goes first, the modes rotate."""
    out = []
    for rep in range(reps):
        for scen in (SCENARIOS if rep % 2 == 0 else SCENARIOS[::-1]):
            out.append((rep, scen, rotated(MODES, rep)))
    return out


def seed_of(rep: int, scen: str) -> int:
    return 1000 + 2 * rep + SCENARIOS.index(scen)


def cpu_profile(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Median over repetitions of each CPU key per finished request (ms)."""
    keys = {k for r in runs for k in r["cpu_s"]}
    per_rep = [{k: r["cpu_s"].get(k, 0.0) * 1e3 / max(1, r["finished"]) for k in keys} for r in runs]
    med = {k: round(statistics.median(rep[k] for rep in per_rep), 2) for k in keys}
    return dict(sorted(med.items(), key=lambda kv: -kv[1]))


# --------------------------------------------------------------- the bench
def scenario_report(name: str, scens: list[load.Scenario], runs: dict[str, list[dict[str, Any]]],
                    tokens: list[dict[str, Any]], workloads: list[load.Workload], levels: list[dict[str, Any]],
                    cal: dict[str, Any], shape: load.Shape, share_blocks: int) -> dict[str, Any]:
    sat = cal.get("saturated")
    sizes = [len(w.requests) for w in workloads]
    comparable = all(r["finished"] == r["requests"] == n for m in MODES for r, n in zip(runs[m], sizes))
    # Each repetition compares elastic and the limit with the static split, request by request.
    tokens_ok = all(t["token_mismatches"] == 0 and t["token_compared_requests"] == 2 * n
                    for t, n in zip(tokens, sizes))
    el = runs["elastic"]
    foot = [r.get("idle_footprint_over_packed_floor") for r in el]
    foot_worst = max((f for f in foot if f is not None), default=None)
    thrash = sum(r.get("thrash") or 0 for r in el)
    ratios = {"vs_limit": report.ratios(el, runs["limit"]), "vs_static": report.ratios(el, runs["static"]),
              "limit_vs_static": report.ratios(runs["limit"], runs["static"])}
    limit_need = [shape.blocks_for(r["hot_running_max"]) / share_blocks for r in runs["limit"]
                  if r.get("hot_running_max") is not None]
    level = levels[0][name]
    out: dict[str, Any] = {
        "scenario": {"phases": scens[0].phases, "hot_share": scens[0].hot_share,
                     "running_target": level["concurrency"], "need_over_share": level["need_over_share"],
                     "hot_rate": report.spread(sc.hot_rate for sc in scens),
                     "phase_seconds": report.spread(sc.phase_seconds for sc in scens),
                     "gap": report.spread(sc.gap for sc in scens),
                     "requests": sizes, "requests_total": sum(sizes),
                     "hot_rate_over_saturated": report.spread(report.ratio(sc.hot_rate, sat["throughput_req_s"])
                                                              for sc in scens) if sat else None,
                     "seeds": [w.seed for w in workloads],
                     "first_phases": [(round(p.start, 2), round(p.end, 2), f"e{p.hot}")
                                      for p in workloads[0].phases]},
        "calibrated_per_rep": [lv[name] for lv in levels],
        # Did the limit keep up (the CPU was not the bottleneck)? Its drain over the calibrated
        # request time: about 1 when it did; over 2, the machine was slower than when calibrated.
        "limit_drain_over_request_time": report.spread(
            report.ratio(r["drain_s"], lv[name]["request_seconds"]) for r, lv in zip(runs["limit"], levels)),
        "measured_need_over_share_in_limit": report.spread(round(x, 3) for x in limit_need),
        "modes": {m: report.mode_spread(runs[m]) for m in MODES},
        "ratios": ratios,
        "elastic": {
            "held_share_under_load": report.spread(r["held_under_load"]["held_share_mean"] for r in el),
            "held_share_under_load_min": report.spread(r["held_under_load"]["held_share_min"] for r in el),
            "unheld_while_waiting_s": report.spread(r["held_under_load"]["unheld_while_waiting_s"] for r in el),
            "idle_footprint_over_packed_floor": report.spread(foot),
            "slab_moves": report.spread(r.get("slab_moves") for r in el), "thrash": thrash,
            "demand_wait_p99_le_s": report.spread(r["demand_wait"]["p99_le_s"] for r in el),
            "demand_grows": report.spread(r["demand_wait"]["count"] for r in el)},
        "tokens": {"compared_requests": sum(t["token_compared_requests"] for t in tokens),
                   "mismatches": sum(t["token_mismatches"] for t in tokens),
                   "distinct_completions": sum(t["distinct_completions"] for t in tokens)},
        "comparable": comparable,
        # Where the CPU went, by process and named thread (``elastic_cpu``): each
        # key's median over the repetitions, per request, in ms.
        "cpu_ms_per_request_by_part": {m: cpu_profile(runs[m]) for m in MODES},
        "per_rep": {m: runs[m] for m in MODES},
    }
    if name == "contended":
        p50 = ratios["vs_static"]["p50"]
        st, lim = out["modes"]["static"], out["modes"]["limit"]
        out["p50_vs_static"] = {
            **{k: p50[k] for k in ("median", "min", "max")},
            "why": "a split admits fewer requests at once: the hot engine of the static split ran "
                   f"{st['hot_running_mean']['median']} requests on average (limit "
                   f"{lim['hot_running_mean']['median']}),"
                   f" each decode step {st['tpot_mean_ms']['median']} ms per token (limit "
                   f"{lim['tpot_mean_ms']['median']}), so the requests it admits start sooner while the rest "
                   f"queue ({st['hot_waiting_mean']['median']} waiting on average): the median moves with how many "
                   "of a burst's requests one share admits at once, i.e. with the CPU's speed; the limit (every "
                   "engine with the whole budget) shows the same cost, so it is concurrency, not elasticity",
            "limit_over_static_p50": ratios["limit_vs_static"]["p50"]}
    drains = out["limit_drain_over_request_time"]["reps"]
    out["overloaded_reps"] = [i for i, x in enumerate(drains) if x is not None and x > 2]
    out["targets"] = report.targets(name, ratios, comparable, tokens_ok, foot_worst, thrash)
    out["targets_met"] = all(t["met"] for t in out["targets"].values())
    return out


def run(quick: bool = False, png: str | None = None, workdir: str | None = None,
        command: list[str] | None = None, popen: Callable[..., Any] = subprocess.Popen,
        reps: int | None = None) -> dict[str, Any]:
    """``png``: where the plots go (the scenario's name before the suffix);
    ``workdir``: a folder kept for the logs and samples (default:
    ``$KVELASTIC_BENCH_ELASTIC_DIR``, else a temporary one, removed);
    ``command``, ``popen``: how the servers start (the tests fork them)."""
    from kvelastic_tools.vllm_bench import elastic_plot
    from kvelastic_tools.vllm_bench.tinymodel import build_tiny_llama

    began = time.monotonic()
    load_at_start = loadavg()
    png = png or os.environ.get("KVELASTIC_BENCH_ELASTIC_PNG") or "elastic.png"
    workdir = workdir or os.environ.get("KVELASTIC_BENCH_ELASTIC_DIR") or None
    n, avail = choose_engines(quick)
    total = n * SHARE
    share_blocks = SHARE // BLOCK_BYTES
    factor = need_over_share(n)
    shape = load.QUICK_SHAPE if quick else load.FULL_SHAPE
    reps = reps or (QUICK_REPS if quick else REPS)
    phases = 2 if quick else n
    # Phases in request times D(L): the uncontended hot engine runs two requests
    # at once, so three D(L) a phase made 18 requests a repetition, its p99 the
    # slowest request; nine make 54 (the quick run's: two, either scenario).
    phase_lengths = dict.fromkeys(SCENARIOS, 2.0) if quick else {"contended": 3.0, "uncontended": 9.0}
    model = build_tiny_llama(pathlib.Path(tempfile.gettempdir()) / "kvelastic-tiny-llama")
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {s: {m: [] for m in MODES} for s in SCENARIOS}
    raw: dict[str, dict[str, list[dict[str, Any]]]] = {s: {m: [] for m in MODES} for s in SCENARIOS}
    tokens: dict[str, list[dict[str, Any]]] = {s: [] for s in SCENARIOS}
    workloads: dict[str, list[load.Workload]] = {s: [] for s in SCENARIOS}
    scens: dict[str, list[load.Scenario]] = {s: [] for s in SCENARIOS}
    order: list[list[Any]] = []
    with contextlib.ExitStack() as stack:
        tmp = pathlib.Path(workdir or stack.enter_context(
            tempfile.TemporaryDirectory(prefix="kvelastic-bench-elastic-")))
        tmp.mkdir(parents=True, exist_ok=True)
        modes: dict[str, Mode] = {}
        try:
            # The limit first: its first engine is calibrated alone, before the other modes start.
            for name in ("limit", "static", "elastic"):
                folder = tmp / name
                folder.mkdir(parents=True, exist_ok=True)
                env: dict[str, str] = {}
                sock = port = log = pid = None
                if name == "elastic":
                    sock, port, log, pid = stack.enter_context(daemon(folder, total, page_size=PAGE_BYTES))
                    env = {"KVELASTIC_ENABLE": "1", "KVELASTIC_SOCKET": sock, "KVELASTIC_METRICS_PORT": "0",
                           "KVELASTIC_PAGE_SIZE": str(PAGE_BYTES)}
                per_engine = total if name == "limit" else SHARE
                t = time.monotonic()
                group = stack.enter_context(servers(model, folder, n, per_engine, env, command=command, popen=popen))
                modes[name] = Mode(name, group, per_engine, round(time.monotonic() - t, 1), sock, port, log, pid)
                load.warm_up(modes[name].bases)
                if name == "limit":
                    t = time.monotonic()
                    most = min(MAX_NUM_SEQS, int(shape.running_for(total // BLOCK_BYTES)))
                    # The quick run (the test's) calibrates without the cold trickle: a third of the time.
                    cal = calibration.calibrate(group[0].base, shape, share_blocks, factor, most, quick,
                                                others=[] if quick else modes[name].bases[1:])
                    cal["seconds"] = round(time.monotonic() - t, 1)
            rss = {m: [group_rss(s.process().pid) for s in modes[m].group] for m in MODES}
            levels: list[dict[str, Any]] = []
            scenarios: dict[str, load.Scenario] = {}
            for rep, scen, mode_order in plan(reps):
                if len(levels) <= rep:
                    # What one engine serves now (the machine's speed may have changed since):
                    # this repetition's loads are sized from it.
                    levels.append(cal["levels"] if rep == 0 else calibration.measure_levels(
                        modes["limit"].bases[0], shape, share_blocks, factor, cal["alone"]["e2e_s"], cal["rounds"],
                        seed=100 * rep, others=modes["limit"].bases[1:], previous=levels[-1]))
                    scenarios = {s: calibration.scenario(s, levels[rep][s], phases, phase_lengths[s], IDLE_GRACE_S,
                                                         fraction=LOAD_FRACTION) for s in SCENARIOS}
                    time.sleep(SETTLE)   # past the idle grace: every elastic engine starts idle
                scens[scen].append(scenarios[scen])
                workload = load.make_workload(n, shape, scenarios[scen], seed=seed_of(rep, scen))
                workloads[scen].append(workload)
                timeout = max(120.0, 10 * (workload.phases[-1].end + scenarios[scen].gap))
                got: dict[str, dict[str, Any]] = {}
                for m in mode_order:
                    order.append([rep, scen, m])
                    got[m] = run_once(modes[m], workload, timeout)
                    dead = modes[m].dead()
                    if dead:
                        raise RuntimeError(f"servers died: {dead}")
                    runs[scen][m].append({"rep": rep, "position": mode_order.index(m),
                                          **figures(modes[m], got[m], workload, total)})
                    raw[scen][m].append(got[m])
                one = report.compare_tokens(got["static"]["results"], got["elastic"]["results"])
                lim = report.compare_tokens(got["static"]["results"], got["limit"]["results"])
                tokens[scen].append({k: one[k] + lim[k] if k in ("token_compared_requests", "token_mismatches")
                                     else one[k] for k in one})
            hand = handoff(tmp / "handoff", quick)
            warnings = [line for line in modes["elastic"].daemon_log.read_text(errors="replace").splitlines()
                        if " WARNING " in line or " ERROR " in line] if modes["elastic"].daemon_log else []
        except Exception as exc:
            raise RuntimeError(f"bench elastic failed: {exc}\n{evidence(tmp)}") from exc
        if workdir:
            dump = {s: {m: [{k: v for k, v in r.items() if k not in ("results", "status_2s_after")}
                            | {"results": [vars(x) for x in r["results"]]} for r in raw[s][m]] for m in MODES}
                    for s in SCENARIOS}
            (tmp / "runs.json").write_text(json.dumps(dump))
    out: dict[str, Any] = {
        "benchmark": "elastic", "quick": quick, "repetitions": reps,
        "model": "tiny random Llama (2 layers, fp32, block 32 tokens = 32 KiB)",
        "engines": n,
        "engines_why": f"3 a mode if MemAvailable ({avail // MiB} MiB) holds {3 * len(MODES)} servers of "
                       f"~{SERVER_BYTES // MiB} MiB and 4 GiB to spare, else 2" + (" (quick: 2)" if quick else ""),
        "modes": {"static": f"stock vLLM, {SHARE // MiB} MiB each (T/N)",
                  "elastic": f"kvelastic, one daemon with T = {total // MiB} MiB",
                  "limit": f"stock vLLM, T = {total // MiB} MiB each ({n * total // MiB} MiB in all: no real node)"},
        "total_kv_bytes": total, "static_per_engine_bytes": SHARE, "share_blocks": share_blocks,
        "daemon": {"KVELASTIC_MEMORY": total, "KVELASTIC_IDLE_GRACE": IDLE_GRACE, "KVELASTIC_HOLD_DOWN": HOLD_DOWN,
                   "KVELASTIC_BACKEND": "host", "KVELASTIC_PAGE_SIZE": PAGE_BYTES, "slab_bytes": SLAB_BYTES},
        "max_num_seqs": MAX_NUM_SEQS, "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
        "shape": {**vars(shape), "request_blocks": shape.request_blocks, "system_blocks": shape.system_blocks},
        "need_over_share": factor, "load_fraction": LOAD_FRACTION,
        "calibration": cal,
        "server_start_seconds": {m: modes[m].started_s for m in MODES},
        "server_rss_bytes": rss,
        "order": order,
        "scenarios": {s: scenario_report(s, scens[s], runs[s], tokens[s], workloads[s], levels, cal, shape,
                                         share_blocks) for s in SCENARIOS},
        **hand,
    }
    out["targets"] = {s: out["scenarios"][s]["targets"] for s in SCENARIOS}
    out["targets"]["handoff"] = {"handoff_p99_le_100ms": {
        "value": out["handoff_p99_ms"], "bound": TARGETS["handoff_p99_ms_max"], "what": "one slab, host backend",
        "met": out["handoff_p99_ms"] is not None and out["handoff_p99_ms"] <= TARGETS["handoff_p99_ms_max"]}}
    out["targets_met"] = all(t["met"] for group in out["targets"].values() for t in group.values())
    out["plots"] = {}
    for s in SCENARIOS:
        path = str(pathlib.Path(png).with_name(f"{pathlib.Path(png).stem}-{s}{pathlib.Path(png).suffix or '.png'}")
                   .resolve())
        elastic_plot.plot_scenario(path, s, workloads[s], raw[s], out["scenarios"][s], total, SHARE)
        out["plots"][s] = path
    out["daemon_warnings"] = {"count": len(warnings), "engines_dropped": sum("gone (" in w for w in warnings),
                              "engines_failed": sum("failed (" in w for w in warnings),
                              "drops": [w for w in warnings if "gone (" in w or "failed (" in w][:5],
                              "first": warnings[:5]}
    out["machine"] = {"loadavg_start": load_at_start, "loadavg_end": loadavg(), "cpus": os.cpu_count(),
                      "worst_stall_ms": max(r["worst_stall_ms"] for s in SCENARIOS for m in MODES
                                            for r in runs[s][m])}
    out["seconds"] = round(time.monotonic() - began, 1)
    return out


if __name__ == "__main__":
    print(json.dumps(run(quick="--quick" in sys.argv), sort_keys=True))
