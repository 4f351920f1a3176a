"""Calibration of ``kvelastic bench elastic``: what one stock engine serves on
this machine, and the loads sized from it.

The bench's verdict must not follow the machine's speed. So before any load
it measures one stock ``vllm serve`` (the whole budget, nothing else loaded)
with the workload's request shape:

- alone: a request at a time (time to first token, end-to-end, decode rate);
- at a concurrency ``L`` (a closed loop of ``L`` clients, started staggered
  so they do not step in lockstep): throughput ``X(L)`` in requests a second
  and the time a request takes, ``D(L) = L / X(L)`` (Little's law);
- saturated (full run): ``X`` at the most requests the engine runs at once
  (its memory or ``--max-num-seqs``), the most one engine serves here.

The concurrency levels are measured with the scenario's cold trickle sent to
the limit mode's other engines meanwhile: on two cores their steps take CPU
from the hot engine, and a calibration without them offered a load 1.1 to
1.7 times what the hot engine then served (docs/benchmarks.md, 2026-12-02).

A load that arrives at ``X(L)`` keeps about ``L`` requests running at an
engine with memory enough (the limit mode), which need
``Shape.blocks_for(L)`` KV blocks: so a scenario is named by the memory its
hot phase needs, relative to a static share, whatever the machine's speed,
and its phases last a number of ``D(L)``. CONTENDED: the hot phase needs
``need_over_share`` (about 2) static shares; UNCONTENDED: half a share, which
every mode holds. Both offer ``LOAD_FRACTION`` (0.85) of ``X(L)``, below the
saturated throughput, so that the CPU keeps up and memory is what is
contended; the limit mode's drain (last request sent to last token, over
``D(L)``) says afterwards whether it did.
"""

from __future__ import annotations

import statistics
from typing import Any

from kvelastic_tools.vllm_bench import elastic_load as load


def alone(base: str, shape: load.Shape, n: int, seed: int) -> dict[str, Any]:
    """``n`` requests of ``shape``, one at a time (fresh prompts): medians."""
    got = load.run_closed(base, shape, 1, n, seed, 0.0)
    bad = [r.error for r in got if not r.ok]
    if bad:
        raise RuntimeError(f"calibration (alone) failed: {bad[:3]}")
    ttft = statistics.median(r.ttft for r in got if r.ttft is not None)
    e2e = statistics.median(r.e2e for r in got if r.e2e is not None)
    return {"requests": n, "ttft_ms": round(ttft * 1e3, 1), "e2e_s": round(e2e, 3),
            "decode_tok_s": round((shape.max_tokens - 1) / max(e2e - ttft, 1e-9), 1)}


