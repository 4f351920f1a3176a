"""LayeredStore: host memory over the disk, one tier (docs/tier.md).

The index decides which level a block lives on (``books.py``: every block
enters the top; making room there moves the least valuable down); this
store keeps each slot's bytes where the index put them. ``write`` goes to
the upper medium, ``move`` copies a block to the lower one under the same
slot and then lets the upper copy go, ``read`` and ``delete`` find the slot
wherever it is. After a restart only the lower medium (the disk) holds
anything: ``scan`` is its scan.

A read that races a move reads the upper copy or the lower one, both whole:
the slot's place changes only once the lower copy is written, and a read
that finds the upper copy gone meanwhile looks again. A delete removes the
slot from both media, so a move cut short by it leaves nothing behind (the
writer runs a move and a delete of the same slot one after the other, never
at once: ``writer.py``).
"""

from __future__ import annotations

import threading

from kvelastic.tier.errors import TierReadError, TierWriteError
from kvelastic.tier.store import ScanResult, StoredBlock, TierStore


class LayeredStore:
    def __init__(self, upper: TierStore, lower: TierStore) -> None:
        self.upper, self.lower = upper, lower
        self._mu = threading.Lock()
        self._where: dict[int, TierStore] = {}     # slot -> the medium that holds its bytes

    @property
    def keyed(self) -> bool:
        return self.upper.keyed and self.lower.keyed

    def write(self, slot: int, namespace: str, key: bytes, payload: bytes | bytearray | memoryview, *,
              cost: float, parent: bytes | None = None, label: bytes = b"", level: int = 0) -> None:
        """To the upper medium (``level`` 0), or the lower (1: the index found no room above)."""
        if level not in (0, 1):
            raise ValueError(f"two media, no level {level}")
        medium = self.lower if level else self.upper
        medium.write(slot, namespace, key, payload, cost=cost, parent=parent, label=label)
        with self._mu:
            self._where[slot] = medium

    def move(self, slot: int) -> None:
        with self._mu:
            here = self._where.get(slot)
        if here is not self.upper:
            raise TierWriteError(f"tier block {slot}: not in the upper medium")
        try:
            head = self.upper.header(slot)
            payload = self.upper.read(slot, head.namespace, head.key)
        except TierReadError as exc:
            raise TierWriteError(f"tier block {slot}: not moved: {exc}") from exc
        self.lower.write(slot, head.namespace, head.key, payload, cost=head.cost, parent=head.parent,
                         label=head.label)
        with self._mu:
            moved = self._where.get(slot) is self.upper
            if moved:
                self._where[slot] = self.lower
        (self.upper if moved else self.lower).delete(slot)    # deleted meanwhile: the new copy goes too

    def _medium(self, slot: int) -> TierStore:
        with self._mu:
            here = self._where.get(slot)
        if here is None:
            raise TierReadError(f"tier block {slot}: in no medium")
        return here

    def read(self, slot: int, namespace: str | None = None, key: bytes | None = None) -> bytes:
        here = self._medium(slot)
        try:
            return here.read(slot, namespace, key)
        except TierReadError:
            if here is self.upper and self._medium(slot) is self.lower:    # moved down meanwhile
                return self.lower.read(slot, namespace, key)
            raise

    def header(self, slot: int) -> StoredBlock:
        return self._medium(slot).header(slot)

    def delete(self, slot: int) -> None:
        with self._mu:
            self._where.pop(slot, None)
        self.upper.delete(slot)
        self.lower.delete(slot)

    def scan(self, *, verify_payloads: bool = False) -> ScanResult:
        """What a restart finds: the lower medium's blocks (the upper's went with the daemon before)."""
        found = self.lower.scan(verify_payloads=verify_payloads)
        with self._mu:
            for e in found.entries:
                self._where[e.slot] = self.lower
        return found

    def close(self) -> None:
        self.upper.close()
        self.lower.close()
