"""The figures of ``kvelastic bench elastic``: one run's (a mode, a scenario,
a repetition), their spread over the repetitions, the ratios between modes
and the verdicts. Pure functions of what ``elastic`` recorded: no process,
no clock."""

from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Callable, Iterable
from typing import Any

from kvelastic_tools.figures import percentile
from kvelastic_tools.vllm_bench import elastic_load as load

MiB = 1 << 20
QUANTILES = ("p50", "p90", "p99")
# Verdicts (the issue's): kvelastic against the limit (every engine with the whole budget) at
# p50, p90, p99 and in throughput, the median over the repetitions and the worst one; against
# the static split, what a split costs users; in the uncontended scenario, against stock.
TARGETS = {"vs_limit_median_max": 1.05, "vs_limit_worst_max": 1.2, "vs_static_p99_median_max": 0.25,
           "uncontended_median_max": 1.05, "uncontended_worst_max": 1.15,
           "idle_footprint_over_packed_floor_max": 1.1, "handoff_p99_ms_max": 100.0}


def _pct(values: list[float], q: float) -> float | None:
    """``percentile``, or None (JSON null) for no values."""
    return percentile(values, q) if values else None


def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(x, nd)


def _ms(seconds: list[float], q: float) -> float | None:
    """Quantile ``q`` of ``seconds`` in milliseconds (0.1 ms); None for none."""
    x = _pct(seconds, q)
    return None if x is None else round(x * 1e3, 1)


# ------------------------------------------------------------ one run
def in_flight(results: list[load.Result]) -> Callable[[float], int]:
    """How many of ``results`` were in flight (sent, not finished) at a time."""
    starts = sorted(r.sent for r in results if r.e2e is not None)
    ends = sorted(r.sent + r.e2e for r in results if r.e2e is not None)

    def count(t: float) -> int:
        return bisect.bisect_right(starts, t) - bisect.bisect_right(ends, t)

    return count


