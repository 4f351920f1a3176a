"""Nodes' tiers as the router sees them: one indexer worker per node.

A node's daemon publishes the blocks of its tier (``docs/tier.md``) on a
stream of their own, the *tier stream*, under a pseudo-engine (topic
``kv@@NAMESPACE``, ``docs/kv-events.md``). No engine holds a tier block:
every engine of its namespace on that node can load it back. So the router
registers each tier stream with the indexer as a worker of its own id and
credits what that worker matches to the engines of the node
(``--tier ID=ENGINES,EVENTS[,REPLAY]``, ``ENGINES`` like ``1+2``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class NodeTier:
    id: int                      # its worker id in the indexer: no engine's
    engines: tuple[int, ...]     # the engines of its node (serving the router's model) it credits
    events: str                  # the daemon's tier stream, and its replay endpoint
    replay: str | None = None


def parse_tier(text: str) -> NodeTier:
    """``ID=ENGINE[+ENGINE...],EVENTS[,REPLAY]``"""
    ident, sep, rest = text.partition("=")
    parts = rest.split(",") if sep else []
    usage = f"expected ID=ENGINE[+ENGINE...],EVENTS[,REPLAY] with positive integer ids, got {text!r}"
    if not ident.isdigit() or int(ident) <= 0 or not 2 <= len(parts) <= 3 or not parts[1]:
        raise ValueError(usage)
    names = parts[0].split("+")
    if not all(n.isdigit() and int(n) > 0 for n in names):
        raise ValueError(usage)
    engines = tuple(int(n) for n in names)
    if len(set(engines)) != len(engines):
        raise ValueError(f"tier {ident}: an engine named twice in {parts[0]!r}")
    return NodeTier(int(ident), engines, parts[1], parts[2] if len(parts) == 3 and parts[2] else None)


def check_tiers(tiers: Iterable[NodeTier], engines: Iterable[int]) -> None:
    """A tier's id must be no engine's (they share the indexer's worker ids) and
    its engines must be the router's; an engine is on one node, so in one tier."""
    known = set(engines)
    seen: dict[int, int] = {}
    ids: set[int] = set()
    for tier in tiers:
        if tier.id in known or tier.id in ids:
            raise ValueError(f"tier {tier.id}: its id is taken (by an engine or another tier)")
        ids.add(tier.id)
        for engine in tier.engines:
            if engine not in known:
                raise ValueError(f"tier {tier.id}: no engine {engine}")
            if engine in seen:
                raise ValueError(f"engine {engine} is in tiers {seen[engine]} and {tier.id}: an engine is on one node")
            seen[engine] = tier.id


def tier_matches(lower: Mapping[int, int], tiers: Iterable[NodeTier]) -> dict[int, int]:
    """Tokens each engine could load from its node's tier: its tier worker's
    match (in host memory or on disk), for every engine of that node."""
    return {engine: lower[tier.id] for tier in tiers if lower.get(tier.id) for engine in tier.engines}
