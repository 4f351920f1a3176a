"""Demand: vLLM's capacity checks, heard by the elastic block pool only where they can need a grow.

``KVCacheManager.allocate_slots`` asks the coordinator for a request's need
and compares it, with vLLM's watermark and reserved blocks, against
``block_pool.get_num_free_blocks()``: once per request per step. The pool
must answer a promise ``get_new_blocks`` keeps at once, so before it answers
it asks the daemon for whatever free blocks the call is missing (a *demand*
grow). It can only do so if it knows the need.

A running request needs at most one step's tokens of blocks per call
(``ElasticBlockPool.call_blocks``), which the reserve normally holds; the
pool serves those calls on one comparison, and grows to ``call_blocks`` first
when it is short of them. Only an admission may need more (a whole prompt).
vLLM looks each waiting request up in the prefix cache just before it asks
for its slots (``get_computed_blocks``), and the waiting requests come after
the running ones in a step: so that lookup puts two hooks on this manager
alone, which hand each need and margin to the pool for the rest of the step
(``hear``: the manager and its coordinator take a hearing subclass), and the
end of ``schedule()`` takes them off (``stop_hearing``).
Hooks on every call would cost a fifth of vLLM's own ``schedule()`` at a
batch of 256 (``kvelastic bench vllm``: 1.27x stock with them, see
docs/benchmarks.md)."""

from __future__ import annotations

from typing import Any

# vLLM class -> its hearing subclass (made once per class).
_HEARING: dict[type, type] = {}


def _hearing_manager(cls: type) -> type:
    allocate_slots = cls.allocate_slots

    def allocate_slots_heard(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        # vLLM compares the need plus its watermark and reserved blocks with the free blocks.
        pool = self.block_pool
        pool.margin = self.watermark_blocks + kwargs.get("reserved_blocks", 0)
        try:
            return allocate_slots(self, request, *args, **kwargs)
        finally:
            pool.margin = 0

    return _subclass(cls, allocate_slots=allocate_slots_heard)


def _hearing_coordinator(cls: type) -> type:
    get_num_blocks_to_allocate = cls.get_num_blocks_to_allocate

    def get_num_blocks_to_allocate_heard(self: Any, *args: Any, **kwargs: Any) -> int:
        need: int = get_num_blocks_to_allocate(self, *args, **kwargs)
        self.block_pool.expect(need)
        return need

    return _subclass(cls, get_num_blocks_to_allocate=get_num_blocks_to_allocate_heard)


def _subclass(cls: type, **methods: Any) -> type:
    # No slots and no dict of its own: an instance's class can be swapped both ways.
    return type(cls.__name__, (cls,), {"__slots__": (), "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__, **methods})


def _hear_with(obj: Any, make: Any) -> None:
    cls = type(obj)
    if cls in _HEARING.values():   # hearing already
        return
    sub = _HEARING.get(cls)
    if sub is None:
        sub = _HEARING[cls] = make(cls)
    obj.__class__ = sub


def hear(manager: Any, pool: Any) -> None:
    """Until ``stop_hearing``: ``manager``'s capacity checks tell ``pool`` the
    need and margin first. The manager and its coordinator change class for
    the rest of the step (a subclass whose two methods hear, then call
    vLLM's): an instance attribute named like a method would do the same
    once, but leave the name in the instances' shared keys for good, and
    every later call of that method on any manager would miss CPython's
    specialized lookup (docs/benchmarks.md)."""
    _hear_with(manager, _hearing_manager)
    _hear_with(manager.coordinator, _hearing_coordinator)
    pool.hearing = manager


def stop_hearing(pool: Any) -> None:
    """Take the hooks ``hear`` put on, if any (the end of a step): vLLM's classes back."""
    manager, pool.hearing = pool.hearing, None
    if manager is not None:
        for obj in (manager, manager.coordinator):
            if type(obj) in _HEARING.values():
                obj.__class__ = type(obj).__bases__[0]


def wrap_get_computed_blocks(original):
    """The scheduler looks a waiting request up before it asks for the
    request's slots: from here to the end of the step the pool hears each
    need (an engine at its cap, or just refused by the daemon, does not grow: no hooks)."""
    from kvelastic_vllm.block_pool import ElasticBlockPool

    def get_computed_blocks(self, *args, **kwargs):
        pool = self.block_pool
        if type(pool) is ElasticBlockPool and pool.hearing is None and pool.may_grow:
            hear(self, pool)
        return original(self, *args, **kwargs)

    return get_computed_blocks
