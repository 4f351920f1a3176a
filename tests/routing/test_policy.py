"""The router's decision (``kvelastic.router.policy``), driven as a state machine:
property tests over arbitrary scores and loads."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvelastic.router.policy import Picker, Policy

ENGINES = [3, 1, 7, 2]
scores_st = st.dictionaries(st.sampled_from(ENGINES + [99]), st.integers(0, 4096), max_size=5)
loads_st = st.fixed_dictionaries({e: st.integers(0, 8) for e in ENGINES})


@given(st.lists(st.tuples(scores_st, loads_st, st.integers(0, 4096)), min_size=1, max_size=40))
def test_kv_policy_takes_the_least_work_to_wait_for(steps):
    picker = Picker(ENGINES, Policy.KV)
    for scores, loads, prompt in steps:
        choice = picker.choose(scores, loads, prompt)
        assert choice.engine in ENGINES
        cost = {e: max(0, prompt - scores.get(e, 0)) + loads[e] for e in ENGINES}   # 99 is no engine here
        assert cost[choice.engine] == min(cost.values())
        assert choice.matched_tokens == scores.get(choice.engine, 0)
        assert choice.best_tokens == max(scores.get(e, 0) for e in ENGINES)


@given(scores_st, st.integers(4096, 8192))
def test_with_no_load_the_longest_match_wins(scores, prompt):
    choice = Picker(ENGINES, Policy.KV).choose(scores, {}, prompt)
    assert choice.matched_tokens == choice.best_tokens == max(scores.get(e, 0) for e in ENGINES)


def test_a_swamped_engine_loses_to_an_idle_one_with_less_cached():
    picker = Picker([1, 2], Policy.KV)
    assert picker.choose({1: 512, 2: 64}, {1: 2000, 2: 0}, 600).engine == 2   # 536 to wait for, not 2088
    assert picker.choose({1: 512, 2: 64}, {1: 100, 2: 0}, 600).engine == 1    # 188, not 536


@given(st.integers(1, 30))
def test_equal_candidates_take_turns(n):
    picker = Picker(ENGINES, Policy.KV)
    idle = dict.fromkeys(ENGINES, 0)
    chosen = [picker.choose({}, idle, 100).engine for _ in range(n * len(ENGINES))]
    assert all(chosen.count(e) == n for e in ENGINES)   # a prompt nobody holds spreads like round-robin


@given(st.lists(st.tuples(scores_st, loads_st), min_size=8, max_size=8))
def test_round_robin_ignores_scores_and_loads(steps):
    picker = Picker(ENGINES, Policy.ROUND_ROBIN)
    chosen = [picker.choose(scores, loads, 100) for scores, loads in steps]
    assert [c.engine for c in chosen] == ENGINES * 2
    assert all(c.matched_tokens == 0 for c in chosen)


def test_a_picker_needs_distinct_engines():
    with pytest.raises(ValueError, match="at least one"):
        Picker([], Policy.KV)
    with pytest.raises(ValueError, match="must differ"):
        Picker([1, 1], Policy.KV)


@pytest.mark.parametrize("text, error", [
    ("0=http://h:1", "positive integer"), ("x=http://h:1", "positive integer"), ("1", "positive integer"),
    ("1=https://h:1", "http://HOST:PORT"), ("1=http://h", "http://HOST:PORT"),
    ("1=http://h:1,a,b,c", "positive integer"),
])
def test_engine_arguments_are_checked(text, error):
    from kvelastic.router.proxy import parse_engine

    with pytest.raises(ValueError, match=error):
        parse_engine(text)


def test_engine_argument_with_event_endpoints():
    from kvelastic.router.proxy import Engine, parse_engine

    assert parse_engine("2=http://n1:8001/,tcp://n1:5557,tcp://n1:5558") == \
        Engine(2, "http://n1:8001", "tcp://n1:5557", "tcp://n1:5558")
    assert parse_engine("2=http://n1:8001") == Engine(2, "http://n1:8001", None, None)
