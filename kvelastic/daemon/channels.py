"""Which processes of an engine are alive, as the daemon knows it: the page
channels and lifelines open to it. A channel speaks for a registration only
if its greeting showed that registration's secret, so an impostor's
channel, whatever engine and rank it names, neither keeps a process alive
nor ends it. No I/O: the loop reports openings and closings.
"""

from __future__ import annotations

from collections.abc import Iterator

from kvelastic.daemon.state import EngineRecord


class OpenChannels:
    def __init__(self) -> None:
        # (engine id, rank) -> {secret shown in the greeting: open channels}; rank -1: the lifeline.
        self._open: dict[tuple[str, int], dict[bytes, int]] = {}

    def opened(self, engine_id: str, rank: int, token: bytes) -> None:
        tokens = self._open.setdefault((engine_id, rank), {})
        tokens[token] = tokens.get(token, 0) + 1

    def closed(self, engine_id: str, rank: int, token: bytes) -> None:
        """One channel of (engine, rank) that showed ``token`` closed (it was opened)."""
        key = (engine_id, rank)
        tokens = self._open[key]
        tokens[token] -= 1
        if not tokens[token]:
            del tokens[token]
        if not tokens:
            del self._open[key]

    def alive(self, engine: EngineRecord, rank: int) -> bool:
        """A channel of that process is open, one that showed the engine's secret."""
        return self._open.get((engine.engine_id, rank), {}).get(engine.token, 0) > 0

    def alive_ranks(self, engine: EngineRecord) -> set[int]:
        return {rank for rank in range(engine.num_workers) if self.alive(engine, rank)}

    def items(self) -> Iterator[tuple[tuple[str, int], dict[bytes, int]]]:
        """Every (engine id, rank) with open channels, by secret: for checks and snapshots."""
        return iter(self._open.items())