def at_concurrency(base: str, shape: load.Shape, concurrency: int, rounds: int, seed: int,
                   stagger: float, trickle: list[str] | None = None, trickle_rate: float = 0.0) -> dict[str, Any]:
    """Throughput of a closed loop of ``concurrency`` clients, each sending
    ``rounds`` (>= 3) requests in turn: measured between the ``L``-th
    completion and the ``(rounds - 1) L``-th, while every client is in its
    loop (the first round ramps up, the last drains)."""
    if rounds < 3:
        raise ValueError("rounds must be at least 3")
    got = load.run_closed(base, shape, concurrency, rounds, seed, stagger, trickle=trickle, trickle_rate=trickle_rate)
    bad = [r.error for r in got if not r.ok]
    if bad:
        raise RuntimeError(f"calibration (concurrency {concurrency}) failed: {bad[:3]}")
    ends = sorted(r.sent + (r.e2e or 0.0) for r in got)
    lo, hi = ends[concurrency - 1], ends[(rounds - 1) * concurrency - 1]
    window = [r for r in got if lo < r.sent + (r.e2e or 0.0) <= hi]
    x = len(window) / max(hi - lo, 1e-9)
    ttft = sorted(r.ttft for r in window if r.ttft is not None)
    return {"concurrency": concurrency, "rounds": rounds, "requests_in_window": len(window),
            "trickle_req_s": round(trickle_rate * len(trickle or []), 3),
            "window_s": round(hi - lo, 2), "throughput_req_s": round(x, 3),
            "request_seconds": round(concurrency / x, 3),          # D(L), Little's law
            "e2e_mean_s": round(statistics.fmean(r.e2e for r in window if r.e2e is not None), 3) if window else None,
            "ttft_p50_ms": round(ttft[len(ttft) // 2] * 1e3, 1) if ttft else None}


def running_targets(shape: load.Shape, share_blocks: int, need_over_share: float) -> dict[str, int]:
    """Requests running at once at the hot engine that need ``need_over_share``
    static shares (contended) and half a share (uncontended)."""
    return {"contended": max(2, round(shape.running_for(need_over_share * share_blocks))),
            "uncontended": max(1, round(shape.running_for(0.5 * share_blocks)))}


def cold_rate(hot_rate: float, engines: int, hot_share: float = 0.85) -> float:
    """Requests a second each cold engine gets while the hot one gets ``hot_rate``."""
    return hot_rate * (1 - hot_share) / hot_share / max(1, engines - 1)


def scenario(name: str, level: dict[str, Any], phases: int, phase_lengths: float, idle_grace: float,
             hot_share: float = 0.85, fraction: float = 1.0) -> load.Scenario:
    """A scenario that offers ``fraction`` of ``X(L)`` to its hot engine for
    ``phase_lengths`` request times ``D(L)``, then a gap of ``D(L)`` and twice
    the idle grace (the limit mode drains, every engine goes idle)."""
    d = level["request_seconds"]
    return load.Scenario(name=name, phases=phases, hot_rate=round(fraction * level["throughput_req_s"], 3),
                         phase_seconds=round(phase_lengths * d, 2), gap=round(d + 2 * idle_grace, 2),
                         hot_share=hot_share)


def measure_levels(base: str, shape: load.Shape, share_blocks: int, need_over_share: float, e2e_alone: float,
                   rounds: int, seed: int, others: list[str], previous: dict[str, Any] | None = None
                   ) -> dict[str, dict[str, Any]]:
    """``X(L)`` and ``D(L)`` at each scenario's running target (``running_targets``)
    with the scenario's cold trickle on the ``others`` servers (their steps take
    the CPU from the hot engine, as in the load): at the rate that ``previous``
    levels give, or, with none, that a first measurement without it gives."""
    levels = {}
    for name, concurrency in running_targets(shape, share_blocks, need_over_share).items():
        stagger = e2e_alone / concurrency
        rate = 0.0 if not others else previous[name]["throughput_req_s"] if previous else at_concurrency(
            base, shape, concurrency, 3, seed + concurrency, stagger)["throughput_req_s"]
        trickle = cold_rate(rate, len(others) + 1)
        levels[name] = at_concurrency(base, shape, concurrency, rounds, seed + concurrency + 1, stagger,
                                      trickle=others, trickle_rate=trickle)
        levels[name]["need_blocks"] = round(shape.blocks_for(concurrency))
        levels[name]["need_over_share"] = round(shape.blocks_for(concurrency) / share_blocks, 3)
    return levels


def calibrate(base: str, shape: load.Shape, share_blocks: int, need_over_share: float, saturated_at: int,
              quick: bool, others: list[str], seed: int = 7) -> dict[str, Any]:
    """Every figure the scenarios are sized from (see the module's doc); the
    levels are measured again before each repetition (``measure_levels``).
    ``saturated_at``: the most requests the engine runs at once (memory or
    ``--max-num-seqs``)."""
    out: dict[str, Any] = {"alone": alone(base, shape, 2 if quick else 3, seed)}
    e2e = out["alone"]["e2e_s"]
    out["saturated"] = None if quick else at_concurrency(base, shape, saturated_at, 3, seed + 1, e2e / saturated_at)
    out["rounds"] = 3 if quick else 4
    out["levels"] = measure_levels(base, shape, share_blocks, need_over_share, e2e, out["rounds"], seed, others)
    return out
