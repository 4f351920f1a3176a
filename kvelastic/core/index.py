"""Hash index: prefix-cache key -> the block(s) holding that content.

One key may map to several blocks (two requests filled identical blocks before
either was cached; vLLM does not de-duplicate, so block tables stay
append-only). Like vLLM's ``BlockHashToBlockMap`` the common single-block case
is stored bare to keep the hot path and GC cheap.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator

from kvelastic.core.block import BlockRecord


class HashIndex:
    __slots__ = ("entries",)

    def __init__(self) -> None:
        # key -> its block, or {block_id: block} when several blocks hold the key.
        # The pool's per-block loops (``SlabPool.cache``, ``_reuse_cached``)
        # handle a bare entry here themselves and call ``insert``/``remove``
        # only for the shared case, and the vLLM adapter's lookup inlines
        # ``get_one`` (``PoolBooks.index_entries``): a method call per key
        # was a large share of their cost.
        self.entries: dict[Hashable, BlockRecord] = {}

    def get_one(self, key: Hashable) -> BlockRecord | None:
        entry = self.entries.get(key)
        if entry is None or type(entry) is not dict:
            return entry
        return next(iter(entry.values()))

    def insert(self, key: Hashable, block: BlockRecord) -> None:
        entry = self.entries.get(key)
        if entry is None:
            self.entries[key] = block
        elif type(entry) is dict:
            entry[block.block_id] = block
        else:
            self.entries[key] = {entry.block_id: entry, block.block_id: block}

    def remove(self, key: Hashable, block: BlockRecord) -> None:
        entry = self.entries[key]
        if type(entry) is dict:
            del entry[block.block_id]
            if len(entry) == 1:
                self.entries[key] = next(iter(entry.values()))
        else:
            del self.entries[key]

    def clear(self) -> None:
        self.entries.clear()

    def __len__(self) -> int:
        return len(self.entries)

    def items(self) -> Iterator[tuple[Hashable, int]]:
        """(key, block_id) for every entry; for checks and snapshots only."""
        for key, entry in self.entries.items():
            if type(entry) is dict:
                for block_id in entry:
                    yield key, block_id
            else:
                yield key, entry.block_id
