"""``kvelastic bench warm --quick --json``: one round of stock vLLM restarted
cold against an engine restarted warm after ``kill -9``, through the CLI as a
user runs it. The figures must say what the bench claims: the same tokens,
the warm restart hitting (nearly) what the engine hit before it died, with
less prefill work than the cold one."""

import json
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_bench_warm_reports_a_warm_restart_against_a_cold_one():
    result = subprocess.run([sys.executable, "-m", "kvelastic", "bench", "warm", "--quick", "--json"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["benchmark"] == "warm" and out["rounds"] == 1
    assert out["same_tokens"]
    assert out["adopted_blocks"][0] > 0 and out["adopted_blocks"] == out["kept_blocks"]
    assert out["hit_rate_warm"] >= 0.9 * out["hit_rate_before_restart"] > 0
    assert out["prefill_tokens_warm"] < out["prefill_tokens_cold"]
    assert out["prefill_ratio"] == pytest.approx(out["prefill_tokens_warm"] / out["prefill_tokens_cold"], abs=1e-3)
    assert out["ttft_cold_ms"] > 0 and out["ttft_warm_ms"] > 0
    assert out["ttft_speedup"] == pytest.approx(out["ttft_cold_ms"] / out["ttft_warm_ms"], rel=0.02)
    # The daemon's kill -9 with a keeper: what it kept is adopted by the next daemon, and hits as before.
    restart = out["daemon_restart"]
    assert restart["rounds"] == 1 and restart["state_file"] == ["ok"]
    assert restart["kept_blocks_adopted"] == restart["kept_blocks_before"] and restart["kept_blocks_before"][0] > 0
    assert restart["same_tokens"] and restart["hit_rate_ratio"] >= 0.9
    assert restart["ttft_speedup"] == pytest.approx(restart["ttft_cold_ms"] / restart["ttft_ms"], rel=0.02)
