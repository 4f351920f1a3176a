"""The figures of ``kvelastic bench tier``: per mode, the targets against
kvelastic without the tier, the host medium against the disk, and the
restart rounds against the run without a restart. Arithmetic over what the
modes measured (``tier.run_mode``), no I/O."""

from __future__ import annotations

import dataclasses
from typing import Any

from kvelastic_tools.figures import percentile
from kvelastic_tools.vllm_bench import tier_model
from kvelastic_tools.vllm_bench.tier_model import Workload

TARGETS = {"hit_rate_over_oracle_min": 0.9, "ttft_p50_over_kvelastic_max": 0.5, "throughput_over_kvelastic_min": 1.0}


def ms(values: list[float], q: float) -> float | None:
    return round(percentile(values, q) * 1e3, 1) if values else None


def part_of(requests: list[dict[str, Any]]) -> dict[str, Any]:
    """A stretch of the trace: its requests' hit rate and TTFT."""
    return stretch([(r["hits"] + r["external"], len(r["prompt"]), r["ttft_s"]) for r in requests])


def stretch(rows: list[tuple[float, int, float]]) -> dict[str, Any]:
    """(hit tokens, prompt tokens, TTFT) of some requests: their hit rate and TTFT quantiles."""
    queries = sum(q for _, q, _ in rows)
    ttfts = [t for _, _, t in rows]
    return {"requests": len(rows), "hit_rate": round(sum(h for h, _, _ in rows) / queries, 4) if queries else None,
            "ttft_p50_ms": ms(ttfts, 0.5), "ttft_p90_ms": ms(ttfts, 0.9)}


def restart_rounds_of(results: dict[str, dict[str, Any]], restarts: dict[str, str]) -> dict[str, Any]:
    """Each restart round (``restarts``: mode -> the mode it is judged
    against) against that mode run without one: the same requests after the
    restart point, so the ratio is what the restart cost, not what the second
    half of the trace differs from the first."""
    out: dict[str, Any] = {}
    for mode, against in restarts.items():
        restart = results.get(mode, {}).get("restart")
        if not restart:
            continue
        base = results.get(against, {}).get("_requests")
        row = {"kind": restart["kind"], "against": against, "after": restart["after"], "before": restart["before"],
               "same_tokens_as_stock": results[mode].get("same_tokens_as_stock")}
        if base is not None:
            same = stretch(base[restart["at_request"]:])
            row["without_restart"] = same
            if same["hit_rate"]:
                row["hit_rate_kept"] = round(restart["after"]["hit_rate"] / same["hit_rate"], 3)
        out[mode] = row
    return out


def tier_targets(modes: dict[str, dict[str, Any]]) -> dict[str, Any]:
    tier, base = modes.get("tier", {}), modes.get("kvelastic", {})
    ratio = tier.get("hit_rate_over_oracle")
    ttft = (tier["ttft_p50_ms"] / base["ttft_p50_ms"]) if tier.get("ttft_p50_ms") and base.get("ttft_p50_ms") else None
    thr = (tier["throughput_tok_s"] / base["throughput_tok_s"]) if tier.get("throughput_tok_s") and \
        base.get("throughput_tok_s") else None
    out = {"hit_rate_over_oracle": ratio, "ttft_p50_over_kvelastic": None if ttft is None else round(ttft, 3),
           "throughput_over_kvelastic": None if thr is None else round(thr, 3),
           "same_tokens": tier.get("same_tokens_as_stock")}
    out["met"] = {
        "hit_rate": ratio is not None and ratio >= TARGETS["hit_rate_over_oracle_min"],
        "ttft_p50": ttft is not None and ttft <= TARGETS["ttft_p50_over_kvelastic_max"],
        "throughput": thr is not None and thr >= TARGETS["throughput_over_kvelastic_min"],
        "same_tokens": bool(tier.get("same_tokens_as_stock")),
    }
    return out


def media_of(modes: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """The host medium against the disk on the same trace: the same hits are
    expected (the same index, budget and demotions), so what differs is a
    load's cost (TTFT of revisits, throughput)."""
    host, disk = modes.get("tier_host", {}), modes.get("tier", {})
    if "hit_rate" not in host or "hit_rate" not in disk:
        return None

    def ratio(key: str) -> float | None:
        return round(host[key] / disk[key], 3) if host.get(key) and disk.get(key) else None

    return {"hit_rate": [host["hit_rate"], disk["hit_rate"]], "ttft_p50": ratio("ttft_p50_ms"),
            "ttft_revisit_p50": ratio("ttft_revisit_p50_ms"), "throughput": ratio("throughput_tok_s")}


LMCACHE_TARGETS = {"hit_rate_min": 1.0, "ttft_p50_max": 0.7, "throughput_min": 1.0}


def against_lmcache(modes: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """kvelastic's tier (each medium) over LMCache's server on the same trace, and the targets."""
    lmc = modes.get("lmcache_mp", {})
    if "hit_rate" not in lmc:
        return None
    out: dict[str, Any] = {}
    for mode in ("tier", "tier_host"):
        mine = modes.get(mode, {})
        if "hit_rate" not in mine:
            continue

        def ratio(key: str, mine: dict[str, Any] = mine) -> float | None:
            return round(mine[key] / lmc[key], 3) if mine.get(key) and lmc.get(key) else None

        row: dict[str, Any] = {q: ratio(k) for q, k in (("hit_rate", "hit_rate"), ("ttft_p50", "ttft_p50_ms"),
                                        ("ttft_p90", "ttft_p90_ms"), ("ttft_p99", "ttft_p99_ms"),
                                        ("throughput", "throughput_tok_s"))}
        row["met"] = {"hit_rate": (row["hit_rate"] or 0) >= LMCACHE_TARGETS["hit_rate_min"],
                      "ttft_p50": row["ttft_p50"] is not None and row["ttft_p50"] <= LMCACHE_TARGETS["ttft_p50_max"],
                      "throughput": (row["throughput"] or 0) >= LMCACHE_TARGETS["throughput_min"],
                      "same_tokens": bool(mine.get("same_tokens_as_stock"))}
        out[mode] = row
    return out


def report(w: Workload, results: dict[str, dict[str, Any]], restarts: dict[str, str], ttl: str,
           tier_size: str) -> dict[str, Any]:
    """One workload's part of the output."""
    shape = tier_model.BENCH if w.model == "bench" else tier_model.TINY
    per_token = tier_model.kv_bytes_per_token(shape)
    return {
        "workload": {**dataclasses.asdict(w), "params": tier_model.params(shape),
                     "kv_bytes_per_token": per_token, "orphan_cache_ttl": ttl, "tier_size": tier_size,
                     "prefix_working_set_over_memory": round(w.working_set_tokens() * per_token / w.memory, 2)},
        "modes": {m: {k: v for k, v in r.items() if not k.startswith("_")} for m, r in results.items()},
        "tier_vs_kvelastic": tier_targets(results),
        "tier_host_vs_tier": media_of(results),
        "restart_rounds": restart_rounds_of(results, restarts),
        "tier_vs_lmcache": against_lmcache(results),
    }
