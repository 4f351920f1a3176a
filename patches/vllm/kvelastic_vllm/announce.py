"""Blocks an engine adopts (a slab handed on by a replica, kept cache after a
restart), announced to KV-aware routers as vLLM's own ``BlockStored`` events.

A router files a block under its parent, per engine: Dynamo's indexer drops a
stored block whose parent that engine does not hold, and every block below it.
vLLM itself never stores such a block (its parent was hit or computed in the
same request), but an engine can adopt one: a hand-on takes a slab, not a
chain, so a chain's head may stay with the giver while its tail moves. Such a
block cannot be hit either (vLLM's prefix lookup stops at the first missing
block) until the engine computes its parent again.

So an adopted block is announced once it is *reachable*: it starts a chain,
or its parent is held by this engine (published stored and not removed since).
The rest wait for their parent; a waiting block removed or cleared is never
announced (and its removal never published). Parents are announced before
their children.

Invariant: every block the queue reports stored (and not removed since) is
in ``held``; ``held`` is updated only by reading the queue, in order, so it is
what a router that applied every published batch believes.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable
from typing import Any

import msgspec
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

log = logging.getLogger("kvelastic.vllm")

BlockId = tuple[Hashable, Any]     # (vLLM's published hash, KV cache group)


class Announcer:
    def __init__(self, medium: str) -> None:
        self.medium = medium
        self.held: set[BlockId] = set()
        # parent id (None: a chain's first block) -> adopted events waiting for it, oldest first
        self._waiting: dict[BlockId | None, list[BlockStored]] = {}
        self._parent_of: dict[BlockId, BlockId | None] = {}   # each waiting block's parent
        self._read: list | None = None    # the queue list read up to ``_read_to``
        self._read_to = 0

    @staticmethod
    def _id(event: BlockStored) -> BlockId:
        return event.block_hashes[0], event.group_idx

    def adopted(self, own_hash: Hashable, label: bytes) -> None:
        """A block adopted under the key whose published hash is
        ``own_hash``, with its label (its own one-block ``BlockStored``)."""
        try:
            event = msgspec.msgpack.decode(label, type=BlockStored)
        except (msgspec.DecodeError, msgspec.ValidationError):
            log.warning("kvelastic: an adopted block's label does not decode; not announced")
            return
        if event.block_hashes != [own_hash]:   # a label names its own key, or it is not this block's
            log.warning("kvelastic: an adopted block's label names another block; not announced")
            return
        event = msgspec.structs.replace(event, medium=self.medium)
        block = self._id(event)
        if block in self._parent_of:
            return
        parent = None if event.parent_block_hash is None else (event.parent_block_hash, event.group_idx)
        self._parent_of[block] = parent
        self._waiting.setdefault(parent, []).append(event)

    def withdraw(self, block: BlockId) -> bool:
        """``block``'s key leaves the engine (``flush`` just ran): forget it if
        it waited for its parent. True if no router was told of it (neither
        announced nor stored by vLLM itself, which computed it again)."""
        parent = self._parent_of.pop(block, _ABSENT)
        if parent is not _ABSENT:
            siblings = self._waiting[parent]
            siblings[:] = [e for e in siblings if self._id(e) != block]
            if not siblings:
                del self._waiting[parent]
        return parent is not _ABSENT and block not in self.held

    def clear(self) -> None:
        """The engine's index is cleared: nothing adopted so far is announced."""
        self._waiting.clear()
        self._parent_of.clear()

    def flush(self, queue: list) -> None:
        """Read what ``queue`` gained since the last call, then append the
        adopted blocks that became reachable, each parent before its children.
        The block pool takes a queue by replacing it with a new list, never
        by emptying it in place: a new list is read from its start."""
        self._observe(queue)
        ready = [None, *(p for p in self._waiting if p is not None and p in self.held)]
        while ready:
            for event in self._waiting.pop(ready.pop(), ()):
                block = self._id(event)
                del self._parent_of[block]
                if block not in self.held:   # else vLLM stored it itself meanwhile
                    queue.append(event)
                    self.held.add(block)
                ready.append(block)
        self._read, self._read_to = queue, len(queue)

    def _observe(self, queue: list) -> None:
        start = self._read_to if queue is self._read else 0
        held = self.held
        for event in queue[start:]:
            kind = type(event)
            if kind is BlockStored:
                held.update((h, event.group_idx) for h in event.block_hashes)
            elif kind is BlockRemoved:
                held.difference_update((h, event.group_idx) for h in event.block_hashes)
            elif kind is AllBlocksCleared:
                held.clear()


_ABSENT: Any = object()
