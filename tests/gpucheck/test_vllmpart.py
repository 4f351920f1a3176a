"""The kit's part 5 judges vLLM runs: what it calls a difference from stock,
when the reference proves nothing, and how vLLM finds the plugin there. (The
runs themselves are real vLLM: ``KVELASTIC_BACKEND=host python -m
kvelastic_tools.gpucheck.vllmpart`` rehearses the whole part here in about
two minutes, too long for the suite; ``tests/vllm/test_offline.py`` runs the
same script through a daemon.)"""

from __future__ import annotations

import copy
import importlib.metadata
import sys

from kvelastic_tools.gpucheck import vllmpart

TOKENS = [[i * 7 + k for k in range(24)] for i in range(6)]


def run(hits: int = 512, tokens=TOKENS) -> dict:
    phase = {"tokens": tokens, "queries": 947, "hits": hits, "seconds": 0.5}
    return {"ok": True, "start_s": 3.0, "cold": dict(phase), "warm": {**phase, "hits": 864},
            "reset": dict(phase)}


def test_equal_runs_pass_and_each_kind_of_difference_is_named():
    stock = run()
    assert vllmpart.compare(stock, {"a": run(), "b": run()}) == []
    other = copy.deepcopy(TOKENS)
    other[3][5] += 1
    problems = vllmpart.compare(stock, {"a": run(tokens=other), "b": run(hits=480), "c": {"ok": False,
                                                                                       "error": "exit 1"}})
    assert "a: cold tokens differ from stock" in problems
    assert "b: cold queries/hits 947/480, stock 947/512" in problems
    assert "c: exit 1" in problems
    assert not any(p.startswith("a:") and "hits" in p for p in problems)   # a's hits equal stock's


def test_a_reference_that_repeats_itself_proves_nothing():
    assert vllmpart.varied(run())
    assert not vllmpart.varied(run(tokens=[[5] * 24 for _ in range(6)]))          # one token over and over
    assert not vllmpart.varied(run(tokens=[TOKENS[0]] * 6))                       # every prompt alike


def test_the_summary_leaves_the_tokens_out_and_keeps_the_figures():
    result = {"status": "passed", "stock": run(), "elastic": {"a": run()}}
    short = vllmpart.summary(result)
    assert "tokens" not in str(short)
    assert short["stock"]["cold"] == {"queries": 947, "hits": 512, "seconds": 0.5}
    assert short["elastic_a"]["start_s"] == 3.0


def test_vllm_finds_the_plugin_through_the_entry_point_written(tmp_path):
    where = vllmpart.plugin_entry_point(tmp_path)
    sys.path.insert(0, str(where))
    try:
        found = [ep for ep in importlib.metadata.entry_points(group="vllm.general_plugins")
                 if ep.name == "kvelastic" and ep.value == "kvelastic_vllm:register"]
        assert found and str(tmp_path) in str(found[0].dist._path)      # ours, not an installed one
    finally:
        sys.path.remove(str(where))
