"""The journal: every change the daemon must mirror, in compact batches.

The pool appends ops as it works and ``take()`` hands out a ``JournalBatch``:
the ordered ops plus the final occupancy of every slab touched since the last
batch (occupancy is coalesced: only the latest counts matter). ``Mirror`` is
the other end: the daemon applies batches to it, and the tests check that
replaying every batch into an empty mirror yields the pool's own state.

Steps (the validity rule for a cache that outlives its engine). vLLM gives a
block its key when it schedules the step that writes the block's last
tokens, so a key says the KV *will* be complete once that step finished.
The journal marks steps: ``STEP n`` before the first key stored while step
``n`` is open, ``DONE n`` once steps up to ``n`` finished (they finish in
order). The mirror tags each stored key with the step it came in and
calls a block *valid* when that step is done: only valid blocks outlive a
dead engine. A pool that never marks steps (tests, simulators) has every
key valid at once.

Labels. A block's key may come with a label (``LABEL`` right after its
``STORE``): bytes the pool and the daemon never read, that travel with the
block wherever its key does (hand-on to another engine, kept cache). The vLLM
adapter puts there what a router needs to announce a block it adopts (its
token ids and parent): a key alone cannot be turned back into tokens.

A key dropped (``REMOVE``, ``CLEAR``) means its block may be written again:
``removed`` tells the client that this journal's ops must be in the
daemon's socket before the next step runs (``EngineClient.seal_step``, which
takes them without the occupancy), or a ``kill -9`` could leave the daemon
believing in a block the dying step was rewriting.

Demoted blocks (``DEMOTE``, ``PROMOTE``). The pool may tell the daemon ahead
of time that a cached block is next to be evicted: the mirror keeps its key
(the index stays the pool's) but no longer counts its KV as kept, so the
``REMOVE`` of its eviction needs no seal. A demoted block hit again is
promoted: its KV, unchanged, counts again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable
from typing import Final, Literal

# Op codes: the wire's own tags (``protocol/journal.py``'s ops are tagged
# arrays, ``["store", key, block]``), so that an op tuple with a bytes key is
# already its wire form and a journal is encoded as it stands, with no object
# per op (the client ships it while the scheduler works). Short strings are
# interned: ``op[0] == STORE`` is an identity check.
ADD_SLAB: Final = "add_slab"         # (ADD_SLAB, slab_id)
REMOVE_SLAB: Final = "remove_slab"   # (REMOVE_SLAB, slab_id)
STORE: Final = "store"               # (STORE, key, block_id)
REMOVE: Final = "remove"             # (REMOVE, key, block_id)
CLEAR: Final = "clear"               # (CLEAR,)  every key dropped (invalidate / reset)
STEP: Final = "step"                 # (STEP, n)  keys stored from here on belong to step n
DONE: Final = "done"                 # (DONE, n)  steps up to n finished: their blocks' KV is written
LABEL: Final = "label"               # (LABEL, block_id, label)  the block's label (after its STORE): opaque bytes
DEMOTE: Final = "demote"             # (DEMOTE, block_id)  next to be evicted: its KV is not kept, its REMOVE not sealed
PROMOTE: Final = "promote"           # (PROMOTE, block_id)  a demoted block hit again: its KV is kept again

# One op: a plain tuple whose code says its shape (for the type checker too:
# ``op[0] == STORE`` narrows an ``Op`` to a ``KeyOp``).
SlabOp = tuple[Literal["add_slab", "remove_slab"], int]   # ADD_SLAB, REMOVE_SLAB
KeyOp = tuple[Literal["store", "remove"], Hashable, int]  # STORE, REMOVE
ClearOp = tuple[Literal["clear"]]                         # CLEAR
StepOp = tuple[Literal["step", "done"], int]              # STEP, DONE
LabelOp = tuple[Literal["label"], int, bytes]             # LABEL
BlockOp = tuple[Literal["demote", "promote"], int]        # DEMOTE, PROMOTE
Op = SlabOp | KeyOp | ClearOp | StepOp | LabelOp | BlockOp

Occupancy = tuple[int, int, int]  # (live, cached, free) blocks


@dataclasses.dataclass
class JournalBatch:
    ops: list[Op]
    occupancy: dict[int, Occupancy]
    removed: bool = False        # a key was dropped: its block may be rewritten

    def __bool__(self) -> bool:
        return bool(self.ops or self.occupancy)


class Journal:
    __slots__ = ("ops", "dirty", "removed", "stored", "demoted", "begun", "done", "_marked", "_done_sent")

    def __init__(self) -> None:
        # Ops of this batch; None where a STORE was cancelled (``stored``).
        self.ops: list[Op | None] = []
        self.dirty: set[int] = set()
        # Set by whoever appends REMOVE or CLEAR: a key the daemon may know was
        # dropped. A STORE cancelled in its own batch is not one (the daemon
        # never heard of that key, and the block's earlier key, if any, left
        # by a REMOVE of its own): no seal for it.
        self.removed = False
        # block -> the index in ``ops`` of its STORE, for keys stored in this
        # batch. A key dropped in the batch that stored it never reaches the
        # daemon: its STORE becomes None and no REMOVE is appended (the
        # block had no key before its STORE, so the mirror ends the same; a
        # block that lived that briefly is no news to a router either). The
        # pool appends STORE ops with their place here, and looks its REMOVE
        # ops up; CLEAR forgets them (a REMOVE after it follows a new STORE).
        self.stored: dict[int, int] = {}
        # Cached blocks the daemon was told to forget (``DEMOTE``), until
        # their key leaves or they are promoted. Invariant: never a block in
        # ``stored`` (only blocks cached before this batch are demoted).
        # Read-only outside the journal; never rebound.
        self.demoted: set[int] = set()
        self.begun = 0               # the last step begun
        self.done = 0                # every step up to this one finished
        self._marked = 0             # the last STEP op written
        self._done_sent = 0          # the last DONE op written

    # Keys: where the cancellation rule is written. The pool's two per-key
    # loops (``SlabPool.cache``, ``SlabPool._reuse_cached``) inline these two
    # (a call per key was a large share of their cost): a change here goes there too.
    def store(self, key: Hashable, block_id: int) -> None:
        """``block_id`` now holds ``key`` (after ``mark_store``)."""
        self.stored[block_id] = len(self.ops)
        self.ops.append((STORE, key, block_id))

    def drop(self, key: Hashable, block_id: int) -> None:
        """``block_id`` no longer holds ``key``. Stored in this batch: the
        STORE is cancelled (``stored``), no news to seal. Demoted: the daemon
        keeps none of its KV already, so its REMOVE needs no seal. Else the
        REMOVE must be sealed before the block is written again."""
        at = self.stored.pop(block_id, None)
        if at is not None:
            self.ops[at] = None
            return
        self.ops.append((REMOVE, key, block_id))
        if self.demoted and block_id in self.demoted:
            self.demoted.remove(block_id)
        else:
            self.removed = True

    def clear(self) -> None:
        """Every key dropped: a REMOVE from now on follows a STORE after the CLEAR."""
        self.ops.append((CLEAR,))
        self.stored.clear()
        self.demoted.clear()
        self.removed = True

    def demote(self, block_id: int) -> bool:
        """Tell the daemon a cached block's KV need not be kept; False if it already was."""
        if block_id in self.demoted:
            return False
        self.ops.append((DEMOTE, block_id))
        self.demoted.add(block_id)
        return True

    def promote(self, block_id: int) -> None:
        """A demoted block was hit: its KV counts as kept again."""
        self.demoted.discard(block_id)
        self.ops.append((PROMOTE, block_id))

    # Steps: the pool calls ``mark_store`` before it appends STORE ops.
    def begin_step(self) -> int:
        """A model step is scheduled: the keys stored until the next one are its."""
        self.begun += 1
        return self.begun

    def end_step(self, step: int) -> None:
        """Step ``step`` (and every one before it) finished."""
        if step <= self.done:
            return
        self.done = min(step, self.begun)
        if self._marked > self._done_sent:   # keys of a step the daemon thinks unfinished
            self.ops.append((DONE, self.done))
            self._done_sent = self.done

    def mark_store(self) -> None:
        """Keys are about to be stored: tag them with the open step, if any."""
        if self.begun > self.done and self._marked != self.begun:
            self.ops.append((STEP, self.begun))
            self._marked = self.begun

    def resync(self) -> list[Op]:
        """Ops that give a fresh mirror (a restarted daemon) this journal's step
        state, to precede the whole index: what is done, and the open step
        that every resent key is then tagged with (a key stored in a step
        still running must not count as written)."""
        ops: list[Op] = []
        if self.done:
            ops.append((DONE, self.done))
            self._done_sent = self.done
        if self.begun > self.done:
            ops.append((STEP, self.begun))
            self._marked = self.begun
        return ops

    def take(self, occupancy_of: Callable[[int], Occupancy | None] | None) -> JournalBatch:
        """Hand out everything recorded so far; ``occupancy_of(slab)`` is None
        for a slab no longer held. Without ``occupancy_of``, the ops alone:
        the slabs touched stay dirty, and their occupancy goes with the next
        batch taken with it (a seal needs the ops now, not the counts)."""
        occupancy: dict[int, Occupancy] = {}
        if occupancy_of is not None:
            for slab_id in self.dirty:
                occ = occupancy_of(slab_id)
                if occ is not None:
                    occupancy[slab_id] = occ
            self.dirty = set()
        # Without the cancelled STOREs (an op tuple is never empty: only None goes).
        batch = JournalBatch(list(filter(None, self.ops)), occupancy, self.removed)
        self.ops = []
        self.removed = False
        self.stored = {}
        return batch


