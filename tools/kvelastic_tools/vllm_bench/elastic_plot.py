"""The plots of ``kvelastic bench elastic``, one per scenario: memory held per
elastic engine over one repetition (load phases shaded, in the hot engine's
colour), the requests each mode's hot engine ran and queued over the same
repetition, the TTFT CDFs of the three modes over every repetition, and each
repetition's ratios (elastic over the limit, elastic over the static split)
with the targets."""

from __future__ import annotations

import statistics
from typing import Any

from kvelastic_tools.vllm_bench.elastic_load import Workload

MiB = 1 << 20
COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red")
MODE_STYLE = {"static": ("tab:red", "--"), "elastic": ("tab:green", "-"), "limit": ("tab:gray", ":")}


def typical_rep(report: dict[str, Any]) -> int:
    """The repetition whose elastic p99 over the limit's is the median one."""
    reps = report["ratios"]["vs_limit"]["p99"]["reps"]
    known = [(v, i) for i, v in enumerate(reps) if v is not None]
    if not known:
        return 0
    med = statistics.median_low([v for v, _ in known])
    return next(i for v, i in known if v == med)


def plot_scenario(path: str, name: str, workloads: list[Workload], runs: dict[str, list[dict[str, Any]]],
                  report: dict[str, Any], total: int, share: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rep = typical_rep(report)
    workload = workloads[rep]
    n = workload.engines
    elastic = runs["elastic"][rep]
    samples = elastic.get("status_samples", [])
    end = max([t for t, _ in samples] + [runs[m][rep]["t_end"] for m in runs] + [1.0])
    fig, (ax_mem, ax_run, ax_cdf, ax_ratio) = plt.subplots(
        4, 1, figsize=(11, 14), gridspec_kw={"height_ratios": [1.5, 1.1, 1.3, 1.0]})
    for ax in (ax_mem, ax_run):
        for phase in workload.phases:
            ax.axvspan(phase.start, phase.end, color=COLORS[phase.hot % len(COLORS)], alpha=0.12, lw=0)
        ax.set_xlim(0.0, end)
    names = [f"e{i}" for i in range(n)]
    if samples:
        times = [t for t, _ in samples]
        held = [[s["engines"].get(e, {}).get("held", 0) / MiB for _, s in samples] for e in names]
        ax_mem.stackplot(times, *held, labels=names, colors=COLORS[:n], alpha=0.8)
        live = [sum(v["live"] for v in s["engines"].values()) * 32 * 1024 / MiB for _, s in samples]
        ax_mem.plot(times, live, color="k", lw=0.8, label="live blocks (all engines)")
    ax_mem.axhline(total / MiB, color="k", ls="--", lw=0.8, label="budget T")
    ax_mem.axhline(share / MiB, color="tab:red", ls=":", lw=0.8, label="a static share T/N")
    ax_mem.set_ylim(0, total / MiB * 1.08)
    ax_mem.set_ylabel("KV memory held (MiB)")
    ax_mem.set_title(f"{name}: elastic, one daemon with T = {total / MiB:.0f} MiB, repetition {rep} "
                     "(daemon status every 150 ms; shaded: each phase's arrivals, coloured by its hot engine)",
                     fontsize=9)
    ax_mem.legend(loc="upper right", fontsize=7)
    for mode, (color, style) in MODE_STYLE.items():
        gauges = runs[mode][rep].get("gauges", [])
        for k, phase in enumerate(workload.phases):   # one line a phase: the hot engine's, until the next
            until = workload.phases[k + 1].start if k + 1 < len(workload.phases) else end
            pts = [(t, g[phase.hot]) for t, g in gauges
                   if phase.start <= t < until and phase.hot < len(g) and g[phase.hot] is not None]
            if pts:
                ax_run.plot([t for t, _ in pts], [x[0] for _, x in pts], style, color=color,
                            label=f"{mode}: running" if k == 0 else None)
                ax_run.plot([t for t, _ in pts], [x[1] for _, x in pts], style, color=color, alpha=0.4,
                            label=f"{mode}: waiting" if k == 0 else None)
    ax_run.set_ylabel("hot engine's requests")
    ax_run.set_xlabel("seconds since the load started")
    ax_run.set_title("requests the hot engine ran and queued, from its phase to the next (vLLM's gauges every "
                     "250 ms), same repetition",
                     fontsize=9)
    ax_run.legend(loc="upper right", fontsize=7, ncol=3)
    for mode, (color, style) in MODE_STYLE.items():
        ttft = sorted(r.ttft * 1e3 for run in runs[mode] for r in run["results"] if r.ok)
        if ttft:
            ax_cdf.plot(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], style, color=color,
                        label=f"{mode} ({len(runs[mode])} repetitions)")
    ax_cdf.set_xscale("log")
    ax_cdf.set_xlabel("time to first token (ms, log)")
    ax_cdf.set_ylabel("fraction of requests")
    ax_cdf.set_title("TTFT CDF, every repetition", fontsize=9)
    ax_cdf.grid(True, which="both", alpha=0.3)
    ax_cdf.legend(loc="lower right", fontsize=8)
    qs = ("p50", "p90", "p99", "mean", "throughput")
    for k, (key, color, label) in enumerate((("vs_limit", "tab:gray", "elastic / limit"),
                                             ("vs_static", "tab:red", "elastic / static split"))):
        for j, q in enumerate(qs):
            vals = [v for v in report["ratios"][key][q]["reps"] if v is not None]
            xs = [j + (k - 0.5) * 0.25] * len(vals)
            ax_ratio.scatter(xs, vals, color=color, s=14, label=label if j == 0 else None)
            if vals:
                ax_ratio.hlines(statistics.median(vals), xs[0] - 0.1, xs[0] + 0.1, color=color, lw=2)
    if name == "contended":
        ax_ratio.axhline(1.05, color="tab:gray", ls="--", lw=0.8, label="1.05 (median vs limit)")
        ax_ratio.axhline(0.25, color="tab:red", ls="--", lw=0.8, label="0.25 (p99 vs static)")
    else:
        ax_ratio.axhline(1.05, color="tab:red", ls="--", lw=0.8, label="1.05 (median vs stock)")
        ax_ratio.axhline(1.15, color="tab:red", ls=":", lw=0.8, label="1.15 (worst vs stock)")
    ax_ratio.set_yscale("log")
    ax_ratio.set_xticks(range(len(qs)), ["TTFT p50", "TTFT p90", "TTFT p99", "TTFT mean", "throughput (inverse)"])
    ax_ratio.set_ylabel("ratio (log)")
    ax_ratio.set_title("each repetition's ratio (dots) and the median (bar); below 1: elastic better", fontsize=9)
    ax_ratio.grid(True, which="both", axis="y", alpha=0.3)
    ax_ratio.legend(loc="upper left", fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
