"""The node simulation's figures and plot (``node.py`` runs it)."""

from __future__ import annotations

import bisect
import os
from typing import TYPE_CHECKING, Any

from kvelastic_tools.figures import percentile
from kvelastic_tools.sim.node_engine import IDLE_SETTLE
from kvelastic_tools.sim.node_sim import BUDGET_PAGES, DAEMON_TICK, SAMPLE, STATUS_EVERY
from kvelastic_tools.sim.traces import GIB, PAGE

if TYPE_CHECKING:
    from kvelastic_tools.sim.node_sim import NodeSim


def _time_mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def summarize(sim: NodeSim, oracle: list[float], day_samples: int) -> dict[str, Any]:
    """Figures of one run over the day's samples (``oracle``: bytes per second)."""
    budget = sim.budget_bytes
    rows = sim.samples[:day_samples]
    live = [sum(r["live"]) for r in rows]
    held = [sum(r["held"]) for r in rows]
    cached = [sum(r["cached"]) for r in rows]
    n = min(len(rows), len(oracle))
    achieved = sum(live[:n]) / budget / max(1, n)
    best = sum(min(o, budget) for o in oracle[:n]) / budget / max(1, n)
    requests = sum(e.stats["arrived"] for e in sim.engines)
    delays = [d for e in sim.engines for d in e.queue_delays]
    day_end = sim.trace.day_seconds
    out = {
        "requests": requests,
        "served_in_day": bisect.bisect_right(sorted(sim.finished_at), day_end),
        "served": sum(e.finished for e in sim.engines),
        "waited": sum(e.stats["waited"] for e in sim.engines),
        "preemptions": sum(e.stats["preemptions"] for e in sim.engines),
        "queue_delay_s": {"mean": round(_time_mean(delays), 3), "p50": round(percentile(delays, 0.5), 3),
                          "p99": round(percentile(delays, 0.99), 3), "max": round(max(delays, default=0.0), 3)},
        "scheduler_stall_s": round(sum(e.stalled for e in sim.engines), 2),
        "utilisation_live": round(achieved, 4),
        "utilisation_held": round(_time_mean(held) / budget, 4),
        "utilisation_cached": round(_time_mean(cached) / budget, 4),
        "oracle_utilisation": round(best, 4),
        "ratio_live_vs_oracle": round(achieved / best, 4) if best else 0.0,
        "prefix_hit_rate": round(sum(e.stats["hit_blocks"] for e in sim.engines)
                                 / max(1, sum(e.stats["prompt_blocks"] for e in sim.engines)), 4),
    }
    return out


def idle_report(sim: NodeSim) -> dict[str, Any]:
    """Each engine with quiet stretches (no request for ``IDLE_SETTLE`` seconds
    or more): what it held then. Its reserve must be gone (no empty slab, the
    daemon books nothing beyond its slabs with cached or live blocks); its
    cache may yield to other engines' demand."""
    settle = sim.allocator.rules.idle_grace + IDLE_SETTLE
    out: dict[str, Any] = {}
    for e, engine in enumerate(sim.engines):
        rows = [r for r in sim.samples if r["quiet_for"][e] >= settle and r["t"] <= sim.trace.day_seconds]
        if not rows:
            continue
        stretches: list[list[dict]] = []
        for r in rows:
            if stretches and r["t"] - stretches[-1][-1]["t"] <= SAMPLE + 1e-9:
                stretches[-1].append(r)
            else:
                stretches.append([r])
        longest = max(stretches, key=len)
        before = [r for r in sim.samples if r["t"] < longest[0]["t"] and r["quiet_for"][e] < SAMPLE]
        out[engine.name] = {
            "quiet_samples": len(rows),
            "held_gib_at_last_request": round(before[-1]["held"][e] / GIB, 3) if before else 0.0,
            "longest_quiet_s": [round(longest[0]["t"], 1), round(longest[-1]["t"], 1)],
            "held_gib_longest_start": round(longest[0]["held"][e] / GIB, 3),
            "held_gib_longest_end": round(longest[-1]["held"][e] / GIB, 3),
            "held_gib_longest_min": round(min(r["held"][e] for r in longest) / GIB, 3),
            "max_empty_slabs": max(r["empty_slabs"][e] for r in rows),
            "max_slabs_beyond_cached_live": max(r["held_slabs"][e] - (r["pool_slabs"][e] - r["empty_slabs"][e])
                                                for r in rows),
        }
    return out


