"""``kvelastic bench route --quick`` against real engines (one per node here, two nodes).

What must hold whatever the machine's speed: every request served; vLLM's
cached tokens per request (``usage.prompt_tokens_details``) add up to its
own counters; no request was served more than the oracle's bound, so the
router's hit rate over the oracle's is at most 1; the report carries the
warm-up apart, the ratios per seed with their spread and the targets. No
timing is asserted (the TTFT ratios are figures, not conditions).
"""

from __future__ import annotations

import pytest

from kvelastic_tools.vllm_bench.dynamo_indexer import available

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_quick_route_bench_stays_under_its_oracle(tmp_path):
    why = available()
    if why:
        pytest.skip(f"Dynamo's indexer cannot run here: {why}")
    from kvelastic_tools.vllm_bench import route
    from kvelastic_tools.vllm_bench import route_load as load
    from tests.vllm.forked import VLLM_FORKED
    from tests.vllm.zygote import launch

    out = route.run(quick=True, per_node=1, command=VLLM_FORKED, popen=launch)
    assert out["engines"] == 2 and out["seeds"] == list(route.QUICK_SEEDS)
    assert out["comparable"], out["runs"]
    for run in out["runs"]:
        for mode in ("round_robin", "kv"):
            fig = run[mode]
            warm, measured = fig["warmup"], fig["measured"]
            assert warm["requests"] == load.QUICK.warmup
            assert measured["requests"] == load.QUICK.requests - load.QUICK.warmup
            assert warm["errors"] == measured["errors"] == 0 and fig["errors"] == []
            assert warm["requests_over_oracle"] == measured["requests_over_oracle"] == 0
            # The per-request figures are vLLM's: they add up to its counters.
            assert fig["engine_counters"] == {"prompt_tokens": warm["prompt_tokens"] + measured["prompt_tokens"],
                                              "hit_tokens": warm["hit_tokens"] + measured["hit_tokens"]}
            assert 0 <= measured["hit_tokens"] <= measured["oracle_hit_tokens"]
            assert measured["short_of_oracle_tokens"] == measured["oracle_hit_tokens"] - measured["hit_tokens"]
        assert run["kv"]["measured"]["hit_tokens"] > 0     # the conversations came back to their engine
        assert 0 < run["hit_rate_vs_oracle"] <= 1
        assert set(run["ttft_ratios"]) == {"p50", "p90", "p99"}
    assert out["hit_rate_vs_oracle"]["max"] <= 1
    assert set(out["targets"]) == {"hit_rate_ge_0.9x_oracle", "ttft_p90_le_0.6x_round_robin"}
    assert out["indexer_exact"]["exact"], out["indexer_exact"]
