"""``kvelastic bench elastic``: its parts (the seeded workloads, the
calibration's sizing, the figures of a run, their spread, the ratios and
verdicts, the plot), then ``--quick`` itself on real servers (forked, as the
other vLLM tests start them): its structure and what cannot depend on the
machine's speed (every request of every mode and repetition finished, the
same tokens in every mode, the idle footprint, no thrash, the hand-off
measured), never a speed target."""

from __future__ import annotations

import math

import pytest

from kvelastic_tools.vllm_bench import elastic
from kvelastic_tools.vllm_bench import elastic_calibrate as calibration
from kvelastic_tools.vllm_bench import elastic_load as load
from kvelastic_tools.vllm_bench import elastic_report as report

MiB = 1 << 20
SCEN = load.Scenario(name="contended", phases=3, hot_rate=4.0, phase_seconds=3.0, gap=2.5)


def test_workload_is_seeded_skewed_rotates_and_follows_its_scenario():
    shape = load.QUICK_SHAPE
    a, b = load.make_workload(3, shape, SCEN, seed=0), load.make_workload(3, shape, SCEN, seed=0)
    assert [(r.engine, r.at, r.prompt) for r in a.requests] == [(r.engine, r.at, r.prompt) for r in b.requests]
    assert [p.hot for p in a.phases] == [0, 1, 2]
    for k, phase in enumerate(a.phases):
        reqs = [r for r in a.requests if r.phase == k]
        hot = sorted((r for r in reqs if r.engine == phase.hot), key=lambda r: r.at)
        assert all(r.hot for r in hot) and len(hot) == SCEN.hot_rate * SCEN.phase_seconds
        assert 0.8 <= len(hot) / len(reqs) <= 0.9
        # evenly spaced at the scenario's rate, within half an interval of jitter
        every = SCEN.phase_seconds / len(hot)
        assert all(abs(r.at - phase.start - i * every) <= 0.5 * every + 1e-3 for i, r in enumerate(hot))
        assert phase.end - phase.start <= SCEN.phase_seconds + 1e-3
        if k:   # an idle gap before every phase but the first
            assert phase.start - a.phases[k - 1].end == pytest.approx(SCEN.gap)
    lo, hi = load.VOCAB
    for r in a.requests:
        assert len(r.prompt) == shape.system_len + shape.suffix_len and lo <= min(r.prompt) and max(r.prompt) < hi
    # shared prefixes: a few system prompts per engine; another seed, other prompts (nothing carries over)
    systems = {(r.engine, tuple(r.prompt[:shape.system_len])) for r in a.requests}
    assert len(systems) <= 3 * shape.system_prompts
    other = load.make_workload(3, shape, SCEN, seed=1)
    assert not {tuple(r.prompt[:shape.system_len]) for r in other.requests} & {s for _, s in systems}


def test_scenarios_are_sized_by_memory_and_the_calibrated_rate():
    shape = load.FULL_SHAPE
    share = elastic.SHARE // elastic.BLOCK_BYTES
    assert shape.request_blocks == 16 + 6 and shape.system_blocks == 16
    assert shape.running_for(shape.blocks_for(7)) == pytest.approx(7)
    running = calibration.running_targets(shape, share, 2.0)
    # the contended hot phase needs about two shares, the uncontended one half a share
    assert shape.blocks_for(running["contended"]) == pytest.approx(2 * share, rel=0.1)
    assert shape.blocks_for(running["uncontended"]) <= share
    level = {"throughput_req_s": 2.5, "request_seconds": 4.0}
    scen = calibration.scenario("contended", level, phases=3, phase_lengths=3.0, idle_grace=1.0)
    assert scen.hot_rate == 2.5 and scen.phase_seconds == 12.0 and scen.gap == 6.0 and scen.phases == 3
    assert elastic.need_over_share(3) == 2.0 and elastic.need_over_share(2) == 1.5


def test_plan_interleaves_and_rotates_modes_and_seeds():
    steps = elastic.plan(5)
    assert len(steps) == 10 and [s[0] for s in steps] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    assert [s[1] for s in steps[:4]] == ["contended", "uncontended", "uncontended", "contended"]
    firsts = [s[2][0] for s in steps[::2]]
    assert firsts == ["static", "elastic", "limit", "static", "elastic"]
    assert all(sorted(s[2]) == sorted(elastic.MODES) for s in steps)
    seeds = {elastic.seed_of(rep, scen) for rep, scen, _ in steps}
    assert len(seeds) == len(steps)      # a fresh workload per repetition and scenario


