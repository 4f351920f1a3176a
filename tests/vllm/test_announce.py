"""The announcer publishes an adopted block once a router can file it: a
router that applies the events in order (as Dynamo's indexer does, per
engine) never meets a stored block whose parent the engine does not hold,
and ends up knowing every block vLLM could hit (those reachable from a
chain's first block) and no block the engine does not cache. No peer is faked: the announcer is pure logic over
vLLM's own event types."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("vllm")

from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

from kvelastic_vllm.announce import Announcer


def label(h: int, parent: int | None) -> bytes:
    return msgspec.msgpack.encode(BlockStored(block_hashes=[h], parent_block_hash=parent, token_ids=[h] * 4,
                                              block_size=4, lora_id=None, medium="GPU", lora_name=None, group_idx=0))


class Router:
    """A per-engine radix index: a stored block needs its parent held."""

    def __init__(self) -> None:
        self.held: set[int] = set()
        self.orphaned: list[int] = []

    def apply(self, events: list) -> None:
        for ev in events:
            if isinstance(ev, BlockStored):
                parent = ev.parent_block_hash
                for h in ev.block_hashes:
                    if parent is not None and parent not in self.held:
                        self.orphaned.append(h)
                        break
                    self.held.add(h)
                    parent = h
            elif isinstance(ev, BlockRemoved):
                self.held.difference_update(ev.block_hashes)
            elif isinstance(ev, AllBlocksCleared):
                self.held.clear()


def test_a_chain_tail_waits_for_its_head_and_a_withdrawn_block_is_never_announced():
    ann, queue = Announcer("CPU"), []
    for h, parent in ((12, 11), (13, 12), (21, None), (22, 21)):   # 11 stayed with the giver
        ann.adopted(h, label(h, parent))
    ann.adopted(99, label(98, None))                                 # a label of another block: refused
    ann.flush(queue)
    assert [e.block_hashes[0] for e in queue] == [21, 22] and all(e.medium == "CPU" for e in queue)
    assert ann.withdraw((13, 0)) and not ann.withdraw((21, 0))       # 13 waited: its removal is not published
    # The engine computes the head again.
    queue.append(BlockStored(block_hashes=[11], parent_block_hash=None, token_ids=[1] * 4, block_size=4,
                             lora_id=None, medium="CPU", lora_name=None, group_idx=0))
    ann.flush(queue)
    assert [e.block_hashes[0] for e in queue] == [21, 22, 11, 12]
    ann.adopted(31, label(31, None))
    ann.clear()
    queue.append(AllBlocksCleared())
    ann.flush(queue)
    assert queue[-1] == AllBlocksCleared() and not ann.held


@st.composite
def scripts(draw):
    chains = draw(st.lists(st.integers(1, 6), min_size=1, max_size=5))
    parent = {}
    for c, length in enumerate(chains):
        for i in range(length):
            parent[100 * c + i] = 100 * c + i - 1 if i else None
    ops = draw(st.lists(st.tuples(st.sampled_from(["adopt", "store", "remove", "flush", "clear"]),
                                  st.sampled_from(sorted(parent))), max_size=40))
    return parent, ops


@settings(max_examples=300, deadline=None)
@given(scripts())
def test_a_router_that_applies_every_event_holds_what_vllm_could_hit(script):
    parent, ops = script
    ann, router = Announcer("CPU"), Router()
    queue: list = []
    cached: set[int] = set()   # the engine's cached keys (its core pool)

    def publish() -> None:
        nonlocal queue
        ann.flush(queue)
        router.apply(queue)
        queue = []          # as the block pool takes it: a new list

    def reachable(h: int | None) -> bool:
        while h is not None and h in cached:
            h = parent[h]
        return h is None

    for op, h in ops:
        if op == "adopt" and h not in cached:
            cached.add(h)
            ann.adopted(h, label(h, parent[h]))
        elif op == "store" and h not in cached and (parent[h] is None or reachable(parent[h])):
            # vLLM stores a block it computed; its prefix was hit or computed (and cached) first.
            ann.flush(queue)
            cached.add(h)
            queue.append(BlockStored(block_hashes=[h], parent_block_hash=parent[h], token_ids=[h] * 4,
                                     block_size=4, lora_id=None, medium="CPU", lora_name=None, group_idx=0))
        elif op == "remove" and h in cached:
            ann.flush(queue)              # as ``_key_removed``: announce first, then remove
            cached.discard(h)
            if not ann.withdraw((h, 0)):
                queue.append(BlockRemoved(block_hashes=[h], medium="CPU", group_idx=0))
        elif op == "flush":
            publish()
        elif op == "clear":
            cached.clear()
            ann.clear()
            queue.append(AllBlocksCleared())
    publish()
    assert not router.orphaned
    # Every block vLLM could hit is known, and nothing the engine does not
    # cache (a block whose parent left later stays known, as in stock vLLM).
    assert {h for h in cached if reachable(h)} <= router.held <= cached
