"""An engine's journal: what its pool did to its keys and slabs, shipped to
the daemon's mirror (``core/journal.py``). A ``Journal`` is a notification:
the daemon answers it only with an ``Error`` (or with ``Ok`` when it asks
for one, ``sync``).

Its ops travel as tagged arrays (``["store", key, block]``), so that decoding
checks every op's shape and types and a bad journal is refused whole before
anything is applied. ``core()`` gives the pool's own tuple.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any

import msgspec

from kvelastic.core.journal import (
    ADD_SLAB,
    CLEAR,
    DEMOTE,
    DONE,
    LABEL,
    PROMOTE,
    REMOVE,
    REMOVE_SLAB,
    STEP,
    STORE,
    BlockOp,
    ClearOp,
    KeyOp,
    LabelOp,
    Op,
    SlabOp,
    StepOp,
)
from kvelastic.names import Name
from kvelastic.protocol.base import Key, Label, Msg

BlockId = Annotated[int, msgspec.Meta(ge=0)]
Stats = Annotated[dict[Annotated[str, msgspec.Meta(max_length=64)], int], msgspec.Meta(max_length=64)]


class StoreKey(msgspec.Struct, tag="store", array_like=True, frozen=True):
    key: Key
    block: BlockId

    def core(self) -> KeyOp:
        return (STORE, self.key, self.block)


class RemoveKey(msgspec.Struct, tag="remove", array_like=True, frozen=True):
    key: Key
    block: BlockId

    def core(self) -> KeyOp:
        return (REMOVE, self.key, self.block)


class AddSlab(msgspec.Struct, tag="add_slab", array_like=True, frozen=True):
    slab: BlockId

    def core(self) -> SlabOp:
        return (ADD_SLAB, self.slab)


class RemoveSlab(msgspec.Struct, tag="remove_slab", array_like=True, frozen=True):
    slab: BlockId

    def core(self) -> SlabOp:
        return (REMOVE_SLAB, self.slab)


class ClearKeys(msgspec.Struct, tag="clear", array_like=True, frozen=True):
    def core(self) -> ClearOp:
        return (CLEAR,)


StepNumber = Annotated[int, msgspec.Meta(ge=1)]


class StepBegun(msgspec.Struct, tag="step", array_like=True, frozen=True):
    """Keys stored from here on belong to this model step (written once it is done)."""
    step: StepNumber

    def core(self) -> StepOp:
        return (STEP, self.step)


class StepDone(msgspec.Struct, tag="done", array_like=True, frozen=True):
    """Every step up to this one finished: the blocks keyed in them hold their KV."""
    step: StepNumber

    def core(self) -> StepOp:
        return (DONE, self.step)


class LabelBlock(msgspec.Struct, tag="label", array_like=True, frozen=True):
    """The label of the key just stored in this block (travels with the key)."""
    block: BlockId
    label: Label

    def core(self) -> LabelOp:
        return (LABEL, self.block, self.label)


class DemoteBlock(msgspec.Struct, tag="demote", array_like=True, frozen=True):
    """The block is next to be evicted: its key stays, its KV is not kept, and
    its ``RemoveKey`` comes unsealed (``core/journal.py``)."""
    block: BlockId

    def core(self) -> BlockOp:
        return (DEMOTE, self.block)


class PromoteBlock(msgspec.Struct, tag="promote", array_like=True, frozen=True):
    """A demoted block was hit again: its KV, unchanged, may be kept again."""
    block: BlockId

    def core(self) -> BlockOp:
        return (PROMOTE, self.block)


JournalOp = StoreKey | RemoveKey | AddSlab | RemoveSlab | ClearKeys | StepBegun | StepDone | LabelBlock | \
    DemoteBlock | PromoteBlock
# Each class takes the op's fields after the code, in order.
_WIRE_OP: dict[str, Any] = {   # code -> its JournalOp class
    STORE: StoreKey, REMOVE: RemoveKey, ADD_SLAB: AddSlab, REMOVE_SLAB: RemoveSlab, CLEAR: ClearKeys,
    STEP: StepBegun, DONE: StepDone, LABEL: LabelBlock, DEMOTE: DemoteBlock, PROMOTE: PromoteBlock}


def journal_ops(ops: Sequence[Op]) -> list[JournalOp]:
    """The core pool's journal tuples as wire ops (keys must already be bytes)."""
    return [_WIRE_OP[op[0]](*op[1:]) for op in ops]


# The core pool's op codes are these wire ops' tags: an op tuple with a bytes
# key encodes to the very bytes of its wire op (``JournalFrame``).
assert all(cls.__struct_config__.tag == code for code, cls in _WIRE_OP.items())


class Journal(Msg):
    engine_id: Name
    ops: Annotated[list[JournalOp], msgspec.Meta(max_length=20_000)]   # the client sends larger journals in parts
    occupancy: dict[int, tuple[int, int, int]]
    stats: Stats = {}            # cumulative pool counters (lookups, hits, evictions_*)
    # Answer with Ok once applied: the engine is about to run a step that may
    # rewrite blocks whose keys this journal drops (see ``EngineClient.seal_step``).
    sync: bool = False
    # The last ``TierCopied`` ticket the engine heard of when it took this
    # journal: every drop of a block made before it heard is in this journal
    # or an earlier one (docs/tier.md, "Source B").
    tier_ack: int = 0
    # The last ``ClearIndex.scope`` the engine applied when it took this journal.
    scope: int = 0


class JournalFrame(Msg, tag="Journal"):
    """A ``Journal`` as an engine sends it, the same bytes on the wire: its
    ops are the core pool's tuples as they stand (keys already bytes), which
    encode as the tagged arrays ``Journal`` decodes, so shipping a journal
    builds no object per op. Send-only: the daemon decodes a ``Journal``."""
    engine_id: str
    ops: list[tuple[Any, ...]]
    occupancy: dict[int, tuple[int, int, int]]
    stats: dict[str, int] = {}
    sync: bool = False
    tier_ack: int = 0
    scope: int = 0
