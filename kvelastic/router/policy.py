"""Which engine serves a request: the decision, apart from any I/O.

``Picker.choose`` takes the indexer's overlap scores (matched tokens per
engine), the prompt's length and each engine's *load*: the prompt tokens it
still has to compute for the requests in flight there. KV policy: the least
work to wait for, ``prompt - matched + load``, the way KV-aware routers
weigh a cache hit against a queue (a long match on a swamped engine can lose
to a short one on an idle engine). With no load anywhere that is the longest
match. Ties go round-robin, so a prompt nobody holds spreads over the
engines. Round-robin policy ignores everything (the baseline).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


class Policy(enum.Enum):
    KV = "kv"
    ROUND_ROBIN = "round-robin"


@dataclass(frozen=True)
class Choice:
    engine: int
    matched_tokens: int   # the indexer's score for the chosen engine (0 under round-robin)
    best_tokens: int      # the best score of any engine


class Picker:
    """Invariant: ``choose`` returns one of ``engines`` and, under the KV
    policy, one whose ``prompt - matched + load`` is the least."""

    def __init__(self, engines: Sequence[int], policy: Policy) -> None:
        if not engines:
            raise ValueError("a router needs at least one engine")
        if len(set(engines)) != len(engines):
            raise ValueError(f"engine ids must differ: {list(engines)}")
        self.engines = list(engines)
        self.policy = policy
        self._next = 0   # round-robin position

    def _round_robin(self, among: Sequence[int]) -> int:
        # The next engine in the fixed order that is among the candidates.
        n = len(self.engines)
        for step in range(n):
            engine = self.engines[(self._next + step) % n]
            if engine in among:
                self._next = (self._next + step + 1) % n
                return engine
        raise AssertionError("no candidate among the engines")

    def choose(self, scores: Mapping[int, int], load: Mapping[int, int], prompt_tokens: int = 0) -> Choice:
        best = max((scores.get(e, 0) for e in self.engines), default=0)
        if self.policy is Policy.ROUND_ROBIN:
            return Choice(self._round_robin(self.engines), 0, best)
        cost = {e: max(0, prompt_tokens - scores.get(e, 0)) + load.get(e, 0) for e in self.engines}
        least = min(cost.values())
        engine = self._round_robin([e for e in self.engines if cost[e] == least])
        return Choice(engine, scores.get(engine, 0), best)
