"""``kvelastic bench route``'s oracle and report, on synthetic traces (no engines).

The oracle (``route_oracle.bound``) must be an upper bound by construction: a
simulated cluster (finite LRU caches, any placement, requests scheduled in an
order other than they were sent, every block of a request cached the moment
it is scheduled, reply included) never serves a request more cached tokens
than the bound. On a trace with no overlap it is exactly "every earlier
request", and one unbounded cache reaches it. The report has the fields the
issue asks for: warm-up apart, ratios per seed and their spread, targets.
"""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from kvelastic_tools.vllm_bench import route_load as load
from kvelastic_tools.vllm_bench.route import BLOCK, QUANTILES, mode_figures, report, spread
from kvelastic_tools.vllm_bench.route_oracle import Seen, bound


def test_bound_on_a_trace_without_overlap_is_every_earlier_request():
    b = 4
    system, m1, m2, r1 = list(range(100, 108)), [1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [11, 12, 13]
    a1 = system + m1                     # 13 tokens: 3 full blocks
    a2 = a1 + r1 + [20, 21, 22]          # user a's next turn: 19 tokens
    c1 = system + m2
    trace = [Seen(a1, r1, sent=0.0, answered=1.0),
             Seen(c1, [30, 31, 32], sent=2.0, answered=3.0),    # shares the system prompt (2 blocks)
             Seen(a2, [40], sent=4.0, answered=5.0),            # a1 + r1 but r1's last token: 3 blocks
             Seen(list(a1[:8]), [], sent=6.0, answered=7.0)]    # 8 tokens all cached: at most 7, so 1 block
    assert bound(trace, b) == [0, 8, 12, 4]
    # Sent only after a1's first token came back: a1 has no credit for it; it has a1's.
    assert bound([Seen(c1, [], 1.5, 2.0), Seen(a1, r1, 0.0, 1.0)], b) == [8, 0]
    # In flight together: each is credited with the other's system prompt.
    assert bound([Seen(c1, [], 0.5, 2.0), Seen(a1, r1, 0.0, 1.0)], b) == [8, 8]
    with pytest.raises(ValueError):
        bound(trace, 0)


def _conversations(rng: random.Random, tenants: int, users: int, turns: int, block: int) -> list[list[int]]:
    """Per user, the token stream it will send (system prompt, then messages and replies)."""
    systems = [[rng.randrange(3, 9) for _ in range(rng.choice((block, 2 * block, 2 * block + 3)))]
               for _ in range(tenants)]
    return [[*systems[u % tenants], *(rng.randrange(3, 9) for _ in range(turns * 10))] for u in range(users)]


def _simulated(seed: int, engines: int, capacity: int | None, placement: str) -> tuple[list[Seen], list[int]]:
    """A trace and the hits a simulated cluster served it: tiny vocabulary (chance collisions),
    users overlapping in time, requests scheduled after a random delay (so not in the order sent),
    each request's prompt and reply (all vLLM computes: not its last token) cached on its engine
    the moment it is scheduled."""
    rng = random.Random(seed)
    block, turns = 4, 4
    streams = _conversations(rng, tenants=2, users=6, turns=turns, block=block)
    reqs = []   # (scheduled, sent, answered, prompt, reply)
    for stream in streams:
        t, used = rng.uniform(0, 3), len(stream) - turns * 10
        for _ in range(turns):
            used += rng.randrange(1, 7)
            prompt, reply = stream[:used], [rng.randrange(3, 9) for _ in range(rng.randrange(1, 6))]
            sched = t + rng.uniform(0, 2)
            answered = sched + rng.uniform(0.01, 1)
            reqs.append((sched, t, answered, prompt, reply))
            stream[used:used] = reply
            used += len(reply)
            t = answered + rng.uniform(0, 1)
    caches: list[OrderedDict[tuple[int, ...], None]] = [OrderedDict() for _ in range(engines)]
    hits = {}
    for i, (_, _, _, prompt, reply) in sorted(enumerate(reqs), key=lambda x: x[1][0]):
        def held(cache: OrderedDict[tuple[int, ...], None], prompt: list[int] = prompt) -> int:
            n = 0
            while n < (len(prompt) - 1) // block and tuple(prompt[:(n + 1) * block]) in cache:
                n += 1
            return n * block
        cache = (max(caches, key=held) if placement == "best" else rng.choice(caches))
        hits[i] = held(cache)
        seq = prompt + reply[:-1]
        for n in range(1, len(seq) // block + 1):
            cache[tuple(seq[:n * block])] = None
            cache.move_to_end(tuple(seq[:n * block]))
        while capacity is not None and len(cache) > capacity:
            cache.popitem(last=False)
    trace = [Seen(p, r, sent, answered) for _, sent, answered, p, r in reqs]
    return trace, [hits[i] for i in range(len(reqs))]


@pytest.mark.parametrize("placement", ["best", "random"])
@pytest.mark.parametrize("capacity", [None, 6])
def test_no_placement_of_any_cache_beats_the_bound(placement, capacity):
    served = limit = 0
    for seed in range(40):
        trace, hits = _simulated(seed, engines=3, capacity=capacity, placement=placement)
        bounds = bound(trace, 4)
        over = [(i, h, o) for i, (h, o) in enumerate(zip(hits, bounds)) if h > o]
        assert not over, f"seed {seed}: hits over the bound (request, hit, bound): {over}"
        served, limit = served + sum(hits), limit + sum(bounds)
    assert 0 < served <= limit     # the traces do share prefixes


def test_one_unbounded_cache_reaches_the_bound_when_nothing_overlaps():
    rng = random.Random(7)
    trace, hits = [], []
    cache: set[tuple[int, ...]] = set()
    t = 0.0
    streams = _conversations(rng, tenants=2, users=4, turns=3, block=4)
    for stream in streams:
        for k in range(3):
            prompt = stream[:len(stream) - (3 - k) * 10]
            reply = [rng.randrange(3, 9) for _ in range(5)]
            n = 0
            while n < (len(prompt) - 1) // 4 and tuple(prompt[:(n + 1) * 4]) in cache:
                n += 1
            hits.append(n * 4)
            seq = prompt + reply[:-1]
            cache.update(tuple(seq[:m * 4]) for m in range(1, len(seq) // 4 + 1))
            trace.append(Seen(prompt, reply, t, t + 0.5))
            t += 1.0
    assert bound(trace, 4) == hits
    assert sum(hits) > 0


def _turns(mode: str, seed: int, shape: load.Shape) -> list[load.Turn]:
    """A sequential trace of ``shape``; kv serves every request its bound, round-robin half
    of it; kv's TTFT is 0.4x round-robin's at every quantile."""
    from kvelastic_tools.vllm_bench.route_oracle import bound as oracle

    conv = load.make_conversations(shape, seed)
    rng = random.Random(seed)
    histories = [list(conv.systems[u % shape.tenants]) for u in range(shape.users)]
    turns, t = [], 0.0
    for u in range(shape.users):
        for k in range(shape.turns):
            prompt = histories[u] + conv.messages[u][k]
            reply = [rng.randrange(*load.VOCAB) for _ in range(shape.max_tokens)]
            ttft = (0.04 if mode == "kv" else 0.1) * (1 + (u * shape.turns + k) % 10)
            turns.append(load.Turn(u, k, len(prompt), engine=1 + u % 4, warmup=k == 0 and u < shape.slots,
                                   prompt=prompt, reply=reply, sent=t, answered=t + ttft, ttft=ttft))
            histories[u] = prompt + reply
            t += 1.0
    for turn, b in zip(turns, oracle([Seen(x.prompt, x.reply, x.sent, x.answered) for x in turns], BLOCK)):
        turn.cached = b if mode == "kv" else b // 2
        turn.matched = b
    return turns


def test_the_report_has_warmup_apart_ratios_per_seed_their_spread_and_targets():
    shape = load.Shape(tenants=2, users=6, turns=3, system_len=96, message_len=40, max_tokens=8, concurrency=2)
    names = {1: "a1", 2: "a2", 3: "b1", 4: "b2"}
    seeds = [{"seed": s, **{m: mode_figures(_turns(m, s, shape), names) for m in ("round_robin", "kv")}}
             for s in (1, 2, 3)]
    out = report(seeds)
    for run in out["runs"]:
        for mode in ("round_robin", "kv"):
            warm, measured = run[mode]["warmup"], run[mode]["measured"]
            assert (warm["requests"], measured["requests"]) == (shape.warmup, shape.requests - shape.warmup)
            assert measured["requests_over_oracle"] == 0 and measured["errors"] == 0
            for q in QUANTILES:
                assert measured[f"ttft_{q}_ms"] is not None
        assert run["hit_rate_vs_oracle"] == 1.0       # kv served every request its bound
        assert run["round_robin"]["measured"]["hit_rate_vs_oracle"] <= 0.5
        assert run["ttft_ratios"] == {"p50": 0.4, "p90": 0.4, "p99": 0.4}
        assert run["comparable"]
        short = run["round_robin"]["measured"]
        assert short["short_of_oracle_tokens"] == short["oracle_hit_tokens"] - short["hit_tokens"] > 0
        assert short["short_not_cached_tokens"] == short["short_of_oracle_tokens"]   # claimed, not served
    assert out["comparable"]
    assert out["hit_rate_vs_oracle"] == {"min": 1.0, "median": 1.0, "max": 1.0, "runs": [1.0, 1.0, 1.0]}
    assert set(out["ttft_ratios"]) == {"p50", "p90", "p99"}
    assert set(out["targets"]) == {"hit_rate_ge_0.9x_oracle", "ttft_p90_le_0.6x_round_robin"}
    for target in out["targets"].values():
        assert set(target) >= {"value", "worst", "target", "met", "met_every_seed"}
        assert target["met"] and target["met_every_seed"]
    assert out["targets_met"]
    # A seed that misses: the median still meets, the worst does not; an error makes nothing met.
    seeds[1]["kv"]["measured"]["ttft_p90_ms"] = seeds[1]["round_robin"]["measured"]["ttft_p90_ms"]
    worse = report(seeds)["targets"]["ttft_p90_le_0.6x_round_robin"]
    assert (worse["value"], worse["worst"], worse["met"], worse["met_every_seed"]) == (0.4, 1.0, True, False)
    seeds[0]["kv"]["measured"]["errors"] = 1
    assert not report(seeds)["targets_met"] and not report(seeds)["comparable"]


def test_spread_and_the_full_shape():
    assert spread([0.7, None, 0.5, 0.9]) == {"min": 0.5, "median": 0.7, "max": 0.9, "runs": [0.7, None, 0.5, 0.9]}
    assert spread([None])["median"] is None
    full = load.FULL
    assert full.requests - full.warmup >= 400                       # p99 is not one request
    longest = full.system_len + full.turns * full.message_len + (full.turns - 1) * full.max_tokens
    assert longest + full.max_tokens <= 1024                         # vllm_serve's --max-model-len