def plot(path: str, sim: NodeSim, oracle: list[float], static: NodeSim) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trace = sim.trace
    rows = [r for r in sim.samples if r["t"] <= sim.settled_at]
    hours = [trace.hour(r["t"]) for r in rows]
    fig, ax = plt.subplots(figsize=(13, 6.5))
    stacks = [[r["held"][i] / GIB for r in rows] for i in range(len(sim.engines))]
    ax.stackplot(hours, *stacks, labels=[f"{e.name} ({e.model.name})" for e in sim.engines], alpha=0.75)
    n = min(len(rows), len(oracle))
    ax.plot(hours[:n], [min(o, sim.budget_bytes) / GIB for o in oracle[:n]], color="black", lw=1.4,
            label="oracle: min(live demand, budget)")
    ax.plot(hours, [sum(r["live"]) / GIB for r in rows], color="white", lw=0.9, ls="--",
            label="elastic: held by live blocks")
    static_rows = [r for r in static.samples if r["t"] <= static.settled_at]
    ax.plot([trace.hour(r["t"]) for r in static_rows], [sum(r["live"]) / GIB for r in static_rows],
            color="red", lw=0.9, ls=":", label="static split: held by live blocks")
    ax.axhline(sim.budget_bytes / GIB, color="grey", lw=0.8)
    for spans in trace.idle_windows().values():
        for start, end in spans:
            ax.axvspan(trace.hour(start), trace.hour(end), color="grey", alpha=0.1)
    ax.set_xlim(hours[0], hours[-1])
    ticks = [h for h in range(int(hours[0]), int(hours[-1]) + 1) if h % 3 == 0]
    ax.set_xticks(ticks, [f"{h % 24:02d}:00" for h in ticks])
    ax.set_xlabel(f"time of day (24 h compressed into {trace.day_seconds:g} simulated seconds, "
                  f"{86400 / trace.day_seconds:g}x; then the drain)")
    ax.set_ylabel("GiB held (daemon's books)")
    ax.set_title(f"kvelastic node simulation: 8 engines, {sim.budget_bytes / GIB:g} GiB in 2 MiB pages "
                 f"(seed {sim.seed}); shaded: office engine idle")
    ax.legend(loc="upper left", fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(sim: NodeSim, static: NodeSim, oracle: list[float], per_engine: list[list[float]],
           elastic_wall: float, static_wall: float, plot_path: str | None) -> dict[str, Any]:
    trace = sim.trace
    day = int(trace.day_seconds)
    alloc = sim.allocator
    elastic = summarize(sim, oracle, day)
    baseline = summarize(static, oracle, day)
    calls = sum(sim.calls.values())
    sustained = calls / sim.alloc_seconds if sim.alloc_seconds else 0.0
    peak = max(sim.per_second[:day])
    status_mean = _time_mean(sim.status_times)
    # The loop's load in each simulated second: the decisions made in it plus
    # a status snapshot every tick (its cost sampled in that second, or the mean).
    loop_load = [sim.busy_per_second[s] + (sim.status_per_second[s] or status_mean) / DAEMON_TICK
                 for s in range(day)]
    busiest = max(loop_load)
    busiest_at = loop_load.index(busiest)
    moves = alloc.moves["0"]
    requests = elastic["requests"]
    status = alloc.status()
    idle = idle_report(sim)
    handoffs = sim.handoffs
    kinds = {k: {"calls": v, "us_per_call": round(1e6 * sim.call_time[k] / v, 1)}
             for k, v in sorted(sim.calls.items())}
    result: dict[str, Any] = {
        "benchmark": "sim", "scale": "node", "seed": sim.seed,
        "node": {"engines": len(sim.engines), "budget_gib": sim.budget_bytes / GIB, "page_mib": PAGE >> 20,
                 "budget_pages": sim.budget_pages, "fraction_of_node": sim.budget_pages / BUDGET_PAGES,
                 "engines_detail": [{"name": e.name, "model": e.model.name, "workers": e.model.workers,
                                     "pages_per_worker": e.model.pages_per_worker,
                                     "slab_mib": e.model.slab_bytes >> 20, "blocks_per_slab": e.bps,
                                     "peak_rate_per_s": round(trace.peak_rates[e.index], 2),
                                     "peak_hour": e.spec.peak_hour} for e in sim.engines]},
        "trace": {"day_hours": 24, "starts_at_hour": trace.start_hour, "simulated_seconds": trace.day_seconds,
                  "compression": round(86400 / trace.day_seconds, 1),
                  "note": "the diurnal curve is compressed; request, protocol and grace timings are real",
                  "requests": len(trace.requests), "bursts": len(trace.bursts),
                  "drain_seconds": round(sim.now - trace.day_seconds, 1)},
        "allocator": {
            "decisions": calls, "seconds_inside": round(sim.alloc_seconds, 3),
            "decisions_per_s_sustained": round(sustained),
            "node_peak_decisions_per_s": peak,
            "headroom": round(sustained / peak, 2) if peak else 0.0,
            "busiest_second_decision_load": round(max(sim.busy_per_second[:day]), 4),
            "status_snapshot_ms": {"mean": round(status_mean * 1e3, 3),
                                   "max": round(max(sim.status_times, default=0.0) * 1e3, 3),
                                   "samples": len(sim.status_times)},
            "status_load_at_tick_rate": round(status_mean / DAEMON_TICK, 4),
            "busiest_second_loop_load": round(busiest, 4), "busiest_second_at_s": busiest_at,
            "headroom_busiest_second": round(1.0 / busiest, 2) if busiest else 0.0,
            "slowest_call_ms": round(sim.slowest[0] * 1e3, 3), "slowest_call_kind": sim.slowest[1],
            "slowest_call_at_s": round(sim.slowest[2], 2),
            "by_kind": kinds,
            "note": ("decisions: every Allocator input (messages, ticks, peers, pages created), timed on this "
                     "machine's one core; loop load: decisions plus the loop's status() snapshot each "
                     f"{DAEMON_TICK:g} s tick (sampled 1 in {STATUS_EVERY}); check() is not counted"),
        },
        "elastic": elastic,
        "static": baseline,
        "ratio_served_in_day_elastic_vs_static": round(elastic["served_in_day"] / max(1, baseline["served_in_day"]), 4),
        "ratio_waited_elastic_vs_static": round(elastic["waited"] / max(1, baseline["waited"]), 4),
        "ratio_preemptions_elastic_vs_static": round(elastic["preemptions"] / max(1, baseline["preemptions"]), 4),
        "ratio_utilisation_live_elastic_vs_static": round(elastic["utilisation_live"]
                                                          / max(1e-9, baseline["utilisation_live"]), 4),
        "ratio_queue_delay_p99_elastic_vs_static": round(elastic["queue_delay_s"]["p99"]
                                                         / max(1e-9, baseline["queue_delay_s"]["p99"]), 4),
        "demand": {
            "grows": sum(e.stats["demand_grows"] for e in sim.engines),
            "outcomes": dict(sorted(sim.grow_outcomes.items())),
            "client_timeouts": sum(e.stats["demand_timeouts"] for e in sim.engines),
            # admissions whose scheduler went on before the answer (it came as a late grant)
            "admissions_answered_late": sum(e.stats["admission_waits_ended"] for e in sim.engines),
            "latency_s": {"p50": round(percentile(sim.demand_latency, 0.5), 5),
                          "p99": round(percentile(sim.demand_latency, 0.99), 5),
                          "max": round(max(sim.demand_latency, default=0.0), 5)},
            "needed_reclaim": len(handoffs) + sim.handoffs_empty,
            "handoff_latency_s": {"count": len(handoffs), "p50": round(percentile(handoffs, 0.5), 5),
                                  "p99": round(percentile(handoffs, 0.99), 5),
                                  "max": round(max(handoffs, default=0.0), 5)},
            "handoffs_answered_empty": sim.handoffs_empty,
            "unanswered": sum(len(e.grows) for e in sim.engines),
        },
        "reserve_grows": sum(e.stats["reserve_grows"] for e in sim.engines),
        "returned_slabs": sum(e.stats["returned_slabs"] for e in sim.engines),
        "reclaimed_slabs": sum(e.stats["reclaimed_slabs"] for e in sim.engines),
        "reclaim_refused_slabs": sum(e.stats["refused_slabs"] for e in sim.engines),
        "slab_moves": moves, "thrash": alloc.thrash["0"],
        "thrash_examples": [{"t": t, "from": a, "to": b, "slabs": n} for t, a, b, n in sim.thrash_events[:8]],
        "demand_slabs_granted": sim.demand_slabs_granted,
        "status_slab_moves": status.devices[0].slab_moves, "status_thrash": status.devices[0].thrash,
        "moves_per_1000_requests": round(1000 * moves / max(1, requests), 2),
        "pages_created": sim.created_pages, "pages_released": sim.released_pages,
        "peak_pages_created_per_s": max(sim.created_per_second[:day]),
        # Page creation runs in the daemon's loop (cuMemCreate, ~193 us per 2 MiB page on an A100,
        # DESIGN.md anchors): its load at the busiest second, not included in the decisions above.
        "est_create_load_busiest_second_at_193us": round(max(sim.created_per_second[:day]) * 193e-6, 3),
        "rejected": dict(sim.rejected),
        "idle_engine": idle,
        "invariant_violations": len(sim.violations) + len(static.violations),
        "violation_examples": (sim.violations + static.violations)[:5],
        "sim_wall_seconds": {"elastic": round(elastic_wall, 1), "static": round(static_wall, 1)},
    }
    if plot_path:
        plot(plot_path, sim, oracle, static)
        result["plot"] = os.path.abspath(plot_path)
    return result
