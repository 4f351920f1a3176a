"""Which engine serves a request: the decision, apart from any I/O.

``Picker.choose`` takes the indexer's overlap scores (matched tokens per
engine, in its device memory), the prompt's length, each engine's *load*
(the prompt tokens it still has to compute for the requests in flight
there) and, where nodes have a tier (``docs/tier.md``), the tokens each
engine could load back from its node's tier. KV policy: the least work to
wait for, ``prompt - credit + load``, the way KV-aware routers weigh a cache
hit against a queue (a long match on a swamped engine can lose to a short
one on an idle engine). With no load anywhere that is the longest match.
Ties go round-robin, so a prompt nobody holds spreads over the engines.
Round-robin policy ignores everything (the baseline).

**The tier's credit.** An engine loads from its node's tier past its own
device hit, so the prefix it reaches is the longer of the two; the tokens
past the device hit are not computed but loaded, which costs something. So
a tier token is credited ``tier_weight`` of a device token (default
``TIER_WEIGHT``): ``credit = device + tier_weight * max(0, tier - device)``.
For any weight in (0, 1) an engine holding the prefix in device memory is
preferred to one that must load it, and that one to an engine with neither.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

# What a token loaded from the tier is worth beside one in device memory
# (1) and one computed (0). Loading one token's KV from the disk tier costs
# from about a twentieth of computing it (a CPU node: ~128 KiB of an 8B
# model's KV read, checked and copied at ~1 GB/s, against a CPU prefill of a
# few ms per token) to about as much (a GPU node prefilling at tens of us per
# token, while this tier moves bytes over the control socket). Half is the
# middle of that range and keeps the order strict both ways; an operator who
# measured their nodes sets ``--tier-weight``.
TIER_WEIGHT = 0.5


class Policy(enum.Enum):
    KV = "kv"
    ROUND_ROBIN = "round-robin"


@dataclass(frozen=True)
class Choice:
    engine: int
    matched_tokens: int   # the indexer's score for the chosen engine (0 under round-robin)
    best_tokens: int      # the best score of any engine
    tier_tokens: int = 0  # tokens past ``matched_tokens`` the engine may load from its node's tier


def credit(device: int, tier: int, tier_weight: float) -> float:
    """The tokens an engine is credited: its device hit, and the part of its
    node's tier match past it at ``tier_weight``."""
    return device + tier_weight * max(0, tier - device)


class Picker:
    """Invariant: ``choose`` returns one of ``engines`` and, under the KV
    policy, one whose ``prompt - credit + load`` is the least."""

    def __init__(self, engines: Sequence[int], policy: Policy, tier_weight: float = TIER_WEIGHT) -> None:
        if not engines:
            raise ValueError("a router needs at least one engine")
        if len(set(engines)) != len(engines):
            raise ValueError(f"engine ids must differ: {list(engines)}")
        if not 0.0 <= tier_weight < 1.0:
            # 1 or more would rank a load from the tier with (or over) a device hit.
            raise ValueError(f"the tier's weight must be at least 0 and below 1, got {tier_weight}")
        self.engines = list(engines)
        self.policy = policy
        self.tier_weight = tier_weight
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

    def work(self, prompt_tokens: int, device: int, tier: int) -> float:
        """The prompt's work left on an engine with these matches, in computed tokens."""
        return max(0.0, prompt_tokens - credit(device, tier, self.tier_weight))

    def choose(self, scores: Mapping[int, int], load: Mapping[int, int], prompt_tokens: int = 0,
               tier: Mapping[int, int] | None = None) -> Choice:
        """``scores``: device-matched tokens per engine; ``tier``: tokens each
        engine's node's tier matches (engines of a node without one: absent)."""
        tier = tier or {}
        best = max((scores.get(e, 0) for e in self.engines), default=0)
        if self.policy is Policy.ROUND_ROBIN:
            return Choice(self._round_robin(self.engines), 0, best)
        cost = {e: self.work(prompt_tokens, scores.get(e, 0), tier.get(e, 0)) + load.get(e, 0)
                for e in self.engines}
        least = min(cost.values())
        engine = self._round_robin([e for e in self.engines if cost[e] == least])
        matched = scores.get(engine, 0)
        return Choice(engine, matched, best, max(0, tier.get(engine, 0) - matched))