def summarize(results: list[load.Result], workload: load.Workload, t_end: float,
              counters: list[dict[str, float]], gauges: list[tuple[float, list[Any]]]) -> dict[str, Any]:
    """One run's figures: TTFT quantiles and mean, time per output token,
    throughput, vLLM's preemptions and prefix hits (``counters``: each
    server's deltas), and how many requests the hot engine ran and queued
    (``gauges``: (seconds after the start, [(running, waiting) per server])."""
    ok = [r for r in results if r.ok]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    tpot = [(r.e2e - r.ttft) / (len(r.tokens) - 1) for r in ok
            if r.e2e is not None and r.ttft is not None and len(r.tokens) > 1]
    first = min((r.sent for r in results), default=0.0)
    span = max(t_end - first, 1e-9)
    live = [c for c in counters if not any(math.isnan(v) for v in c.values())]
    q = sum(c["prefix_cache_queries_total"] for c in live)
    h = sum(c["prefix_cache_hits_total"] for c in live)
    # The hot engine's gauges while its phase's requests arrive.
    running, waiting = [], []
    for phase in workload.phases:
        for t, sample in gauges:
            got = sample[phase.hot] if phase.hot < len(sample) else None
            if got is not None and phase.start <= t <= phase.end:
                running.append(got[0])
                waiting.append(got[1])
    return {
        "requests": len(results), "finished": len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "ttft_p50_ms": _ms(ttft, 0.5), "ttft_p90_ms": _ms(ttft, 0.9), "ttft_p99_ms": _ms(ttft, 0.99),
        "ttft_mean_ms": _r(statistics.fmean(ttft) * 1e3 if ttft else None, 1),
        "ttft_min_ms": _r(min(ttft) * 1e3 if ttft else None, 1),
        "ttft_hot_p99_ms": _ms([r.ttft for r in ok if r.hot and r.ttft is not None], 0.99),
        "tpot_mean_ms": _r(statistics.fmean(tpot) * 1e3 if tpot else None, 2),
        "e2e_p50_ms": _ms([r.e2e for r in ok if r.e2e is not None], 0.5),
        "makespan_s": round(span, 2),
        # From the last request sent to the last token: about one request's time when the mode kept up.
        "drain_s": round(t_end - max((r.sent for r in results), default=0.0), 2),
        "throughput_req_s": round(len(ok) / span, 3),
        "throughput_output_tok_s": round(sum(len(r.tokens) for r in ok) / span, 1),
        "preemptions": int(sum(c["num_preemptions_total"] for c in live)),
        "prefix_cache_hit_rate": round(h / q, 4) if q else None,
        "hot_running_mean": _r(statistics.fmean(running) if running else None, 2),
        "hot_running_max": max(running, default=None),
        "hot_waiting_mean": _r(statistics.fmean(waiting) if waiting else None, 2),
        "hot_waiting_max": max(waiting, default=None),
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


def compare_tokens(reference: list[load.Result], other: list[load.Result]) -> dict[str, Any]:
    """Greedy outputs of the same requests, token for token (those both finished)."""
    pairs = [(a, b) for a, b in zip(reference, other) if a.ok and b.ok]
    mismatched = [a.idx for a, b in pairs if a.tokens != b.tokens]
    outputs = [tuple(a.tokens) for a, _ in pairs]
    return {"token_compared_requests": len(pairs), "token_mismatches": len(mismatched),
            "token_mismatch_requests": mismatched[:10],
            "text_mismatches": sum(1 for a, b in pairs if a.text != b.text),
            "distinct_completions": len(set(outputs)),
            "distinct_tokens_per_completion_mean": round(sum(len(set(o)) for o in outputs) / len(outputs), 1)
            if outputs else None}


def _nearest(samples: list[tuple[float, Any]], times: list[float], t: float, within: float) -> Any:
    i = bisect.bisect_left(times, t)
    best = min((j for j in (i - 1, i) if 0 <= j < len(samples)), key=lambda j: abs(times[j] - t), default=None)
    return samples[best][1] if best is not None and abs(times[best] - t) <= within else None


def held_under_load(status_samples: list[tuple[float, dict[str, Any]]], gauges: list[tuple[float, list[Any]]],
                    results: list[load.Result], total: int, slab: int) -> dict[str, Any]:
    """The share of the budget the engines held while requests were in flight,
    and every stretch where at least a slab of it was held by no engine while
    an engine had requests waiting in vLLM's queue (memory unused while
    someone waits: what the plot of an earlier run showed), with what the
    daemon said of each engine then."""
    count = in_flight(results)
    gauge_times = [t for t, _ in gauges]
    shares: list[float] = []
    episodes: list[dict[str, Any]] = []
    open_ep: dict[str, Any] | None = None
    prev_t = None
    unheld_waiting_s = 0.0
    for t, s in status_samples:
        held = sum(e["held"] for e in s["engines"].values())
        unheld = total - held
        busy = count(t) > 0
        if busy:
            shares.append(held / total)
        g = _nearest(gauges, gauge_times, t, 0.4)
        waiting = [i for i, x in enumerate(g or []) if x is not None and x[1] > 0]
        dt = 0.0 if prev_t is None else t - prev_t
        prev_t = t
        if busy and waiting and unheld >= slab:
            unheld_waiting_s += dt
            if open_ep is None:
                open_ep = {"start_s": round(t, 2), "end_s": round(t, 2), "max_unheld_mib": 0.0, "samples": 0,
                           "waiting_engines": set(), "first": None}
            open_ep["end_s"] = round(t, 2)
            open_ep["samples"] += 1
            open_ep["waiting_engines"].update(f"e{i}" for i in waiting)
            if unheld / MiB > open_ep["max_unheld_mib"]:
                open_ep["max_unheld_mib"] = round(unheld / MiB, 2)
                open_ep["first"] = {"free_mib": round(s["free"] / MiB, 2),
                                    "unallocated_mib": round(s["unallocated"] / MiB, 2),
                                    "waiting": {f"e{i}": g[i][1] for i in waiting},
                                    "running": {f"e{i}": x[0] for i, x in enumerate(g) if x is not None},
                                    "engines": {k: {**v, "held": round(v["held"] / MiB, 2)}
                                                for k, v in s["engines"].items()}}
        elif open_ep is not None:
            open_ep["waiting_engines"] = sorted(open_ep["waiting_engines"])
            episodes.append(open_ep)
            open_ep = None
    if open_ep is not None:
        open_ep["waiting_engines"] = sorted(open_ep["waiting_engines"])
        episodes.append(open_ep)
    episodes.sort(key=lambda e: (-(e["end_s"] - e["start_s"]), -e["max_unheld_mib"]))
    return {"held_share_mean": _r(statistics.fmean(shares) if shares else None, 3),
            "held_share_min": _r(min(shares) if shares else None, 3),
            "unheld_while_waiting_s": round(unheld_waiting_s, 2),
            "unheld_while_waiting_episodes": len(episodes),
            "longest_unheld_while_waiting": episodes[:3]}


# ------------------------------------------------- over the repetitions
def spread(values: Iterable[float | None]) -> dict[str, Any]:
    """Median, min and max of the repetitions' values (None ignored), and the values."""
    got = list(values)
    real = [v for v in got if v is not None]
    if not real:
        return {"median": None, "min": None, "max": None, "reps": got}
    return {"median": _r(statistics.median(real), 4), "min": _r(min(real), 4), "max": _r(max(real), 4), "reps": got}


SPREAD_KEYS = ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "ttft_mean_ms", "ttft_min_ms", "tpot_mean_ms",
               "throughput_req_s", "throughput_output_tok_s", "preemptions", "prefix_cache_hit_rate",
               "hot_running_mean", "hot_waiting_mean", "finished", "cpu_ms_per_request",
               "kvelastic_cpu_ms_per_request")


