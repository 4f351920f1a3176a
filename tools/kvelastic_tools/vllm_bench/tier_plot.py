"""The plot of ``kvelastic bench tier``: per mode the hit rate against the
oracle's and the TTFT quantiles; per model the crossover (TTFT of a prefix
computed against loaded from the tier, over its length). From the bench's
JSON alone, so a saved run can be plotted again:

    python -m kvelastic_tools.vllm_bench.tier_plot RUN.json OUT.png
"""

from __future__ import annotations

import pathlib
from typing import Any


def plot(path: str, out: dict[str, Any], ttfts: dict[str, list[float]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # tier.MODES' order (a saved JSON sorts its keys)
    order = ("stock", "kvelastic", "tier", "tier_host", "kvelastic_ttl10m")
    modes = sorted((m for m, r in out["modes"].items() if "error" not in r),
                   key=lambda m: (order.index(m) if m in order else len(order), m))
    curves = {k: v for k, v in out.get("crossover", {}).items() if "points" in v}
    panels = 3 if curves else 2
    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 4.4))
    ax_hit, ax_ttft = axes[0], axes[1]
    rates = [out["modes"][m]["hit_rate"] for m in modes]
    ax_hit.bar(modes, rates, color="tab:blue")
    if modes:
        oracle = out["modes"][modes[0]]["oracle_hit_rate"]
        ax_hit.axhline(oracle, color="black", ls="--", lw=1, label=f"oracle (never evicts) {oracle:.2f}")
        ax_hit.axhline(0.9 * oracle, color="grey", ls=":", lw=1, label="0.9 x oracle (target)")
    for i, r in enumerate(rates):
        ax_hit.text(i, r, f"{r:.2f}", ha="center", va="bottom", fontsize=8)
    ax_hit.set_ylabel("prefix-cache hit rate (tokens)")
    ax_hit.set_title("Hit rate, local + tier")
    ax_hit.set_ylim(0, 1.3 * max([*rates, oracle if modes else 0.0, 0.1]))     # room for the legend above
    ax_hit.legend(fontsize=8, loc="upper left")
    ax_hit.tick_params(axis="x", labelrotation=20, labelsize=8)

    width = 0.27
    for j, q in enumerate(("p50", "p90", "p99")):
        ax_ttft.bar([i + (j - 1) * width for i in range(len(modes))],
                    [out["modes"][m][f"ttft_{q}_ms"] for m in modes], width, label=q)
    ax_ttft.set_xticks(range(len(modes)), modes, rotation=20, fontsize=8)
    ax_ttft.set_ylabel("TTFT (ms)")
    ax_ttft.set_title("Time to first token")
    ax_ttft.legend(fontsize=8)

    if curves:
        ax_x = axes[2]
        for name, color in zip(curves, ("tab:green", "tab:red", "tab:purple")):
            pts = curves[name]["points"]
            xs = [p["tokens"] for p in pts]
            ax_x.plot(xs, [p["computed_ms"] for p in pts], "o-", color=color, label=f"{name}: computed")
            ax_x.plot(xs, [p["loaded_ms"] for p in pts], "s--", color=color, label=f"{name}: loaded from tier")
        ax_x.set_xscale("log", base=2)
        ax_x.set_yscale("log")
        ax_x.set_xlabel("prefix length L (tokens)")
        ax_x.set_ylabel("TTFT (ms)")
        ax_x.set_title("Crossover: compute vs load")
        ax_x.legend(fontsize=7)
    fig.suptitle("kvelastic bench tier" + (" (quick)" if out.get("quick") else "") + _workload(out), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _workload(out: dict[str, Any]) -> str:
    """The workload's order and engine lives, as the title says them."""
    w = out.get("workload", {})
    k, life = w.get("interleave", 0), w.get("visits_per_life")
    if life is None:
        return ""
    turns = f"turns interleaved (K = {k})" if k else "turns back to back"
    lives = "long-lived engines" if life == 0 else f"an engine per {life} visit(s)"
    return f": {turns}, {lives}"


if __name__ == "__main__":
    import json
    import sys

    plot(sys.argv[2], json.loads(pathlib.Path(sys.argv[1]).read_text().strip().splitlines()[-1]), {})
