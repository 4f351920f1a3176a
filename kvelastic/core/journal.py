"""The journal: every change the daemon must mirror, in compact batches.

The pool appends ops as it works and ``take()`` hands out a ``JournalBatch``:
the ordered ops plus the final occupancy of every slab touched since the last
batch (occupancy is coalesced: only the latest counts matter). ``Mirror`` is
the other end: the daemon applies batches to it, and the tests check that
replaying every batch into an empty mirror yields the pool's own state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable
from typing import Final, Literal

# Op codes: small ints keep the ops msgpack-compact.
ADD_SLAB: Final = 0      # (ADD_SLAB, slab_id)
REMOVE_SLAB: Final = 1   # (REMOVE_SLAB, slab_id)
STORE: Final = 2         # (STORE, key, block_id)
REMOVE: Final = 3        # (REMOVE, key, block_id)
CLEAR: Final = 4         # (CLEAR,)  every key dropped (invalidate / reset)

# One op: a plain tuple whose code says its shape (for the type checker too:
# ``op[0] == STORE`` narrows an ``Op`` to a ``KeyOp``).
SlabOp = tuple[Literal[0, 1], int]            # ADD_SLAB, REMOVE_SLAB
KeyOp = tuple[Literal[2, 3], Hashable, int]   # STORE, REMOVE
ClearOp = tuple[Literal[4]]                   # CLEAR
Op = SlabOp | KeyOp | ClearOp

Occupancy = tuple[int, int, int]  # (live, cached, free) blocks


@dataclasses.dataclass
class JournalBatch:
    ops: list[Op]
    occupancy: dict[int, Occupancy]

    def __bool__(self) -> bool:
        return bool(self.ops or self.occupancy)


class Journal:
    __slots__ = ("ops", "dirty")

    def __init__(self) -> None:
        self.ops: list[Op] = []
        self.dirty: set[int] = set()

    def take(self, occupancy_of: Callable[[int], Occupancy | None]) -> JournalBatch:
        """Hand out everything recorded so far; ``occupancy_of(slab)`` is None
        for a slab no longer held."""
        occupancy: dict[int, Occupancy] = {}
        for slab_id in self.dirty:
            occ = occupancy_of(slab_id)
            if occ is not None:
                occupancy[slab_id] = occ
        batch = JournalBatch(self.ops, occupancy)
        self.ops = []
        self.dirty = set()
        return batch


class Mirror:
    """One engine's state as the daemon sees it, rebuilt from journal batches."""

    def __init__(self) -> None:
        self.slabs: dict[int, Occupancy] = {}
        self.index: dict[Hashable, set[int]] = {}
        # A block holds at most one key (as in the pool): a STORE replaces the
        # block's old key, so the mirror never outgrows the blocks it covers.
        self.key_of: dict[int, Hashable] = {}

    def apply(self, batch: JournalBatch) -> None:
        for op in batch.ops:
            if op[0] == STORE:
                if op[2] in self.key_of:
                    self._unindex(self.key_of[op[2]], op[2])
                self.index.setdefault(op[1], set()).add(op[2])
                self.key_of[op[2]] = op[1]
            elif op[0] == REMOVE:
                if self.key_of.get(op[2]) == op[1]:
                    self._unindex(op[1], op[2])
            elif op[0] == ADD_SLAB:
                self.slabs[op[1]] = (0, 0, 0)
            elif op[0] == REMOVE_SLAB:
                self.slabs.pop(op[1], None)
            elif op[0] == CLEAR:
                self.index.clear()
                self.key_of.clear()
            else:
                raise ValueError(f"unknown journal op {op!r}")
        for slab_id, occ in batch.occupancy.items():
            if slab_id in self.slabs:
                live, cached, free = occ     # a copy, whatever sequence it came as
                self.slabs[slab_id] = (live, cached, free)

    def _unindex(self, key: Hashable, block: int) -> None:
        del self.key_of[block]
        holders = self.index.get(key)
        if holders is not None:
            holders.discard(block)
            if not holders:
                del self.index[key]

    def index_pairs(self) -> set[tuple[Hashable, int]]:
        return {(key, block_id) for key, ids in self.index.items() for block_id in ids}
