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
(``hear``), and the end of ``schedule()`` takes them off (``stop_hearing``).
Hooks on every call would cost a large share of vLLM's own ``schedule()`` at
a large batch (``kvelastic bench vllm``, docs/benchmarks.md).

What crosses vLLM's calls is one ``Demand`` per pool: the hooks write it
(the margin, then the need), the pool's grow takes it (``take``), and it
says whose checks are heard until the step ends."""

from __future__ import annotations

from types import MethodType
from typing import Any

from kvelastic_vllm.patching import keep_face


class Demand:
    """An engine's demand between vLLM's capacity check and the grow it may
    need: one per ``ElasticBlockPool``, its one owner. The hooks write it,
    the pool's ``_demand`` takes it."""

    __slots__ = ("need", "margin", "manager", "heard", "asked", "refused")

    def __init__(self) -> None:
        # The next capacity check's need, vLLM's margin included, until the grow takes it.
        self.need: int | None = None
        # vLLM's watermark and reserved blocks for the ``allocate_slots`` call in progress.
        self.margin = 0
        # The KVCacheManager whose checks are heard (its hooks on) until the step ends.
        self.manager: Any = None
        # Capacity checks heard; grows asked of the daemon, and those it refused.
        self.heard = self.asked = self.refused = 0

    def expect(self, num_blocks: int) -> None:
        """vLLM is about to test whether ``num_blocks`` (plus the margin) fit."""
        self.need = num_blocks + self.margin
        self.heard += 1

    def take(self, otherwise: int) -> int:
        """The need heard, or ``otherwise`` if none was; heard once only."""
        need, self.need = self.need, None
        return otherwise if need is None else need


def hear(manager: Any, pool: Any) -> None:
    """Until ``stop_hearing``: ``manager``'s capacity checks tell ``pool`` the need and margin first."""
    coordinator = manager.coordinator
    allocate_slots = type(manager).allocate_slots
    get_num_blocks_to_allocate = type(coordinator).get_num_blocks_to_allocate
    demand: Demand = pool.demand

    @keep_face(allocate_slots)
    def allocate_slots_heard(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        # vLLM compares the need plus its watermark and reserved blocks with the free blocks.
        demand.margin = self.watermark_blocks + kwargs.get("reserved_blocks", 0)
        try:
            return allocate_slots(self, request, *args, **kwargs)
        finally:
            demand.margin = 0

    @keep_face(get_num_blocks_to_allocate)
    def get_num_blocks_to_allocate_heard(self: Any, *args: Any, **kwargs: Any) -> int:
        need: int = get_num_blocks_to_allocate(self, *args, **kwargs)
        pool.expect(need)
        return need

    # Instance attributes: this manager alone, and the class stays stock's.
    manager.allocate_slots = MethodType(allocate_slots_heard, manager)
    coordinator.get_num_blocks_to_allocate = MethodType(get_num_blocks_to_allocate_heard, coordinator)
    demand.manager = manager


def stop_hearing(demand: Demand) -> None:
    """Take the hooks ``hear`` put on, if any (the end of a step)."""
    manager, demand.manager = demand.manager, None
    if manager is not None:
        del manager.allocate_slots
        del manager.coordinator.get_num_blocks_to_allocate


def wrap_get_computed_blocks(original, elastic: type):
    """The scheduler looks a waiting request up before it asks for the
    request's slots: from here to the end of the step the pool hears each
    need (an engine at its cap, or just refused by the daemon, does not grow: no hooks).
    ``elastic``: the elastic pool's class (``block_pool.py``, which imports this module)."""

    @keep_face(original)
    def get_computed_blocks(self, *args, **kwargs):
        pool = self.block_pool
        if type(pool) is elastic and pool.demand.manager is None and pool.may_grow:
            hear(self, pool)
        return original(self, *args, **kwargs)

    return get_computed_blocks