def _engine(eid, slabs, live, cached, min_bytes=0):
    return {"engine_id": eid, "slabs": slabs, "slab_bytes": 4 * MiB, "held_bytes": slabs * 4 * MiB,
            "live_blocks": live, "cached_blocks": cached, "cached_bytes": cached * 32 * 1024,
            "min_bytes": min_bytes, "idle": True}


def test_footprint_against_packed_and_strict_floors():
    status = {"engines": [_engine("a", 3, 1, 200), _engine("b", 1, 1, 0), _engine("c", 2, 0, 0, min_bytes=4 * MiB)]}
    out = report.footprint(status, 128)
    assert out["idle_footprint_bytes"] == 6 * 4 * MiB
    # a: ceil(201/128) = 2 slabs; b: 1; c: nothing held but its minimum
    assert out["packed_floor_bytes"] == (2 + 1 + 1) * 4 * MiB
    assert out["strict_floor_bytes"] == (1 + 1 + 1) * 4 * MiB
    assert out["idle_footprint_over_packed_floor"] == 1.5
    assert out["engines_2s_after"]["a"]["blocks_per_slab"] == 128


def test_histogram_quantile_of_what_a_run_added():
    def text(counts):
        return "\n".join(f'kvelastic_demand_wait_seconds_bucket{{device="0",le="{le}"}} {c}'
                         for le, c in zip(("0.005", "0.01", "0.1", "+Inf"), counts))
    after = text((50.0, 98.0, 100.0, 100.0))
    assert elastic._histogram_quantile(after, "kvelastic_demand_wait_seconds", 0.5) == (0.005, 100)
    assert elastic._histogram_quantile(after, "kvelastic_demand_wait_seconds", 0.99) == (0.1, 100)
    # 50 fast ones before the run: the run's 50 took 5 to 10 ms, but 2 slower
    before = text((50.0, 50.0, 50.0, 50.0))
    assert elastic._histogram_quantile(after, "kvelastic_demand_wait_seconds", 0.9, before) == (0.01, 50)
    assert elastic._histogram_quantile(after, "kvelastic_demand_wait_seconds", 0.99, before) == (0.1, 50)
    assert elastic._histogram_quantile("", "kvelastic_demand_wait_seconds", 0.5) == (None, 0)


def _result(idx, tokens, ttft=0.1, hot=True, engine=0, error="", sent=0.0):
    return load.Result(idx, engine, hot, sent, ttft=ttft, e2e=ttft + 0.5, tokens=tokens, text=str(tokens), error=error)


def test_token_comparison_counts_mismatches_among_requests_both_finished():
    static = [_result(0, [5, 6]), _result(1, [7, 8]), _result(2, [9, 9])]
    mine = [_result(0, [5, 6]), _result(1, [7, 9]), _result(2, [], error="HTTP 500")]
    out = report.compare_tokens(static, mine)
    assert out["token_compared_requests"] == 2 and out["token_mismatches"] == 1
    assert out["token_mismatch_requests"] == [1] and out["distinct_completions"] == 2


NAMES = ("num_preemptions_total", "prefix_cache_hits_total", "prefix_cache_queries_total")


def _runs(workload, scale):
    results = [_result(r.idx, [1] * r.max_tokens, ttft=scale * (1 + r.idx % 3), hot=r.hot, engine=r.engine,
                       sent=r.at) for r in workload.requests]
    counters = [dict(zip(NAMES, (2.0, 40.0, 100.0))), dict.fromkeys(NAMES, math.nan),
                dict(zip(NAMES, (0.0, 10.0, 100.0)))]
    gauges = [(t / 4, [(3, 1), (1, 0), None]) for t in range(40)]
    return results, counters, gauges


