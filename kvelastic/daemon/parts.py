"""What the allocator's parts ask of each other, as small interfaces.

Grows, reclaims and unmaps depend on each other by nature: a grow may
reclaim from another engine and unmaps a slab that failed to map; a reclaim
and an unmap free pages a grow waits for. Each part is handed the others it
calls as these interfaces (``allocator.py`` wires them), so no part module
imports another's and no part reaches into another's state.
"""

from __future__ import annotations

from typing import Protocol

from kvelastic.daemon.requests import GrowRequest
from kvelastic.daemon.state import EngineRecord, SlabRecord


class GrowPass(Protocol):
    """The grows pending (``growth.py``)."""

    def progress(self) -> None:
        """Advance every pending grow: pages may have come free."""

    def request(self, seq: int) -> GrowRequest | None:
        """The pending grow ``seq``, if it is still pending."""

    def of_engine(self, engine_id: str) -> list[GrowRequest]:
        """The grows ``engine_id`` has pending."""

    def slabs_in_flight(self) -> set[tuple[str, int]]:
        """(engine id, slab) mapping for a grow still in progress: its engine does not hold them yet."""


class Unmapper(Protocol):
    """Slabs going back to the daemon (``unmapping.py``)."""

    def start_unmap(self, engine: EngineRecord, slab: SlabRecord, at_once: bool = False) -> None:
        """Ask every live worker of ``engine`` to unmap ``slab`` (``at_once``:
        without waiting for the step that runs; its engine said none writes it)."""


class Reclaimer(Protocol):
    """Memory asked back from other engines (``reclaims.py``)."""

    def reclaim_for(self, req: GrowRequest, requester: EngineRecord, short: int) -> None:
        """Ask other engines for ``short`` slabs for ``req``."""

    def drain_for(self, requester: EngineRecord, short: int) -> None:
        """The requester's hard demand for ``short`` slabs went unmet: ask the
        engines over their fair share to drain slabs for it."""

    def fair_share(self, engine: EngineRecord) -> int:
        """Bytes each engine active on ``engine``'s device is due now."""
