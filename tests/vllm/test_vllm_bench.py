"""``kvelastic bench vllm``: the scheduler-step figure (``bench/vllm_sched.py``)
in its quick mode: vLLM's Scheduler at a batch of 256, stock and with kvelastic
(a real daemon), the same schedule on both sides step after step."""

import pytest

pytest.importorskip("vllm")

from kvelastic_tools.vllm_bench import vllm_sched

pytestmark = pytest.mark.vllm


def test_scheduler_step_is_timed_on_the_same_schedule_at_a_batch_of_256(daemon_factory):
    # Under pressure (the engine may grow, the daemon has no memory left for
    # it): the plugin's demand path runs, and must change nothing vLLM decides.
    # As the bench's daemon: a departed engine's cache is not kept (each round starts cold).
    daemon = daemon_factory(memory=vllm_sched.PRESSURE_DAEMON_MEMORY, KVELASTIC_ORPHAN_CACHE_TTL="0")
    runs = vllm_sched.measure(quick=True, socket_path=daemon.socket, pressure=True)
    assert [len(runs[side]) for side in ("stock", "kvelastic")] == [2, 2]
    stock = runs["stock"][0]
    # A fair comparison: every run scheduled the same requests for the same
    # tokens at every step (warm-up included), stock and kvelastic alike.
    for run in runs["stock"] + runs["kvelastic"]:
        assert run["plan"] == stock["plan"]
        assert len(run["schedule"]) == len(run["update"]) == vllm_sched.QUICK_STEPS
        assert all(t > 0 for t in run["schedule"] + run["update"])
    assert all(n == vllm_sched.BATCH for n in stock["running"])   # a full batch at every timed step
    timed = stock["plan"][vllm_sched.WARM_UP:]
    assert all(tokens >= vllm_sched.BATCH for tokens, _, _ in timed)     # a decode each, and prefills
    assert any(tokens > vllm_sched.BATCH for tokens, _, _ in timed)      # requests finish, new ones start

    out = vllm_sched.summarize(runs)
    assert out["sched_step_batch"] == 256 and out["sched_step_same_schedule"] is True
    # A running request's most in one check, from the scheduler's own budget: 2048 tokens and a straddle.
    assert {run["call_blocks"] for run in runs["kvelastic"]} == {vllm_sched.MAX_BATCHED_TOKENS // vllm_sched.BS + 1}
    heard, asked, refused = out["sched_step_demands"]
    assert heard >= 2 * vllm_sched.QUICK_STEPS and asked >= refused   # admissions' needs were heard
    assert out["sched_step_steps"] == vllm_sched.QUICK_STEPS and out["sched_step_rounds"] == 2
    for key in ("sched_step", "sched_update"):
        for side in ("stock", "kvelastic"):
            assert 0 < out[f"{key}_{side}_us"] <= out[f"{key}_{side}_p90_us"]
        low, high = out[f"{key}_ratio_per_round"]
        assert 0 < low <= out[f"{key}_ratio"] <= high
        assert out[f"{key}_p90_ratio"] > 0


def test_the_control_drops_the_journal_and_schedules_as_stock(daemon_factory):
    # The control setting (``ship=False``): the plugin runs as it does in
    # production except that its journal never reaches the daemon, so the
    # difference from the shipped setting is what shipping costs. The daemon
    # keeps departed engines' cache (its default): a round that shipped
    # leaves the round's cache kept (its namespace, ``bench-sched-ROUND``);
    # the control leaves nothing. One pair of sides' processes runs a control
    # round, then a shipped one.
    daemon = daemon_factory(memory="64MiB")
    runs = vllm_sched.measure(quick=True, socket_path=daemon.socket, ship=(False, True))
    assert [len(runs[side]) for side in ("stock", "kvelastic")] == [2, 2]
    for control_or_shipped in range(2):
        assert runs["kvelastic"][control_or_shipped]["plan"] == runs["stock"][control_or_shipped]["plan"]
        assert len(runs["kvelastic"][control_or_shipped]["schedule"]) == vllm_sched.QUICK_STEPS
    kept = {o["namespace"]: o["blocks"] for o in daemon.status()["orphans"]}
    assert list(kept) == ["bench-sched-1"] and kept["bench-sched-1"] > 0   # the shipped round's cache alone