def test_run_figures_spread_ratios_and_verdicts():
    workload = load.make_workload(3, load.QUICK_SHAPE, SCEN, seed=0)
    figs = {}
    for name, scale in (("static", 2.0), ("elastic", 0.5), ("limit", 0.5)):
        results, counters, gauges = _runs(workload, scale)
        figs[name] = report.summarize(results, workload, 30.0, counters, gauges)
    out = figs["static"]
    assert out["finished"] == len(workload.requests) and out["ttft_p99_ms"] == 6000.0
    assert out["ttft_p50_ms"] <= out["ttft_p90_ms"] <= out["ttft_p99_ms"]
    assert out["preemptions"] == 2 and out["prefix_cache_hit_rate"] == 0.25
    assert out["hot_running_max"] == 3 and out["tpot_mean_ms"] == pytest.approx(500 / 47, abs=0.01)
    reps = {m: [figs[m], figs[m]] for m in figs}
    r = {"vs_limit": report.ratios(reps["elastic"], reps["limit"]),
         "vs_static": report.ratios(reps["elastic"], reps["static"])}
    assert {q: r["vs_static"][q]["median"] for q in (*report.QUANTILES, "mean")} == dict.fromkeys(
        (*report.QUANTILES, "mean"), 0.25)                           # every elastic TTFT a quarter of static's
    assert r["vs_limit"]["p99"] == {"median": 1.0, "min": 1.0, "max": 1.0, "reps": [1.0, 1.0]}
    assert report.spread([3.0, None, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0,
                                                    "reps": [3.0, None, 1.0, 2.0]}
    met = report.targets("contended", r, True, True, 1.0, 0)
    assert set(met) >= {"p50_vs_limit_median_le_1.05", "p99_vs_limit_worst_le_1.2",
                        "throughput_vs_limit_median_le_1.05", "ttft_mean_below_static_every_rep",
                        "ttft_p99_vs_static_median_le_0.25",
                        "tokens_identical_across_modes", "no_thrash", "idle_footprint_le_1.1x_packed_floor"}
    assert all(t["met"] for t in met.values()) and all({"value", "bound", "met"} <= set(t) for t in met.values())
    # not comparable (a request unfinished somewhere): no speed verdict is met
    assert not report.targets("contended", r, False, True, 1.0, 0)["p50_vs_limit_median_le_1.05"]["met"]
    un = report.targets("uncontended", r, True, True, 1.0, 0)
    assert un["p50_vs_stock_median_le_1.05"]["met"] and "p50_vs_limit_median_le_1.05" not in un


def test_held_under_load_finds_memory_unheld_while_an_engine_waits():
    slab = elastic.SLAB_BYTES
    total = 16 * slab
    results = [_result(0, [1], ttft=0.5, sent=0.0)]
    results[0].e2e = 10.0
    status = [(t * 0.5, {"engines": {"e0": {"held": (16 if t < 4 or t > 8 else 12) * slab, "live": 1, "cached": 0,
                                            "idle": False, "starved_s": 0.0, "grants": 1, "returns": 0,
                                            "reclaims": 0}}, "free": 0, "unallocated": 0})
              for t in range(20)]
    gauges = [(t * 0.25, [(4, 2 if 2.0 <= t * 0.25 <= 4.0 else 0)]) for t in range(40)]
    out = report.held_under_load(status, gauges, results, total, slab)
    assert out["unheld_while_waiting_episodes"] == 1
    ep = out["longest_unheld_while_waiting"][0]
    assert ep["start_s"] == 2.0 and ep["end_s"] == 4.0 and ep["max_unheld_mib"] == 4 * slab / MiB
    assert ep["waiting_engines"] == ["e0"] and ep["first"]["waiting"] == {"e0": 2}
    assert out["held_share_min"] == 0.75 and 0.75 < out["held_share_mean"] < 1


def test_plot_per_scenario(tmp_path):
    pytest.importorskip("matplotlib")
    from kvelastic_tools.vllm_bench import elastic_plot

    workload = load.make_workload(3, load.QUICK_SHAPE, SCEN, seed=0)
    raw, figs = {}, {}
    for name, scale in (("static", 2.0), ("elastic", 0.5), ("limit", 0.45)):
        results, counters, gauges = _runs(workload, scale)
        raw[name] = [{"results": results, "t_end": 30.0, "gauges": gauges}]
        figs[name] = [report.summarize(results, workload, 30.0, counters, gauges)]
    raw["elastic"][0]["status_samples"] = [(t / 2, {"engines": {e: {"held": (8 + t % 4) * MiB, "live": 10}
                                                                for e in ("e0", "e1", "e2")}}) for t in range(40)]
    scen_report = {"ratios": {"vs_limit": report.ratios(figs["elastic"], figs["limit"]),
                              "vs_static": report.ratios(figs["elastic"], figs["static"])}}
    png = tmp_path / "elastic-contended.png"
    elastic_plot.plot_scenario(str(png), "contended", [workload], raw, scen_report, 48 * MiB, 16 * MiB)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.vllm
@pytest.mark.slow
def test_quick_bench_serves_every_request_the_same_in_every_mode(tmp_path):
    pytest.importorskip("vllm")
    from tests.vllm.forked import VLLM_FORKED
    from tests.vllm.zygote import launch

    out = elastic.run(quick=True, png=str(tmp_path / "elastic.png"), command=VLLM_FORKED, popen=launch)
    assert out["benchmark"] == "elastic" and out["quick"] and out["repetitions"] == elastic.QUICK_REPS
    assert out["engines"] == 2 and out["total_kv_bytes"] == 2 * elastic.SHARE
    cal = out["calibration"]
    assert cal["alone"]["e2e_s"] > 0 and set(cal["levels"]) == set(elastic.SCENARIOS)
    assert cal["levels"]["contended"]["concurrency"] > cal["levels"]["uncontended"]["concurrency"]
    # sized again before each repetition, from what one engine serves then
    assert all(len(out["scenarios"][s]["calibrated_per_rep"]) == elastic.QUICK_REPS for s in elastic.SCENARIOS)
    # every mode of every repetition ran, in plan()'s order
    assert out["order"] == [[rep, s, m] for rep, s, modes in elastic.plan(elastic.QUICK_REPS) for m in modes]
    for name in elastic.SCENARIOS:
        scen = out["scenarios"][name]
        assert scen["comparable"], {m: [r["errors"] for r in scen["per_rep"][m]] for m in elastic.MODES}
        for m in elastic.MODES:
            assert len(scen["per_rep"][m]) == elastic.QUICK_REPS
            assert [r["finished"] for r in scen["per_rep"][m]] == scen["scenario"]["requests"]
            assert [r["requests"] for r in scen["per_rep"][m]] == scen["scenario"]["requests"]
            for key in ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "ttft_mean_ms", "throughput_req_s"):
                assert set(scen["modes"][m][key]) == {"median", "min", "max", "reps"}
        # greedy tokens: elastic and limit against the static split, every request of every repetition
        assert scen["tokens"]["mismatches"] == 0
        assert scen["tokens"]["compared_requests"] == 2 * scen["scenario"]["requests_total"]
        targets = scen["targets"]
        assert targets["every_request_finished"]["met"] and targets["tokens_identical_across_modes"]["met"]
        assert targets["no_thrash"]["met"], scen["elastic"]
        assert targets["idle_footprint_le_1.1x_packed_floor"]["met"], scen["per_rep"]["elastic"]
        assert all({"value", "bound", "met"} <= set(t) for t in targets.values())
        for q in ("p50", "p90", "p99", "throughput"):
            assert set(scen["ratios"]["vs_limit"][q]) == {"median", "min", "max", "reps"}
        held = scen["elastic"]["held_share_under_load"]
        assert 0 < held["median"] <= 1
        # the CPU profile: every mode's servers measured, and kvelastic's part
        # (the daemon and the client's named I/O threads) only where it runs
        cpu = scen["cpu_ms_per_request_by_part"]
        assert all(r["cpu_s"]["total"] > 0 for m in elastic.MODES for r in scen["per_rep"][m])
        assert cpu["elastic"].get("daemon", 0) > 0 and any("/kv-engine-io" in k for k in cpu["elastic"])
        assert not any(k.startswith("daemon") or "/kv-" in k for m in ("static", "limit") for k in cpu[m])
        assert (tmp_path / f"elastic-{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "p50_vs_static" in out["scenarios"]["contended"]
    # the one-slab hand-off: 8 cycles of 15 handoffs from an idle engine to a busy one
    assert out["handoff_samples"] == 120 and out["handoff_refused"] == 0
    assert out["handoff_slab_moves"] == 120 and out["handoff_thrash"] == 0
    assert 0 < out["handoff_p50_ms"] <= out["handoff_p99_ms"]
    assert set(out["targets"]) == {"contended", "uncontended", "handoff"}
