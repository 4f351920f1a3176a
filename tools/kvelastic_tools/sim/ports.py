"""What a simulated client process (an engine and its workers, ``engine.py``;
a ghost worker, ``ghosts.py``) uses of the world (``world.py``).

The world makes the engines and ghosts and drives them, so they must not
import it: they are handed the world and see it through this ``Protocol``
(``World`` fits it structurally). What only engines use of the world extends
it in ``engine.py``; a hostile client's view is in ``hostile.py``.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from typing import Protocol

from kvelastic import protocol as p
from kvelastic_tools.sim.records import Ghost, SimWorker


class WorkerWorld(Protocol):
    """The fake clock, the wires to the daemon and the ghosts on the books."""

    dirty: bool               # set on a new mapping: the books need another look

    @property
    def now(self) -> float: ...

    @property
    def counts(self) -> collections.Counter[str]: ...

    @property
    def wires(self) -> Mapping[bytes, object]: ...

    @property
    def ghosts(self) -> dict[bytes, Ghost]: ...

    def client_send(self, identity: bytes, msg: p.Msg) -> None: ...

    def send_busy(self, engine_id: str, w: SimWorker) -> None: ...

    def close(self, identity: bytes) -> None: ...

    def close_peer_of(self, engine_id: str, rank: int, token: bytes = b"") -> None: ...
