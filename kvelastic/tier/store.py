"""What a tier medium must do, whatever holds the bytes (docs/tier.md).

The tier's index (``index.py``) decides which block lives in which slot;
a *store* keeps each slot's bytes: it writes a block whole or not at all,
reads back a block's payload only once it checks (its tag, its namespace
and key), deletes a slot's bytes, and after a restart reports every block
it still holds (``scan``) so the index can be rebuilt (``restart.py``).
The media: the disk (``disk.py``: a file a block, in a folder only the
daemon may write), host memory (``host.py``), and host memory over the disk
(``layered.py``: blocks enter above and move down); ``media.open_store``
chooses. Nothing outside the tier names a medium: the daemon holds a
``TierStore``.

No I/O here: the types the allocator and the loop share with the media.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol


@dataclasses.dataclass(frozen=True)
class StoredBlock:
    """A block as its store describes it (a file's header, on disk)."""

    slot: int
    namespace: str
    key: bytes
    parent: bytes | None
    nbytes: int         # the payload's length
    cost: float
    label: bytes = b""  # the engine's KV event for it (b"": none)


@dataclasses.dataclass
class ScanResult:
    entries: list[StoredBlock]                                         # in slot order
    dropped: dict[str, int] = dataclasses.field(default_factory=dict)  # blocks deleted, by reason


class TierStore(Protocol):
    """A tier medium. Every call may raise a ``TierError`` (``errors.py``):
    ``TierDiskFull`` or ``TierWriteError`` from ``write`` (and nothing left
    of the block), ``TierReadError`` and its kinds from ``read``."""

    @property
    def keyed(self) -> bool:
        """Whether what it reads is proven this daemon's (tagged under the node's key)."""
        ...

    def write(self, slot: int, namespace: str, key: bytes, payload: bytes | bytearray | memoryview, *,
              cost: float, parent: bytes | None = None, label: bytes = b"", level: int = 0) -> None:
        """Write a block whole, or raise and keep nothing of it; ``level``:
        the medium, 0 the top (a store of one medium has only 0)."""
        ...

    def read(self, slot: int, namespace: str | None = None, key: bytes | None = None) -> bytes: ...

    def header(self, slot: int) -> StoredBlock: ...

    def delete(self, slot: int) -> None: ...

    def move(self, slot: int) -> None:
        """Move a block's bytes one medium down, whole (the block readable
        throughout) or not at all; a store of one medium raises ``TierWriteError``."""
        ...

    def scan(self, *, verify_payloads: bool = False) -> ScanResult: ...

    def close(self) -> None: ...