class Mirror:
    """One engine's state as the daemon sees it, rebuilt from journal batches."""

    def __init__(self) -> None:
        self.slabs: dict[int, Occupancy] = {}
        self.index: dict[Hashable, set[int]] = {}
        # A block holds at most one key (as in the pool): a STORE replaces the
        # block's old key, so the mirror never outgrows the blocks it covers.
        self.key_of: dict[int, Hashable] = {}
        self.label_of: dict[int, bytes] = {}  # block -> its key's label (only keyed blocks)
        self.stored_in: dict[int, int] = {}   # block -> the step its key came in
        self.demoted: set[int] = set()        # keyed blocks whose KV is not kept (DEMOTE)
        self.step = 0                          # the last STEP seen
        self.done = 0                          # the last DONE seen
        # With ``blocks_per_slab`` set (the daemon's mirrors), the keyed blocks
        # of each slab, so a slab's valid blocks cost what it holds, not what
        # its geometry allows.
        self.blocks_per_slab = 0
        self._in_slab: dict[int, dict[int, None]] = {}

    # Which slabs the engine holds is the daemon's word: besides ``apply``
    # (the journal's ADD_SLAB, REMOVE_SLAB and occupancy), only these change ``slabs``.
    def hold(self, slab_id: int, occupancy: Occupancy) -> None:
        """The daemon granted the slab (or, after its restart, adopted it)."""
        live, cached, free = occupancy
        self.slabs[slab_id] = (live, cached, free)

    def release(self, slab_id: int) -> None:
        """The slab left the engine (unmapping), or was never the engine's to name."""
        self.slabs.pop(slab_id, None)

    def apply(self, batch: JournalBatch) -> None:
        # The daemon applies every engine's journal: its two common ops first,
        # with the mirror's maps bound once (one op costs what its dict work does).
        index, key_of, label_of, stored_in = self.index, self.key_of, self.label_of, self.stored_in
        bps, in_slab = self.blocks_per_slab, self._in_slab
        for op in batch.ops:
            if op[0] == STORE:
                block = op[2]
                if block in key_of:
                    self._unindex(key_of[block], block)
                holders = index.get(op[1])
                if holders is None:
                    index[op[1]] = {block}
                else:
                    holders.add(block)
                key_of[block] = op[1]
                if label_of:
                    label_of.pop(block, None)
                stored_in[block] = self.step
                if bps:
                    slab = in_slab.get(block // bps)
                    if slab is None:
                        in_slab[block // bps] = {block: None}
                    else:
                        slab[block] = None
            elif op[0] == REMOVE:
                if key_of.get(op[2]) == op[1]:
                    self._unindex(op[1], op[2])
            elif op[0] == LABEL:
                if op[1] in key_of:
                    label_of[op[1]] = op[2]
            elif op[0] == DEMOTE:
                if op[1] in key_of:
                    self.demoted.add(op[1])
            elif op[0] == PROMOTE:
                self.demoted.discard(op[1])
            elif op[0] == STEP:
                self.step = max(self.step, op[1])
            elif op[0] == DONE:
                self.done = max(self.done, op[1])
            elif op[0] == ADD_SLAB:
                self.slabs[op[1]] = (0, 0, 0)
            elif op[0] == REMOVE_SLAB:
                self.slabs.pop(op[1], None)
            elif op[0] == CLEAR:
                index.clear()
                key_of.clear()
                label_of.clear()
                stored_in.clear()
                in_slab.clear()
                self.demoted.clear()
            else:
                raise ValueError(f"unknown journal op {op!r}")
        for slab_id, occ in batch.occupancy.items():
            if slab_id in self.slabs:
                live, cached, free = occ     # a copy, whatever sequence it came as
                self.slabs[slab_id] = (live, cached, free)

    def _unindex(self, key: Hashable, block: int) -> None:
        del self.key_of[block]
        self.label_of.pop(block, None)
        del self.stored_in[block]
        self.demoted.discard(block)
        if self.blocks_per_slab:
            slab = self._in_slab[block // self.blocks_per_slab]
            del slab[block]
            if not slab:
                del self._in_slab[block // self.blocks_per_slab]
        holders = self.index.get(key)
        if holders is not None:
            holders.discard(block)
            if not holders:
                del self.index[key]

    def index_pairs(self) -> set[tuple[Hashable, int]]:
        return {(key, block_id) for key, ids in self.index.items() for block_id in ids}

    def valid_in(self, slab_id: int, blocks_per_slab: int) -> list[tuple[int, Hashable]]:
        """One slab's valid blocks as ``(offset, key)``, whether or not the
        mirror still counts the slab as held (a departed engine's, unmapping)."""
        first = slab_id * blocks_per_slab
        out: list[tuple[int, Hashable]] = []
        keyed = self._in_slab.get(slab_id, {}) if self.blocks_per_slab == blocks_per_slab else \
            range(first, first + blocks_per_slab)
        for block in keyed:
            key = self.key_of.get(block)
            if key is not None and self.stored_in[block] <= self.done and block not in self.demoted:
                out.append((block - first, key))
        return out

    def valid_blocks(self, blocks_per_slab: int) -> dict[int, list[tuple[int, Hashable]]]:
        """Per held slab, its blocks whose KV is known written (key stored in a
        finished step), as ``(offset in the slab, key)`` in the order they were
        stored: what may outlive the engine (demoted blocks' never does)."""
        out: dict[int, list[tuple[int, Hashable]]] = {}
        done, stored_in, slabs, demoted = self.done, self.stored_in, self.slabs, self.demoted
        for block, key in self.key_of.items():
            slab_id = block // blocks_per_slab
            if stored_in[block] <= done and slab_id in slabs and block not in demoted:
                out.setdefault(slab_id, []).append((block % blocks_per_slab, key))
        return out
