"""The allocator's request records and deadlines: plain data that its parts
(``growth.py``, ``reclaims.py``, ``unmapping.py``, ``handoff.py``,
``invalidation.py``) share, kept below them so none imports another."""

from __future__ import annotations

import dataclasses

from kvelastic import protocol as p


@dataclasses.dataclass(frozen=True)
class Timing:
    """Deadlines, in seconds (``config.py`` sets them)."""

    heartbeat_timeout: float = p.HEARTBEAT_TIMEOUT
    reclaim_timeout: float = p.RECLAIM_TIMEOUT
    ack_timeout: float = p.ACK_TIMEOUT
    grow_timeout: float = p.GROW_TIMEOUT
    idle_grace: float = p.IDLE_GRACE
    hold_down: float = p.HOLD_DOWN
    orphan_ttl: float = p.ORPHAN_CACHE_TTL      # a departed engine's cache is kept this long (0: never)


@dataclasses.dataclass(frozen=True)
class Handoff:
    """A slab given up for a grow of the giver's namespace, unmapped: its
    pages (free under the taker's tag) and the cached blocks they hold."""

    pages: list[int]
    page_devices: list[str]
    cached: tuple[p.CachedBlock, ...]


@dataclasses.dataclass(eq=False)
class GrowRequest:
    seq: int
    engine_id: str
    identity: bytes
    req_id: int
    wanted: int
    started: float
    deadline: float
    demand: bool = False
    slabs: list[int] = dataclasses.field(default_factory=list)     # mapped and granted
    mapping: set[int] = dataclasses.field(default_factory=set)     # waiting for worker acks
    reclaims: set[int] = dataclasses.field(default_factory=set)      # reclaim request ids outstanding
    reclaim_rounds: int = 0
    # Slabs given up for this grow, still unmapping: their pages are on the way.
    incoming: set[tuple[str, int]] = dataclasses.field(default_factory=set)
    # Slabs given up for it by an engine of its namespace, unmapped: their
    # pages (free under the requester's tag) and the cached blocks they hold.
    handoffs: list[Handoff] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(eq=False)
class ReturnRequest:
    """A ``Return``: answered once every slab in it is unmapped by every worker."""

    identity: bytes
    req_id: int
    unmapping: set[int]


@dataclasses.dataclass(eq=False)
class ReclaimRequest:
    engine_id: str
    slabs: list[int]
    grow: GrowRequest
    deadline: float
    scopes: tuple[int, int] = (0, 0)   # the giver's and the requester's ``scope_changes`` when it was sent
