"""What the simulated node's parts share: its constants and the records its
engines, ghosts, hostile clients and the world (``world.py``) all pass around.

They live here, below every module that uses them, so that none of those
modules has to import another to name them (no import circle in the sim).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import Any

from kvelastic import protocol as p
from kvelastic.core.block import BlockRecord

BLOCKS_PER_SLAB = 4
# A worker holding unmaps until its step ends says so (``Busy``) when the
# protocol has it (``WorkerClient._tick``); without it a long step is taken for a hung worker.
BUSY: Any = getattr(p, "Busy", None)


@dataclasses.dataclass(eq=False)
class KV:
    """What one block's place in a page holds: the KV of ``key`` (None: a
    block not full yet, no key) in ``namespace``, written by ``writer`` in its
    model step ``step``; ``complete`` once that step finished (until then the
    place is torn: a kill -9 leaves it so)."""

    namespace: str
    writer: str
    key: bytes | None
    step: int
    complete: bool = False


@dataclasses.dataclass
class SimWorker:
    rank: int
    identity: bytes
    mapped: dict[int, list[int]] = dataclasses.field(default_factory=dict)   # slab -> pages
    channel: deque = dataclasses.field(default_factory=deque)                  # page ids sent, not yet taken
    stuck_until: float = 0.0          # withholds every answer until then (a hung worker)
    token: bytes = b""                # the secret its page channel showed
    deferred: list = dataclasses.field(default_factory=list)                   # unmaps waiting for the step
    registered: bool = False
    deferred_at: float = 0.0          # when the first unmap deferred now arrived
    busy_at: float = -1e9             # when it last said Busy
    ack_timeout: float = p.ACK_TIMEOUT   # the daemon's, from its registration

    def defer(self, msg: p.UnmapSlab, now: float) -> None:
        """An unmap during a step waits for its end; the daemon hears so at once (Busy)."""
        if not self.deferred:
            self.deferred_at = now
        self.deferred.append(msg)
        self.busy_at = -1e9


@dataclasses.dataclass(eq=False)
class Step:
    """A model step: scheduled, then (sealed and) running, then ended."""

    n: int
    writes: list[tuple[BlockRecord, bytes | None]]     # the blocks it writes, with their keys
    sync_req: int = 0                # sealing: the sync journal whose Ok it waits for
    sync_sent: float = 0.0
    running: bool = False
    torn: list[tuple[tuple[int, int], KV]] = dataclasses.field(default_factory=list)   # written, not complete
    until: float = 0.0               # a long step (longer than the ack deadline) runs until then
    overlapped: bool = False         # it held an unmap past the ack deadline


@dataclasses.dataclass(eq=False)
class Ghost:
    """A worker of an engine's earlier registration that has not exited yet (``ghosts.py``)."""

    engine_id: str
    worker: SimWorker
    frozen: bool                # hung: answers nothing and says nothing until it exits
    step_until: float           # its step ends then (unmaps wait for it)
    exit_at: float

    def stepping(self, now: float) -> bool:
        return now < self.step_until


class Device:
    """Fake physical pages: ``content[page]`` is the engine (and its namespace)
    that last wrote it; ``kv[(page, offset)]`` what block ``offset`` of the slab
    the page lies in holds (each worker's page of a slab holds its share of
    every block of it)."""

    def __init__(self) -> None:
        self.pages: set[int] = set()
        self.content: dict[int, tuple[str, str]] = {}
        self.kv: dict[tuple[int, int], KV] = {}
        self.fail_creation = False

    def forget(self, page: int) -> None:
        self.content.pop(page, None)
        for offset in range(BLOCKS_PER_SLAB):
            self.kv.pop((page, offset), None)
