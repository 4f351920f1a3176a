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


# ------------------------------------------------------------ nodes' tiers
tier_st = st.dictionaries(st.sampled_from(ENGINES), st.integers(0, 4096), max_size=4)


@given(st.lists(st.tuples(scores_st, tier_st, loads_st, st.integers(0, 4096)), min_size=1, max_size=40),
       st.sampled_from([0.0, 0.25, 0.5, 0.9]))
def test_a_tier_match_counts_past_the_device_hit_at_its_weight(steps, weight):
    picker = Picker(ENGINES, Policy.KV, weight)
    for scores, tier, loads, prompt in steps:
        choice = picker.choose(scores, loads, prompt, tier)
        device = {e: scores.get(e, 0) for e in ENGINES}
        cost = {e: max(0.0, prompt - device[e] - weight * max(0, tier.get(e, 0) - device[e])) + loads[e]
                for e in ENGINES}
        assert cost[choice.engine] == min(cost.values())
        assert choice.matched_tokens == device[choice.engine]
        assert choice.tier_tokens == max(0, tier.get(choice.engine, 0) - device[choice.engine])


@given(st.integers(1, 64), st.integers(0, 64), st.sampled_from([0.01, 0.5, 0.99]), st.permutations([1, 2, 3]))
def test_device_before_tier_before_nothing(blocks, rest, weight, order):
    """The same prefix held in one engine's device memory, in another's node's
    tier, and nowhere for a third: device first; without it, the tier's."""
    prefix, prompt = blocks * 32, blocks * 32 + rest + 1
    picker = Picker(order, Policy.KV, weight)
    idle = dict.fromkeys(order, 0)
    for _ in range(3):   # whatever the round-robin position
        assert picker.choose({1: prefix}, idle, prompt, {2: prefix}).engine == 1
        choice = picker.choose({}, idle, prompt, {2: prefix})
        assert (choice.engine, choice.matched_tokens, choice.tier_tokens) == (2, 0, prefix)
        # An engine of the tier's node holding part of it on its device loads the rest.
        assert picker.choose({2: 32}, idle, prompt, {2: prefix}).tier_tokens == prefix - 32


def test_a_tier_load_is_cheaper_than_a_queue_only_up_to_its_weight():
    picker = Picker([1, 2], Policy.KV, 0.5)
    # 512 tokens in engine 2's node's tier save 256 computed ones: worth a queue of 200, not of 300.
    assert picker.choose({}, {1: 0, 2: 200}, 600, {2: 512}).engine == 2
    assert picker.choose({}, {1: 0, 2: 300}, 600, {2: 512}).engine == 1


@pytest.mark.parametrize("weight", [-0.1, 1.0, 2.0])
def test_a_tier_weighs_less_than_a_device(weight):
    with pytest.raises(ValueError, match="below 1"):
        Picker([1], Policy.KV, weight)


def test_tier_arguments():
    from kvelastic.router.tiers import NodeTier, parse_tier

    assert parse_tier("100=1+2,ipc:///run/k.sock.kv-tier,ipc:///run/k.sock.kv-tier-replay") == \
        NodeTier(100, (1, 2), "ipc:///run/k.sock.kv-tier", "ipc:///run/k.sock.kv-tier-replay")
    assert parse_tier("9=3,tcp://n1:5559") == NodeTier(9, (3,), "tcp://n1:5559", None)
    for bad in ("100=1+2", "0=1,tcp://n:1", "x=1,tcp://n:1", "100=,tcp://n:1", "100=1+x,tcp://n:1",
                "100=1,", "100=1,a,b,c"):
        with pytest.raises(ValueError, match="expected ID=ENGINE"):
            parse_tier(bad)
    with pytest.raises(ValueError, match="named twice"):
        parse_tier("100=1+1,tcp://n:1")


def test_tiers_are_checked_against_the_engines_and_credit_their_node():
    from kvelastic.router.tiers import NodeTier, check_tiers, tier_matches

    a, b = NodeTier(100, (1, 2), "ipc://a"), NodeTier(101, (3,), "ipc://b")
    check_tiers([a, b], [1, 2, 3, 4])
    for tiers, error in (([NodeTier(1, (2,), "x")], "taken"), ([a, NodeTier(100, (3,), "x")], "taken"),
                         ([NodeTier(100, (5,), "x")], "no engine 5"), ([a, NodeTier(101, (2,), "x")], "one node")):
        with pytest.raises(ValueError, match=error):
            check_tiers(tiers, [1, 2, 3, 4])
    # Tier 100 matches 64 tokens: both engines of its node may load them; engine 3's node's tier has none.
    assert tier_matches({100: 64, 1: 32, 101: 0}, [a, b]) == {1: 64, 2: 64}


class _Indexer:
    """What ``Registrations`` and ``register_engines`` ask an indexer, recorded."""

    def __init__(self, listed: set[int]) -> None:
        self.listed = set(listed)
        self.calls: list[tuple[str, int]] = []

    def workers(self) -> set[int]:
        return set(self.listed)

    def register(self, ident: int, events: str, replay: str | None, block_size: int) -> None:
        self.calls.append(("register", ident))
        self.listed.add(ident)

    def unregister(self, ident: int) -> None:
        self.calls.append(("unregister", ident))
        self.listed.discard(ident)


def test_a_nodes_tier_stream_is_registered_and_registered_again_when_the_indexer_lost_it():
    from kvelastic.metrics import RouterMetrics
    from kvelastic.router.proxy import Registrations, register_engines
    from kvelastic.router.tiers import NodeTier

    tier = NodeTier(100, (1,), "ipc:///run/k.sock.kv-tier", "ipc:///run/k.sock.kv-tier-replay")
    indexer = _Indexer({100})                  # a router before this one registered it
    assert register_engines([], indexer, 32, [tier]) == 1  # type: ignore[arg-type]
    assert indexer.calls == [("unregister", 100), ("register", 100)]
    watch = Registrations([], indexer, 32, RouterMetrics([]), tiers=[tier])  # type: ignore[arg-type]
    indexer.calls.clear()
    watch.check()
    assert indexer.calls == []                 # listed: left alone
    indexer.listed.clear()                     # the indexer restarted
    watch.check()
    assert indexer.calls == [("register", 100)]
