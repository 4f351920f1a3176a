"""``kvelastic bench elastic``: elastic memory against static splitting, on real servers.

Both modes have the same total KV memory T and serve the same seeded request
list (``elastic_load``): bursty, skewed traffic whose hot engine rotates
from phase to phase, shared system prompts, idle gaps.

(a) static split: N stock ``vllm serve`` instances (plugin off), each with
    ``--kv-cache-memory-bytes T/N``;
(b) elastic: one kvelastic daemon (host backend, ``KVELASTIC_MEMORY=T``, a
    short ``KVELASTIC_IDLE_GRACE``) and the same N servers with the plugin.

T is chosen so that memory is contended: a hot burst needs more than T/N
and less than T. Per mode: TTFT p50/p99 (streaming, client side), requests
finished, throughput, preemptions and prefix-cache hit rate (each server's
/metrics), memory held per engine over time (elastic: the daemon's status
every 150 ms). Elastic also: the idle footprint 2 s after the last request
against the packed floor, slab moves and thrash, the daemon's demand-wait
histogram, and (``elastic_handoff``) the time one slab takes to move from an
idle engine to a busy one. Greedy outputs of the two modes are compared
token for token. Plot: ``elastic.png`` (``KVELASTIC_BENCH_ELASTIC_PNG`` or
``run(png=...)``; default in the current directory).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import pathlib
import re
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

from kvelastic_tools.figures import percentile
from kvelastic_tools.vllm_bench import elastic_load as load
from kvelastic_tools.vllm_bench import vllm_serve

MiB = 1 << 20
PER_ENGINE = 16 * MiB          # T/N: a hot burst needs ~26 MiB, more than this, less than T
IDLE_GRACE = "1s"
HOLD_DOWN = "2s"
SERVER_BYTES = 2560 * MiB      # what one tiny `vllm serve` takes (API server, EngineCore, worker), with margin
HANDOFF_SLABS = 16
# Step 21's targets: the median request gains from elasticity too (p50), the tail by far (p99).
TARGETS = {"ttft_p50_ratio_max": 0.9, "ttft_p99_ratio_max": 0.25, "idle_footprint_over_packed_floor_max": 1.1,
           "handoff_p99_ms_max": 100.0, "thrash_max": 0, "token_mismatches_max": 0}
QUANTILES = ("p50", "p90", "p99")


def ttft_ratios(static: dict[str, Any], elastic: dict[str, Any]) -> dict[str, float | None]:
    """Elastic's TTFT over the static split's at each of ``QUANTILES`` (None where either has none)."""
    def ratio(q: str) -> float | None:
        a, b = elastic.get(f"ttft_{q}_ms"), static.get(f"ttft_{q}_ms")
        return _r(a / b, 3) if a and b else None

    return {q: ratio(q) for q in QUANTILES}


def _pct(values: list[float], q: float) -> float | None:
    """``percentile``, or None (JSON null) for no values."""
    return percentile(values, q) if values else None


def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(x, nd)


def _ms(seconds: list[float], q: float) -> float | None:
    """Quantile ``q`` of ``seconds`` in milliseconds (0.1 ms); None for none."""
    x = _pct(seconds, q)
    return None if x is None else round(x * 1e3, 1)


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


# --------------------------------------------------------------- processes
@contextlib.contextmanager
def daemon(folder: pathlib.Path, memory: int) -> Iterator[tuple[str, int, pathlib.Path]]:
    """A kvelastic daemon (host backend); yields its socket, metrics port and log."""

    sock = str(folder / "kvelastic.sock")
    port = vllm_serve.free_port()
    log_path = folder / "daemon.log"
    env = dict(os.environ, KVELASTIC_SOCKET=sock, KVELASTIC_MEMORY=str(memory), KVELASTIC_BACKEND="host",
               KVELASTIC_METRICS_PORT=str(port), KVELASTIC_METRICS_ADDR="127.0.0.1", KVELASTIC_LOG_LEVEL="info",
               KVELASTIC_IDLE_GRACE=IDLE_GRACE, KVELASTIC_HOLD_DOWN=HOLD_DOWN)
    proc = vllm_serve.start_daemon(env, log_path, timeout=20)
    try:
        yield sock, port, log_path
    finally:
        vllm_serve.stop_daemon(proc)


@contextlib.contextmanager
def servers(model: pathlib.Path, folder: pathlib.Path, n: int, per_engine: int,
            env: dict[str, str] | None = None) -> Iterator[list[vllm_serve.VllmServer]]:
    """``n`` tiny ``vllm serve`` instances, stopped (by process group) on the
    way out whatever happened. Started one after the other: on 2 cores three
    at once take as long in all, and each start-up starves the others."""
    flags = ["--max-model-len", "2048", "--max-num-seqs", "32", "--kv-cache-memory-bytes", str(per_engine)]
    group = [vllm_serve.VllmServer(model, folder / f"vllm-e{i}.log", flags=flags,
                                   env={**(env or {}), "KVELASTIC_ENGINE_ID": f"e{i}"}) for i in range(n)]
    try:
        for server in group:
            server.start(timeout=240)
        yield group
    finally:
        for server in group:
            server.stop()


# ------------------------------------------------------------------ a mode
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


def _histogram_quantile(metrics: str, name: str, q: float) -> tuple[float | None, int]:
    """The upper bound of the bucket holding quantile ``q`` of a Prometheus histogram, and its count."""
    buckets = sorted((float("inf") if le == "+Inf" else float(le), float(v)) for le, v in
                     re.findall(rf'^{re.escape(name)}_bucket{{[^}}]*le="([^"]+)"[^}}]*}} (\S+)$', metrics, re.M))
    total = buckets[-1][1] if buckets else 0
    if not total:
        return None, 0
    return next(le for le, count in buckets if count >= q * total), int(total)


def run_mode(name: str, model: pathlib.Path, folder: pathlib.Path, workload: load.Workload, total: int,
             quick: bool) -> dict[str, Any]:
    n = workload.engines
    folder.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        env: dict[str, str] = {}
        sock = port = None
        if name == "elastic":
            sock, port, daemon_log = stack.enter_context(daemon(folder, total))
            env = {"KVELASTIC_ENABLE": "1", "KVELASTIC_SOCKET": sock, "KVELASTIC_METRICS_PORT": "0"}
        started = time.monotonic()
        group = stack.enter_context(servers(model, folder, n, total // n, env))
        startup = time.monotonic() - started
        rss = [group_rss(s.process().pid) for s in group]
        load.warm_up([s.base for s in group])
        time.sleep(2.0)   # past the idle grace: every engine starts the load idle
        before = _scrape(group)
        poller = stack.enter_context(load.StatusPoller(sock)) if sock else None
        t0 = time.monotonic() + 0.5
        with load.StallMonitor() as stalls:
            results = load.run_load([s.base for s in group], workload, t0, timeout=120 if quick else 180)
        finished = [r for r in results if r.ok]
        t_end = max((t0 + r.sent + r.e2e for r in finished if r.e2e is not None), default=time.monotonic())
        out: dict[str, Any] = {"server_start_seconds": round(startup, 1), "server_rss_bytes": rss,
                               "load_start_wall": round(time.time() - (time.monotonic() - t0), 3),
                               "bench_process_worst_stall": {"ms": round(stalls.worst * 1e3, 1),
                                                             "at_s": round(stalls.worst_at - t0, 2),
                                                             "over_1s": stalls.over_1s}}
        if poller is not None:
            from kvelastic.ctl import get_status

            time.sleep(max(0.0, t_end + 2.0 - time.monotonic()))
            at_2s = get_status(poller.socket_path, timeout=2.0)
            time.sleep(3.0)            # a little more of the decay for the plot
            out["status_2s_after"] = at_2s
            out["status_samples"] = [(round(t - t0, 3), {e["engine_id"]: e["held_bytes"] for e in s["engines"]})
                                     for t, s in poller.samples]
            out["status_errors"] = poller.errors
            out["status_latency_max_ms"] = round(max(poller.latencies, default=0.0) * 1e3, 1)
            out["final_status"] = poller.latest()
            metrics = vllm_serve.http_get(f"http://127.0.0.1:{port}/metrics")
            out["demand_wait"] = {f"p{int(q * 100)}_le_s": _histogram_quantile(
                metrics, "kvelastic_demand_wait_seconds", q)[0] for q in (0.5, 0.99)}
            out["demand_wait"]["count"] = _histogram_quantile(metrics, "kvelastic_demand_wait_seconds", 0.5)[1]
            out["daemon_warnings"] = [line for line in daemon_log.read_text(errors="replace").splitlines()
                                      if " WARNING " in line or " ERROR " in line]
        after = _scrape(group)
        out["servers_died"] = [f"e{i}" for i, server in enumerate(group) if server.process().poll() is not None]
    out["results"] = results
    out["t_end"] = t_end - t0
    out["counters"] = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before)]
    return out


def summarize(mode: dict[str, Any], workload: load.Workload) -> dict[str, Any]:
    results: list[load.Result] = mode["results"]
    ok = [r for r in results if r.ok]
    phase_of = {req.idx: req.phase for req in workload.requests}
    # Every finished request has both times (``Result.ok``).
    ttft = [r.ttft for r in ok if r.ttft is not None]
    hot = [r.ttft for r in ok if r.hot and r.ttft is not None]
    e2e = [r.e2e for r in ok if r.e2e is not None]
    first = min((r.sent for r in results), default=0.0)
    span = max(mode["t_end"] - first, 1e-9)
    counters = [c for c in mode["counters"] if not any(math.isnan(v) for v in c.values())]  # live servers
    q = sum(c["prefix_cache_queries_total"] for c in counters)
    h = sum(c["prefix_cache_hits_total"] for c in counters)
    per_engine = [None if any(math.isnan(v) for v in c.values()) else c for c in mode["counters"]]
    return {
        "requests": len(results), "finished": len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "ttft_p50_ms": _ms(ttft, 0.5),
        "ttft_p90_ms": _ms(ttft, 0.9),
        "ttft_p99_ms": _ms(ttft, 0.99),
        "ttft_hot_p99_ms": _ms(hot, 0.99),
        "ttft_p99_ms_by_phase": [_ms([r.ttft for r in ok if phase_of[r.idx] == k and r.ttft is not None], 0.99)
                                 for k in range(len(workload.phases))],
        "ttft_mean_ms": _r(sum(ttft) / len(ttft) * 1e3 if ttft else None, 1),
        "e2e_p99_ms": _ms(e2e, 0.99),
        "makespan_s": round(span, 2),
        "throughput_req_s": round(len(ok) / span, 3),
        "throughput_output_tok_s": round(sum(len(r.tokens) for r in ok) / span, 1),
        "preemptions": int(sum(c["num_preemptions_total"] for c in counters)),
        "preemptions_per_engine": [int(c["num_preemptions_total"]) if c else None for c in per_engine],
        "prefix_cache_hit_rate": round(h / q, 4) if q else None,
        "prefix_cache_hit_rate_per_engine": [round(c["prefix_cache_hits_total"] / c["prefix_cache_queries_total"], 4)
                                             if c and c["prefix_cache_queries_total"] else None
                                             for c in per_engine],
        "server_start_seconds": mode["server_start_seconds"],
        "servers_died": mode["servers_died"],
        "bench_process_worst_stall": mode["bench_process_worst_stall"],
        "load_start": time.strftime("%H:%M:%S", time.localtime(mode["load_start_wall"]))
        + f'.{int(mode["load_start_wall"] % 1 * 1000):03d}',
    }


def footprint(status: dict[str, Any], bps_fallback: int) -> dict[str, Any]:
    """Held memory against what the engines' blocks need, packed into whole slabs."""
    held = packed = strict = 0
    per_engine = {}
    for e in status["engines"]:
        bps = (e["slab_bytes"] // (e["cached_bytes"] // e["cached_blocks"])) if e["cached_blocks"] else bps_fallback
        p = max(math.ceil((e["live_blocks"] + e["cached_blocks"]) / bps) * e["slab_bytes"], e["min_bytes"])
        s = max(math.ceil(e["live_blocks"] / bps) * e["slab_bytes"], e["min_bytes"])
        held, packed, strict = held + e["held_bytes"], packed + p, strict + s
        per_engine[e["engine_id"]] = {"held_bytes": e["held_bytes"], "slabs": e["slabs"],
                                      "live_blocks": e["live_blocks"], "cached_blocks": e["cached_blocks"],
                                      "min_bytes": e["min_bytes"], "idle": e["idle"], "blocks_per_slab": bps}
    return {"idle_footprint_bytes": held, "packed_floor_bytes": packed, "strict_floor_bytes": strict,
            "idle_footprint_over_packed_floor": round(held / packed, 3) if packed else None,
            "idle_footprint_over_strict_floor": round(held / strict, 3) if strict else None,
            "engines_2s_after": per_engine}


def compare_tokens(static: list[load.Result], elastic: list[load.Result]) -> dict[str, Any]:
    pairs = [(a, b) for a, b in zip(static, elastic) if a.ok and b.ok]
    mismatched = [a.idx for a, b in pairs if a.tokens != b.tokens]
    outputs = [tuple(a.tokens) for a, _ in pairs]
    return {"token_compared_requests": len(pairs), "token_mismatches": len(mismatched),
            "token_mismatch_requests": mismatched[:10],
            "text_mismatches": sum(1 for a, b in pairs if a.text != b.text),
            "distinct_completions": len(set(outputs)),
            "distinct_tokens_per_completion_mean": round(sum(len(set(o)) for o in outputs) / len(outputs), 1)
            if outputs else None}


def handoff(folder: pathlib.Path, quick: bool) -> dict[str, Any]:
    from kvelastic_tools.vllm_bench import elastic_handoff

    folder.mkdir(parents=True, exist_ok=True)
    slab = elastic_handoff.PAGE * elastic_handoff.PAGES_PER_SLAB
    with daemon(folder, HANDOFF_SLABS * slab) as (sock, port, _log):
        got = elastic_handoff.measure(sock, HANDOFF_SLABS, cycles=8 if quick else 16)
        metrics = vllm_serve.http_get(f"http://127.0.0.1:{port}/metrics")
    ms = [s * 1e3 for s in got["samples"]]
    return {"handoff_samples": len(ms), "handoff_refused": got["refused"], "handoff_slab_bytes": slab,
            "handoff_p50_ms": _r(_pct(ms, 0.5), 3), "handoff_p99_ms": _r(_pct(ms, 0.99), 3),
            "handoff_max_ms": _r(max(ms) if ms else None, 3),
            "handoff_daemon_demand_wait_p99_le_s": _histogram_quantile(metrics, "kvelastic_demand_wait_seconds",
                                                                       0.99)[0],
            "handoff_slab_moves": got["slab_moves"], "handoff_thrash": got["thrash"]}


def evidence(folder: pathlib.Path) -> str:
    """The telling lines of a failed mode's logs (the folder may be temporary)."""
    lines = []
    for log in sorted(folder.glob("*.log")):
        hits = [line for line in log.read_text(errors="replace").splitlines()
                if re.search(r"WARNING kvelastic|ERROR|Segfault|Error:|gone \(|failed \(|lost the daemon", line)]
        lines += [f"{log.name}: {line[:300]}" for line in hits[-12:]]
    return "\n".join(lines)


def choose_engines() -> tuple[int, int]:
    avail = mem_available()
    return (3 if avail >= 3 * SERVER_BYTES + 4096 * MiB else 2), avail


def run(quick: bool = False, png: str | None = None, workdir: str | None = None) -> dict[str, Any]:
    """``png``: where the plot goes; ``workdir``: a folder kept for the logs
    (default: a temporary one, removed)."""
    from kvelastic_tools.vllm_bench import elastic_plot
    from kvelastic_tools.vllm_bench.tinymodel import build_tiny_llama

    began = time.monotonic()
    png = png or os.environ.get("KVELASTIC_BENCH_ELASTIC_PNG") or "elastic.png"
    n, avail = choose_engines()
    total = n * PER_ENGINE
    shape = load.QUICK if quick else load.FULL
    workload = load.make_workload(n, shape, seed=0)
    model = build_tiny_llama(pathlib.Path(tempfile.gettempdir()) / "kvelastic-tiny-llama")
    with contextlib.ExitStack() as stack:
        tmp = pathlib.Path(workdir or stack.enter_context(
            tempfile.TemporaryDirectory(prefix="kvelastic-bench-elastic-")))
        modes = {}
        for name in ("static", "elastic"):
            try:
                modes[name] = run_mode(name, model, tmp / name, workload, total, quick)
            except Exception as exc:
                raise RuntimeError(f"{name} mode failed: {exc}\n{evidence(tmp / name)}") from exc
        # Where the median goes: stock engines that each hold the whole budget
        # (no split, no elasticity) run as many requests at once as elastic
        # ones may; what elastic costs beyond them is elasticity's own.
        whole = None if quick else run_mode("static", model, tmp / "whole", workload, total * n, quick)
        hand = handoff(tmp / "handoff", quick)
    static, elastic = (summarize(modes[m], workload) for m in ("static", "elastic"))
    el = modes["elastic"]
    from kvelastic_tools.vllm_bench.elastic_handoff import BLOCKS_PER_SLAB

    foot = footprint(el["status_2s_after"], BLOCKS_PER_SLAB)
    device = el["final_status"]["devices"][0] if el.get("final_status") else {}
    tokens = compare_tokens(modes["static"]["results"], el["results"])
    ratios = ttft_ratios(static, elastic)
    ratio = ratios["p99"]
    out: dict[str, Any] = {
        "benchmark": "elastic", "quick": quick,
        "model": "tiny random Llama (2 layers, fp32, block 32 tokens = 32 KiB, slab 4 MiB = 128 blocks)",
        "engines": n,
        "engines_why": f"3 if MemAvailable ({avail // MiB} MiB) holds 3 servers of ~{SERVER_BYTES // MiB} "
                       f"MiB and 4 GiB to spare, else 2",
        "total_kv_bytes": total, "static_per_engine_bytes": total // n,
        "daemon": {"KVELASTIC_MEMORY": total, "KVELASTIC_IDLE_GRACE": IDLE_GRACE, "KVELASTIC_HOLD_DOWN": HOLD_DOWN,
                   "KVELASTIC_BACKEND": "host"},
        "workload": {**{k: getattr(shape, k) for k in shape.__dataclass_fields__}, "requests": len(workload.requests),
                     "hot_burst_blocks_needed": shape.burst_size * (math.ceil(shape.suffix_len / 32) +
                                                                    math.ceil(shape.max_tokens / 32))
                     + shape.system_prompts * shape.system_len // 32,
                     "phases": [(round(p.start, 2), round(p.end, 2), f"e{p.hot}") for p in workload.phases]},
        "server_rss_bytes": {"static": modes["static"]["server_rss_bytes"], "elastic": el["server_rss_bytes"]},
        "static": static, "elastic": elastic,
        "ttft_p99_ratio": ratio, "ttft_ratios": ratios,
        "static_whole_budget_each": None if whole is None else summarize(whole, workload),
        "ttft_ratios_vs_static_whole_budget_each": None if whole is None
        else ttft_ratios(summarize(whole, workload), elastic),
        **foot, **tokens, **hand,
        "slab_moves": device.get("slab_moves"), "thrash": device.get("thrash"),
        "vllm_run_demand_wait": el.get("demand_wait"), "status_poll_errors": el.get("status_errors"),
        "status_poll_latency_max_ms": el.get("status_latency_max_ms"),
    }
    # Both modes served every request: otherwise the TTFT figures cover different requests.
    out["comparable"] = static["finished"] == elastic["finished"] == len(workload.requests)
    out["targets"] = {
        "ttft_p50_le_0.9x_static": {"value": ratios["p50"], "target": TARGETS["ttft_p50_ratio_max"],
                                    "met": out["comparable"] and ratios["p50"] is not None
                                    and ratios["p50"] <= TARGETS["ttft_p50_ratio_max"]},
        "ttft_p99_le_0.25x_static": {"value": ratio, "target": TARGETS["ttft_p99_ratio_max"],
                                     "met": out["comparable"] and ratio is not None
                                     and ratio <= TARGETS["ttft_p99_ratio_max"]},
        "idle_footprint_le_1.1x_packed_floor_2s_after": {
            "value": foot["idle_footprint_over_packed_floor"],
            "target": TARGETS["idle_footprint_over_packed_floor_max"],
            "met": foot["idle_footprint_over_packed_floor"] is not None
            and foot["idle_footprint_over_packed_floor"] <= TARGETS["idle_footprint_over_packed_floor_max"]},
        "handoff_p99_le_100ms": {"value": out["handoff_p99_ms"], "target": TARGETS["handoff_p99_ms_max"],
                                 "met": out["handoff_p99_ms"] is not None
                                 and out["handoff_p99_ms"] <= TARGETS["handoff_p99_ms_max"]},
        "no_thrash": {"value": out["thrash"], "target": 0, "met": out["thrash"] == 0},
        "no_token_mismatch": {"value": tokens["token_mismatches"], "target": 0,
                              "met": tokens["token_mismatches"] == 0 and tokens["token_compared_requests"] > 0},
    }
    out["targets_met"] = all(t["met"] for t in out["targets"].values())
    out["plot"] = str(pathlib.Path(png).resolve())
    elastic_plot.plot(out["plot"], workload, modes, total // n)
    warnings = el.get("daemon_warnings", [])
    out["daemon_warnings"] = {"count": len(warnings), "engines_dropped": sum("gone (" in w for w in warnings),
                              "engines_failed": sum("failed (" in w for w in warnings),
                              "drops": [w for w in warnings if "gone (" in w or "failed (" in w][:5],
                              "first": warnings[:5]}
    out["seconds"] = round(time.monotonic() - began, 1)
    return out


if __name__ == "__main__":
    print(json.dumps(run(quick="--quick" in sys.argv), sort_keys=True))
