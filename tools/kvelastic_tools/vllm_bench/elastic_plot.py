"""The plot of ``kvelastic bench elastic``: memory held per engine over time in
both modes (load phases shaded, in the hot engine's colour) and the TTFT
CDFs of both modes."""

from __future__ import annotations

from typing import Any

from kvelastic_tools.vllm_bench.elastic_load import Workload

MiB = 1 << 20
COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red")


def plot(path: str, workload: Workload, modes: dict[str, dict[str, Any]], per_engine: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = workload.engines
    elastic = modes["elastic"]
    samples = elastic.get("status_samples", [])
    end = max([t for t, _ in samples] + [modes[m]["t_end"] for m in modes] + [1.0])
    fig, (ax_static, ax_elastic, ax_cdf) = plt.subplots(3, 1, figsize=(11, 11),
                                                        gridspec_kw={"height_ratios": [1, 1.6, 1.4]})
    for ax in (ax_static, ax_elastic):
        for phase in workload.phases:
            ax.axvspan(phase.start, phase.end, color=COLORS[phase.hot], alpha=0.12, lw=0)
        ax.set_xlim(min(0.0, min((t for t, _ in samples), default=0.0)), end)
        ax.set_ylabel("KV memory held (MiB)")
    names = [f"e{i}" for i in range(n)]
    ax_static.stackplot([0, end], *[[per_engine / MiB] * 2 for _ in names], labels=names,
                        colors=COLORS[:n], alpha=0.8)
    ax_static.set_title(f"static split: {n} x {per_engine / MiB:.0f} MiB (shaded: each phase's arrivals, "
                        "coloured by its hot engine)")
    ax_static.set_ylim(0, n * per_engine / MiB * 1.05)
    if samples:
        times = [t for t, _ in samples]
        held = [[s.get(name, 0) / MiB for _, s in samples] for name in names]
        ax_elastic.stackplot(times, *held, labels=names, colors=COLORS[:n], alpha=0.8)
    ax_elastic.axhline(n * per_engine / MiB, color="k", ls="--", lw=0.8, label="budget T")
    ax_elastic.set_ylim(0, n * per_engine / MiB * 1.05)
    ax_elastic.set_title("elastic: one kvelastic daemon, the same budget T (daemon status every 150 ms)")
    ax_elastic.set_xlabel("seconds since the load started")
    ax_elastic.legend(loc="upper right", fontsize=8)
    for name, style in (("static", "--"), ("elastic", "-")):
        ttft = sorted(r.ttft * 1e3 for r in modes[name]["results"] if r.ok)
        if ttft:
            ax_cdf.plot(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], style, label=f"{name} (all)")
        hot = sorted(r.ttft * 1e3 for r in modes[name]["results"] if r.ok and r.hot)
        if hot:
            ax_cdf.plot(hot, [(i + 1) / len(hot) for i in range(len(hot))], style, alpha=0.5,
                        label=f"{name} (hot engine's requests)")
    ax_cdf.set_xscale("log")
    ax_cdf.set_xlabel("time to first token (ms, log)")
    ax_cdf.set_ylabel("fraction of requests")
    ax_cdf.set_title("TTFT CDF")
    ax_cdf.grid(True, which="both", alpha=0.3)
    ax_cdf.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