def mode_spread(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {k: spread(r.get(k) for r in runs) for k in SPREAD_KEYS}


def ratio(a: float | None, b: float | None) -> float | None:
    return _r(a / b, 3) if a is not None and b else None


def ratios(mine: list[dict[str, Any]], base: list[dict[str, Any]]) -> dict[str, Any]:
    """Per repetition, ``mine`` over ``base`` at each TTFT quantile and the mean,
    and ``base``'s throughput over ``mine``'s (above 1: ``mine`` served less),
    with their spread."""
    out = {q: spread(ratio(m[f"ttft_{q}_ms"], b[f"ttft_{q}_ms"]) for m, b in zip(mine, base)) for q in QUANTILES}
    out["mean"] = spread(ratio(m["ttft_mean_ms"], b["ttft_mean_ms"]) for m, b in zip(mine, base))
    out["throughput"] = spread(ratio(b["throughput_req_s"], m["throughput_req_s"]) for m, b in zip(mine, base))
    return out


def _target(value: float | None, bound: float, ok: Callable[[float], bool], comparable: bool,
            what: str) -> dict[str, Any]:
    return {"value": value, "bound": bound, "what": what, "met": comparable and value is not None and ok(value)}


def targets(name: str, r: dict[str, Any], comparable: bool, tokens_ok: bool, footprint_worst: float | None,
            thrash: int | None) -> dict[str, dict[str, Any]]:
    """The verdicts of one scenario (``r``: its ratios, ``ratios``'s shape,
    under ``vs_limit``, ``vs_static``)."""
    out: dict[str, dict[str, Any]] = {}
    le = lambda bound: (lambda v: v <= bound)   # noqa: E731 - a bound's test, read in place
    if name == "contended":
        lim, st = r["vs_limit"], r["vs_static"]
        for q in (*QUANTILES, "throughput"):
            out[f"{q}_vs_limit_median_le_1.05"] = _target(lim[q]["median"], TARGETS["vs_limit_median_max"],
                                                          le(TARGETS["vs_limit_median_max"]), comparable,
                                                          f"elastic / limit, {q}: median over repetitions")
            out[f"{q}_vs_limit_worst_le_1.2"] = _target(lim[q]["max"], TARGETS["vs_limit_worst_max"],
                                                        le(TARGETS["vs_limit_worst_max"]), comparable,
                                                        f"elastic / limit, {q}: worst repetition")
        for q in ("mean", "p90", "p99"):
            out[f"ttft_{q}_below_static_every_rep"] = _target(st[q]["max"], 1.0, lambda v: v < 1.0, comparable,
                                                             f"elastic / static split, TTFT {q}: worst repetition")
        out["ttft_p99_vs_static_median_le_0.25"] = _target(st["p99"]["median"], TARGETS["vs_static_p99_median_max"],
                                                            le(TARGETS["vs_static_p99_median_max"]), comparable,
                                                            "elastic / static split, TTFT p99: median")
    else:
        stock = r["vs_static"]
        for q in (*QUANTILES, "throughput"):
            out[f"{q}_vs_stock_median_le_1.05"] = _target(stock[q]["median"], TARGETS["uncontended_median_max"],
                                                          le(TARGETS["uncontended_median_max"]), comparable,
                                                          f"elastic / stock (static split), {q}: median")
            out[f"{q}_vs_stock_worst_le_1.15"] = _target(stock[q]["max"], TARGETS["uncontended_worst_max"],
                                                         le(TARGETS["uncontended_worst_max"]), comparable,
                                                         f"elastic / stock (static split), {q}: worst repetition")
    out["every_request_finished"] = {"value": comparable, "bound": True, "what": "every mode, every repetition",
                                     "met": comparable}
    out["tokens_identical_across_modes"] = {"value": tokens_ok, "bound": True, "met": tokens_ok,
                                            "what": "greedy tokens of elastic and limit against the static split"}
    out["idle_footprint_le_1.1x_packed_floor"] = _target(
        footprint_worst, TARGETS["idle_footprint_over_packed_floor_max"],
        le(TARGETS["idle_footprint_over_packed_floor_max"]), True, "2 s after each elastic run: worst repetition")
    out["no_thrash"] = {"value": thrash, "bound": 0, "met": thrash == 0, "what": "slab moves back within the window"}
    return out
