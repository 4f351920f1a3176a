"""``kvelastic bench tier --quick --json``: stock vLLM against kvelastic with
the node tier (docs/tier.md) on disk and in host memory, on the tiny model, through the CLI as a user
runs it: two engine slots, every visit on a new engine, so the second pass
over the system prompts finds them in the tier (demoted from the departed
engines' kept cache) and loads them through ``KvelasticTierConnector``.
The figures must say what the bench claims: the same greedy tokens in both
modes, tier hits (vLLM's external hits, the daemon's promotions), a hit
rate above stock's and within the oracle's, and consistent arithmetic; and
the restart rounds (a ``kill -9`` of the daemon or of an engine halfway
through) keep the tier's hit rate and stock's tokens."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_bench_tier_quick_loads_demoted_blocks_with_the_same_tokens(tmp_path):
    png = tmp_path / "tier.png"
    result = subprocess.run([sys.executable, "-m", "kvelastic", "bench", "tier", "--quick", "--json"],
                            capture_output=True, text=True, timeout=600,
                            env={**os.environ, "KVELASTIC_BENCH_TIER_PNG": str(png)})
    assert result.returncode == 0, result.stderr[-4000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["benchmark"] == "tier" and out["quick"]
    stock, tier = out["modes"]["stock"], out["modes"]["tier"]
    assert "error" not in stock and "error" not in tier
    assert stock["requests"] == tier["requests"] == 8
    assert stock["same_tokens_as_stock"] and tier["same_tokens_as_stock"]
    assert out["tier_vs_kvelastic"]["met"]["same_tokens"]
    # Blocks reached the tier (demoted when the departed engines' kept cache expired) and came back.
    assert tier["tier"]["demotions"] > 0 and tier["tier"]["promotions"] > 0
    assert tier["external_hit_tokens"] > 0 and stock["external_hit_tokens"] == 0
    assert tier["external_hit_tokens"] == 32 * tier["tier"]["promotions"]   # whole 32-token blocks
    # The tier hits what stock recomputes, and never more than the oracle.
    assert stock["oracle_hit_rate"] == tier["oracle_hit_rate"] > 0
    assert stock["hit_rate"] < tier["hit_rate"] <= tier["oracle_hit_rate"]
    assert tier["hit_rate_over_oracle"] == pytest.approx(tier["hit_rate"] / tier["oracle_hit_rate"], abs=2e-3)
    for mode in (stock, tier):
        assert 0 < mode["ttft_p50_ms"] <= mode["ttft_p90_ms"] <= mode["ttft_p99_ms"]
        assert mode["throughput_tok_s"] > 0
    # The tier in the daemon's host memory: the same loads from another medium, the same tokens.
    host = out["modes"]["tier_host"]
    assert "error" not in host and host["requests"] == 8 and host["same_tokens_as_stock"]
    assert host["tier"]["medium"] == "host" and tier["tier"]["medium"] == "disk"
    assert host["tier"]["promotions"] > 0 and host["external_hit_tokens"] == 32 * host["tier"]["promotions"]
    assert stock["hit_rate"] < host["hit_rate"] <= host["oracle_hit_rate"] == tier["oracle_hit_rate"]
    assert out["tier_host_vs_tier"]["hit_rate"] == [host["hit_rate"], tier["hit_rate"]]
    # The restart rounds: halfway, a kill -9 of the daemon (started again with the keeper the first one
    # started) or of an engine; every request gives stock's tokens, and the hits after the restart are
    # measured against tier's run without one. (How many are kept is the full bench's figure: on this
    # trace each visit's engine is new and its hits race the 200 ms kept-cache expiry, so on a loaded
    # machine the quick trace's share moves from run to run: 0.77-1.0 seen.)
    rounds = out["restart_rounds"]
    assert set(rounds) == {"tier_restart_daemon", "tier_restart_engine"}
    for name, r in rounds.items():
        mode = out["modes"][name]
        assert "error" not in mode and mode["requests"] == 8 and mode["same_tokens_as_stock"], name
        assert mode["restart"]["at_request"] == 4 and r["kind"] == name.rsplit("_", 1)[1]
        assert r["after"]["requests"] == r["without_restart"]["requests"] == 4
        assert 0 < r["hit_rate_kept"] <= 1.5 and r["without_restart"]["hit_rate"] > 0, r
    assert out["modes"]["tier_restart_daemon"]["restart"]["daemon_start_s"] > 0
    assert out["modes"]["tier_restart_engine"]["restart"]["slot"] is not None
    assert png.stat().st_size > 0


def test_full_workload_interleaves_turns_on_long_lived_engines():
    """The full workload's order (no engine run): engines never replaced, a
    conversation's next turn after the first turns of the next K visits, on
    its visit's slot, a prompt's second visit on another slot than its first;
    ``INTERLEAVE=0`` is the old back-to-back order, and the oracle follows the
    order sent (a turn's prefix hits only once its earlier turn was sent)."""
    from kvelastic_tools.vllm_bench import tier_model as m

    w = m.FULL
    assert w.visits_per_life == 0 and w.interleave == m.INTERLEAVE > 0
    order = w.requests()
    visits = w.visits()
    assert sorted(order) == [(v, t) for v in range(len(visits)) for t in range(w.turns)]
    at = {vt: i for i, vt in enumerate(order)}
    for v in range(len(visits)):
        firsts = [u for u in range(v + 1, len(visits)) if at[(u, 0)] < at[(v, 1)]]
        assert firsts == list(range(v + 1, min(v + 1 + w.interleave, len(visits))))
    for i in range(w.prompts):
        assert visits[i][0] != visits[w.prompts + i][0] and visits[i][2] == visits[w.prompts + i][2]
    assert m.BACK_TO_BACK.requests() == [(v, t) for v in range(len(visits)) for t in range(w.turns)]
    # The oracle over the prompts in the order sent: turn 1 of visit 0 sent after turn 0 hits its prefix.
    first = w.system_prompt(0) + w.user_turn(0, 0, 0)
    answer = [5] * w.answer_tokens
    second = first + answer + w.user_turn(0, 0, 1)
    assert m.oracle_hits([(second, answer), (first, answer)])[0] == 0
    cached = (len(first) + w.answer_tokens - 1) // m.BLOCK * m.BLOCK    # the last answer token's KV is never computed
    assert m.oracle_hits([(first, answer), (second, answer)])[1] == cached


def test_multi_round_qa_shares_one_system_prompt_and_serves_its_users_round_robin():
    """LMCache's benchmark shape (no engine run): every user opens with the
    same system prompt and a context of its own, asks its rounds with every
    other user's round in between, on one slot, and the prefix working set
    is well above the budget."""
    from kvelastic_tools.vllm_bench import tier_model as m

    w = m.MULTI_ROUND_QA
    users, rounds = w.prompts, w.turns
    order = w.requests()
    assert order == [(u, r) for r in range(rounds) for u in range(users)]          # round robin
    assert len({tuple(w.system_prompt(u)) for u in range(users)}) == 1             # one shared prompt
    firsts = [w.user_turn(u, 0, 0) for u in range(users)]
    assert all(len(f) == w.context_tokens + w.user_tokens for f in firsts)
    assert len({tuple(f) for f in firsts}) == users                                # contexts of their own
    assert all(len(w.user_turn(0, 0, r)) == w.user_tokens for r in range(1, rounds))
    slots = w.visits()
    assert len({slots[u][0] for u in range(users)}) == w.engines                   # every slot serves users
    assert w.working_set_tokens() == w.system_tokens + users * (
        w.context_tokens + rounds * (w.user_tokens + w.answer_tokens))
    per_token = m.kv_bytes_per_token(m.BENCH)
    assert w.working_set_tokens() * per_token > 2 * w.memory
    # The interleaved workload's working set is as the bench always reported it.
    f = m.FULL
    assert f.working_set_tokens() == f.prompts * (f.system_tokens + f.turns * (f.user_tokens + f.answer_tokens))


def test_lmcache_multi_process_server_serves_the_same_trace(tmp_path):
    """LMCache's node-shared server (``make lmcache``), on the quick trace: its
    engines load what other engines stored there (external hits), and give
    stock's tokens; its figures sit beside the tier's in one run, and so do
    its restart rounds (the server or an engine killed halfway)."""
    from kvelastic_tools.vllm_bench import tier_lmcache

    missing = tier_lmcache.installed()
    if missing:
        pytest.skip(missing)
    result = subprocess.run([sys.executable, "-m", "kvelastic", "bench", "tier", "--quick", "--json"],
                            capture_output=True, text=True, timeout=900,
                            env={**os.environ, "KVELASTIC_BENCH_TIER_MODES": "stock,tier,lmcache_mp,"
                                 "lmcache_mp_restart_server,lmcache_mp_restart_engine"})
    assert result.returncode == 0, result.stderr[-4000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    stock, tier, lmc = (out["modes"][m] for m in ("stock", "tier", "lmcache_mp"))
    assert "error" not in lmc, lmc
    assert lmc["requests"] == stock["requests"] == 8 and lmc["same_tokens_as_stock"]
    assert lmc["external_hit_tokens"] > 0 and lmc["hit_rate"] > stock["hit_rate"]
    assert lmc["hit_rate"] <= lmc["oracle_hit_rate"] == tier["oracle_hit_rate"]
    # Its restart rounds are measured, whatever they show (LMCache's own figures, not a target of ours).
    rounds = out["restart_rounds"]
    assert {k: r["kind"] for k, r in rounds.items()} == {"lmcache_mp_restart_server": "server",
                                                        "lmcache_mp_restart_engine": "engine"}
    for r in rounds.values():
        assert r["against"] == "lmcache_mp" and r["after"]["requests"] == r["without_restart"]["requests"] == 4
        assert r["same_tokens_as_stock"] in (True, False) and "hit_rate_kept" in r
