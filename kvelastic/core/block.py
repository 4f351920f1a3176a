"""The per-block record and the slab that groups blocks.

There is exactly one record per block. The pool reads and writes seven
attributes on it: ``block_id``, ``ref_cnt``, ``_block_hash``,
``_block_hash_num_tokens`` and the LRU's links ``prev_free_block`` and
``next_free_block`` carry the same names as vLLM's ``KVCacheBlock``, so the
vLLM adapter passes a subclass of its own block class (adding ``slab``) as
the pool's ``block_factory`` and no second copy of the state exists;
``slab`` points at the block's ``Slab``.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

# A block record as the pool handles it: a ``Block``, or the vLLM adapter's
# subclass of vLLM's ``KVCacheBlock``. They share the attribute names, not a
# base class, and vLLM types ``_block_hash`` more narrowly than the pool's
# keys (``Hashable``); a Protocol cannot cover both, because a mutable
# attribute must match exactly. So the pool handles records by duck typing.
BlockRecord = Any


class Block:
    """A KV block: refcount plus the prefix-cache key it holds, if any.

    State (derived, never stored): *live* when ``ref_cnt > 0``; *cached* when
    ``ref_cnt == 0`` and it has a key; *free* otherwise.
    """

    __slots__ = ("block_id", "ref_cnt", "_block_hash", "_block_hash_num_tokens", "is_null", "slab",
                 "prev_free_block", "next_free_block")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self._block_hash: Hashable | None = None
        # Tokens of the prefix the key covers (vLLM reads it to count the
        # tokens a request wrote to the cache); None without a key.
        self._block_hash_num_tokens: int | None = None
        self.is_null = False
        self.slab: Slab | None = None
        # The pool's LRU of cached blocks runs through the blocks themselves.
        self.prev_free_block: Block | None = None
        self.next_free_block: Block | None = None

    @property
    def block_hash(self) -> Hashable | None:
        return self._block_hash

    def __repr__(self) -> str:
        return f"Block(id={self.block_id}, ref={self.ref_cnt}, hash={self._block_hash!r})"


class Slab:
    """The blocks of one granted slab and their live/cached/free counts.

    Invariant: ``live + cached + len(free) == len(blocks)``, with ``live``
    derived from the other two (so the pool's hot path keeps two counts, not
    three); ``free`` holds exactly the blocks with ``ref_cnt == 0`` and no
    key (a LIFO stack, so a freed block is reused first while it is still
    warm in the cache), ``cached`` counts those with ``ref_cnt == 0`` and a key.
    """

    __slots__ = ("slab_id", "blocks", "free", "cached", "owner", "draining", "last_step")

    def __init__(self, slab_id: int, blocks: list[BlockRecord], owner: object | None) -> None:
        self.slab_id = slab_id
        self.blocks = blocks
        # The pool holding it (only ever compared by identity: the block
        # module stays below the pool's); None once given back (its blocks are stale).
        self.owner = owner
        for blk in blocks:
            blk.slab = self
        self.free: list[BlockRecord] = blocks[::-1]  # pop() hands out the lowest id first
        self.cached = 0
        # Promised back to the daemon once no block is live (``drain``): no
        # block is placed in it, none of its blocks stays cached, and its
        # free blocks count in none of the pool's figures of what it can hand out.
        self.draining = False
        # The step open (``Journal.begun``) when a block of it last stopped
        # being live: the last step that may still write its pages. Once that
        # step is done and no block is live, nothing touches them (``settled``).
        self.last_step = 0

    @property
    def live(self) -> int:
        """Blocks with ``ref_cnt > 0``."""
        return len(self.blocks) - self.cached - len(self.free)

    def occupancy(self) -> tuple[int, int, int]:
        free = len(self.free)
        return (len(self.blocks) - self.cached - free, self.cached, free)
