"""The KV events of one elastic block pool, beyond those vLLM builds itself.

vLLM queues an event when it stores a block and publishes the queue at the
end of each step. kvelastic moves blocks that vLLM never sees move: the
daemon drops keys between steps (a reclaim, an expiry, an invalidation) and
a grant adopts blocks of another engine (hand-on, kept cache after a
restart). ``PoolEvents`` is the core pool's listener for those moves: it
queues a ``BlockRemoved`` per key the core drops, an ``AllBlocksCleared``
per clear, and announces adopted blocks once reachable (``announce.py``);
and it publishes what a move queued between steps on the client's tick, so
an idle engine leaves no router believing in blocks it no longer has.

The queue is vLLM's ``kv_event_queue`` (the pool's attribute of that name
is this one's): the scheduler takes it whole at a step's end, replacing the
list, never emptying it in place (the announcer reads it by identity).
Everything here runs with the client's lock held.
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from typing import Any, cast

from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, KVCacheEvent, KVEventBatch
from vllm.v1.core.kv_cache_utils import BlockHashWithGroupId, get_block_hash, get_group_id, maybe_convert_block_hash

from kvelastic_vllm.announce import Announcer


class PoolEvents:
    def __init__(self, medium: str) -> None:
        self.medium = medium
        self.queue: list[KVCacheEvent] = []
        self.publisher: Any = None   # the scheduler's KV event publisher (``engine.wrap_scheduler_init``)
        self.announcer = Announcer(medium)
        self.quiet = False           # ``move_block_hashes`` in progress: its removals are no news

    def take(self) -> list[KVCacheEvent]:
        """The queue so far, adopted blocks that became reachable last."""
        self.announcer.flush(self.queue)
        events, self.queue = self.queue, []
        return events

    def publish_queued(self) -> None:
        """On the I/O thread's tick: publish what was queued since the last
        step. The lock orders this with the scheduler's own take-and-publish
        (``engine.wrap_update_from_output`` holds it)."""
        self.announcer.flush(self.queue)
        if self.publisher is not None and self.queue:
            events, self.queue = self.queue, []
            self.publisher.publish(KVEventBatch(ts=time.time(), events=events))  # type: ignore[arg-type]

    # ------------------------------------------------- core pool callbacks
    def adopted(self, entries: list[tuple[Hashable, bytes]]) -> None:
        """Announced when the queue is next taken or a key leaves, once
        reachable: a grant adopts slab by slab, and a block's parent may come
        in a later slab."""
        for key, label in entries:
            self.announcer.adopted(maybe_convert_block_hash(get_block_hash(cast(BlockHashWithGroupId, key))), label)

    def key_removed(self, key: Hashable) -> None:
        if self.quiet:
            return   # an entry moving to another block (``move_block_hashes``): still live
        self.announcer.flush(self.queue)   # a block announced after its removal would live on in routers
        # The core pool is generic in its keys; this one's are what cache_full_blocks stored.
        hashed = cast(BlockHashWithGroupId, key)
        published, group = maybe_convert_block_hash(get_block_hash(hashed)), get_group_id(hashed)
        if self.announcer.withdraw((published, group)):
            return   # adopted, never announced: no router knows it
        self.queue.append(BlockRemoved(block_hashes=[published], medium=self.medium, group_idx=group))

    def cleared(self) -> None:
        self.announcer.clear()
        self.queue.append(AllBlocksCleared())
