"""``kvelastic bench elastic``: its parts, without starting vLLM servers (the
bench itself takes minutes): the seeded workload, the figures computed from
the daemon's status and metrics, the token comparison, the plot, and the
handoff measurement against a real daemon with two real engine processes."""

import math

import pytest

from kvelastic_tools.vllm_bench import elastic
from kvelastic_tools.vllm_bench import elastic_load as load

MiB = 1 << 20


def test_workload_is_seeded_skewed_and_rotates():
    a, b = load.make_workload(3, load.QUICK, seed=0), load.make_workload(3, load.QUICK, seed=0)
    assert [(r.engine, r.at, r.prompt) for r in a.requests] == [(r.engine, r.at, r.prompt) for r in b.requests]
    assert [p.hot for p in a.phases] == [0, 1, 2]
    shape = load.QUICK
    for k, phase in enumerate(a.phases):
        reqs = [r for r in a.requests if r.phase == k]
        hot = [r for r in reqs if r.engine == phase.hot]
        assert all(r.hot for r in hot) and len(hot) == shape.bursts * shape.burst_size
        assert 0.8 <= len(hot) / len(reqs) <= 0.9
        if k:   # an idle gap before every phase but the first
            assert phase.start - a.phases[k - 1].end == pytest.approx(shape.gap)
    lo, hi = load.VOCAB
    for r in a.requests:
        assert len(r.prompt) == shape.system_len + shape.suffix_len and lo <= min(r.prompt) and max(r.prompt) < hi
    # shared prefixes: a few system prompts per engine
    systems = {(r.engine, tuple(r.prompt[:shape.system_len])) for r in a.requests}
    assert len(systems) <= 3 * shape.system_prompts
    assert load.make_workload(3, load.QUICK, seed=1).requests[0].prompt != a.requests[0].prompt


def _engine(eid, slabs, live, cached, min_bytes=0):
    return {"engine_id": eid, "slabs": slabs, "slab_bytes": 4 * MiB, "held_bytes": slabs * 4 * MiB,
            "live_blocks": live, "cached_blocks": cached, "cached_bytes": cached * 32 * 1024,
            "min_bytes": min_bytes, "idle": True}


def test_footprint_against_packed_and_strict_floors():
    status = {"engines": [_engine("a", 3, 1, 200), _engine("b", 1, 1, 0), _engine("c", 2, 0, 0, min_bytes=4 * MiB)]}
    out = elastic.footprint(status, 128)
    assert out["idle_footprint_bytes"] == 6 * 4 * MiB
    # a: ceil(201/128) = 2 slabs; b: 1; c: nothing held but its minimum
    assert out["packed_floor_bytes"] == (2 + 1 + 1) * 4 * MiB
    assert out["strict_floor_bytes"] == (1 + 1 + 1) * 4 * MiB
    assert out["idle_footprint_over_packed_floor"] == 1.5
    assert out["engines_2s_after"]["a"]["blocks_per_slab"] == 128


def test_histogram_quantile_and_percentile():
    text = "\n".join([
        'kvelastic_demand_wait_seconds_bucket{device="0",le="0.005"} 50.0',
        'kvelastic_demand_wait_seconds_bucket{device="0",le="0.01"} 98.0',
        'kvelastic_demand_wait_seconds_bucket{device="0",le="0.1"} 100.0',
        'kvelastic_demand_wait_seconds_bucket{device="0",le="+Inf"} 100.0'])
    assert elastic._histogram_quantile(text, "kvelastic_demand_wait_seconds", 0.5) == (0.005, 100)
    assert elastic._histogram_quantile(text, "kvelastic_demand_wait_seconds", 0.99) == (0.1, 100)
    assert elastic._histogram_quantile("", "kvelastic_demand_wait_seconds", 0.5) == (None, 0)
    values = list(range(1, 101))
    assert elastic._pct(values, 0.5) == 50 and elastic._pct(values, 0.99) == 99 and elastic._pct([], 0.5) is None


def _result(idx, tokens, ttft=0.1, hot=True, engine=0, error=""):
    return load.Result(idx, engine, hot, 0.0, ttft=ttft, e2e=ttft + 0.5, tokens=tokens, text=str(tokens), error=error)


def test_token_comparison_counts_mismatches_among_requests_both_finished():
    static = [_result(0, [5, 6]), _result(1, [7, 8]), _result(2, [9, 9])]
    mine = [_result(0, [5, 6]), _result(1, [7, 9]), _result(2, [], error="HTTP 500")]
    out = elastic.compare_tokens(static, mine)
    assert out["token_compared_requests"] == 2 and out["token_mismatches"] == 1
    assert out["token_mismatch_requests"] == [1] and out["distinct_completions"] == 2


def test_summary_and_plot(tmp_path):
    workload = load.make_workload(3, load.QUICK, seed=0)
    modes = {}
    for name, ttft in (("static", 2.0), ("elastic", 0.5)):
        results = [_result(r.idx, [1] * r.max_tokens, ttft=ttft * (1 + r.idx % 3), hot=r.hot, engine=r.engine)
                   for r in workload.requests]
        names = ("num_preemptions_total", "prefix_cache_hits_total", "prefix_cache_queries_total")
        counters = [dict(zip(names, (2.0, 40.0, 100.0))), dict.fromkeys(names, math.nan),
                    dict(zip(names, (0.0, 10.0, 100.0)))]
        modes[name] = {"results": results, "t_end": 30.0, "counters": counters, "server_start_seconds": 1.0,
                       "servers_died": [], "bench_process_worst_stall": {"ms": 1.0, "at_s": 0.0, "over_1s": 0},
                       "load_start_wall": 0.0}
    modes["elastic"]["status_samples"] = [(t / 2, {"e0": (8 + t) * MiB, "e1": 4 * MiB, "e2": 4 * MiB})
                                          for t in range(40)]
    out = elastic.summarize(modes["static"], workload)
    assert out["finished"] == len(workload.requests) and out["ttft_p99_ms"] == 6000.0
    assert out["ttft_p50_ms"] <= out["ttft_p90_ms"] <= out["ttft_p99_ms"]
    ratios = elastic.ttft_ratios(out, elastic.summarize(modes["elastic"], workload))
    assert ratios == {"p50": 0.25, "p90": 0.25, "p99": 0.25}          # every elastic TTFT a quarter of static's
    assert elastic.ttft_ratios(out, {"ttft_p50_ms": None}) == dict.fromkeys(elastic.QUANTILES)
    assert out["preemptions"] == 2 and out["preemptions_per_engine"] == [2, None, 0]
    assert out["prefix_cache_hit_rate"] == 0.25 and len(out["ttft_p99_ms_by_phase"]) == 3
    png = tmp_path / "elastic.png"
    elastic_plot = pytest.importorskip("kvelastic_tools.vllm_bench.elastic_plot")
    elastic_plot.plot(str(png), workload, modes, 16 * MiB)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_handoff_from_an_idle_engine_to_a_busy_one(tmp_path):
    out = elastic.handoff(tmp_path, quick=True)
    # 8 cycles of 15 one-slab handoffs from the idle engine to the busy one
    assert out["handoff_samples"] == 120 and out["handoff_refused"] == 0
    assert out["handoff_slab_moves"] == 120 and out["handoff_thrash"] == 0
    assert 0 < out["handoff_p50_ms"] <= out["handoff_p99_ms"] < 1000
