"""The tier's blocks as routers hear of them, in process (``tiering.py``,
"Routers see it"): a committed block is published ``BlockStored`` from its
label with the medium ``STORAGE``, parents first, under ``kv@@NAMESPACE``;
a block that leaves the tier (evicted by value, dropped on a failed check,
invalidated) is published ``BlockRemoved`` once its file goes (at once, even
while a load holds an invalidated or dropped one: it is never served); a block
with no usable label, or whose write failed, is never published."""

from __future__ import annotations

import hashlib

import msgspec
import pytest

from kvelastic import protocol as p
from kvelastic.daemon import effects as fx
from kvelastic.daemon.books import Books
from kvelastic.daemon.events import parents_first, tier_stored
from kvelastic.daemon.orphans import OrphanSlab
from kvelastic.daemon.requests import Timing
from kvelastic.daemon.state import EngineRecord, shape_of
from kvelastic.daemon.tiering import Tiering
from kvelastic.kv_events import BlockRemoved, BlockStored
from kvelastic.tier.index import TierIndex

PAGE = 2 << 20
BPS = 128
BLOCK = 2 * PAGE // BPS


def record(engine_id: str = "e", namespace: str = "ns") -> EngineRecord:
    return EngineRecord(engine_id=engine_id, namespace=namespace, pid=1, page_size=PAGE, pages_per_worker=2,
                        num_workers=1, blocks_per_slab=BPS, block_bytes=BLOCK, block_tokens=4,
                        key_group_suffix=True, min_bytes=0, max_bytes=0, max_slabs=4, device="cpu",
                        pages_per_region=1, identity=engine_id.encode())


def key(name: str) -> bytes:
    return hashlib.sha256(name.encode()).digest() + bytes(4)


def low64(k: bytes) -> int:
    return int.from_bytes(k[:-4], "big") & ((1 << 64) - 1)


def label(keys: list[bytes], i: int, as_bytes: bool = False) -> bytes:
    h = (lambda k: k[:-4]) if as_bytes else low64
    return msgspec.msgpack.encode(BlockStored(
        block_hashes=[h(keys[i])], parent_block_hash=h(keys[i - 1]) if i else None,
        token_ids=list(range(4 * i, 4 * i + 4)), block_size=4, lora_id=None, medium="GPU", lora_name=None,
        group_idx=0))


def books_with(budget: int = 1 << 30, engines: tuple[EngineRecord, ...] = ()) -> Books:
    books = Books({"cpu": 64}, PAGE, "host", Timing(), events=True)
    books.tier = TierIndex(budget)
    for serial, e in enumerate(engines, 1):
        e.serial = serial
        books.engines[e.engine_id] = e
    return books


def demote(books: Books, tiering: Tiering, namespace: str, cached: list[p.CachedBlock],
           fail: set[int] = frozenset()) -> list[fx.Effect]:   # type: ignore[assignment]
    """Kept blocks demoted as the loop would; the effects that follow, the files' deletion performed."""
    tiering.demote([OrphanSlab(namespace, shape_of(record()), [10, 11], ["cpu", "cpu"], tuple(cached), 0.0, "x")])
    first = books.take()
    blocks = [b for e in first if isinstance(e, fx.DemoteBlocks) for b in e.blocks]
    tiering.written([b.slot for i, b in enumerate(blocks) if i not in fail],
                    [(b.slot, "io") for i, b in enumerate(blocks) if i in fail])
    return performed(books, tiering, first)


def performed(books: Books, tiering: Tiering, first: list[fx.Effect] = []) -> list[fx.Effect]:  # noqa: B006
    out: list[fx.Effect] = []
    for e in [*first, *books.take()]:
        out.append(e)
        if isinstance(e, fx.DeleteTierBlocks):
            out.extend(tiering.deleted(e.slots))
    return out


def published(effects: list[fx.Effect], tier: bool = True) -> list:
    """The tier stream's events (``tier``), or the node stream's."""
    assert all(e.topic.startswith(b"kv@@") for e in effects if isinstance(e, fx.Publish))
    return [(e.topic, ev) for e in effects if isinstance(e, fx.Publish) and e.tier == tier for ev in e.events]


def test_a_label_becomes_the_blocks_storage_event_only_if_it_names_the_block():
    keys = [key("a"), key("b")]
    event = tier_stored(keys[1], label(keys, 1))
    assert event is not None and event.medium == "STORAGE" and event.block_hashes == [low64(keys[1])]
    assert event.parent_block_hash == low64(keys[0]) and event.token_ids == [4, 5, 6, 7]
    assert tier_stored(keys[1], label(keys, 1, as_bytes=True)) is not None     # hashes published as bytes
    assert tier_stored(keys[0], label(keys, 1)) is None                         # another block's label
    assert tier_stored(keys[1], b"") is None and tier_stored(keys[1], b"\xc1junk") is None
    tokenless = msgspec.msgpack.encode(BlockStored(block_hashes=[low64(keys[0])], parent_block_hash=None,
                                                   token_ids=[], block_size=4, lora_id=None, medium=None,
                                                   lora_name=None))
    assert tier_stored(keys[0], tokenless) is None                              # a router could not match it


def test_parents_come_first():
    keys = [key(str(i)) for i in range(5)]
    events = [tier_stored(k, label(keys, i)) for i, k in enumerate(keys)]
    assert all(e is not None for e in events)
    shuffled = [events[3], events[4], events[0], events[2], events[1]]
    assert parents_first(shuffled) == events                                    # type: ignore[arg-type]


def test_committed_blocks_are_published_stored_parents_first_and_nothing_else():
    books = books_with()
    tiering = Tiering(books)
    keys = [key(f"k{i}") for i in range(4)]
    cached = [p.CachedBlock(i, k, label(keys, i)) for i, k in enumerate(keys)]
    cached[2] = p.CachedBlock(2, keys[2], b"")                                  # unlabelled: kept, never published
    effects = demote(books, tiering, "ns", cached[::-1], fail={0})              # tail first; the tail's write fails
    events = published(effects)
    assert [t for t, _ in events] == [b"kv@@ns"] * 2
    assert [ev.block_hashes[0] for _, ev in events] == [low64(keys[0]), low64(keys[1])]
    assert all(isinstance(ev, BlockStored) and ev.medium == "STORAGE" for _, ev in events)
    node = published(effects, tier=False)                                      # the node stream's: keys, no tokens
    assert [ev.block_hashes[0] for _, ev in node] == [keys[0][:-4], keys[1][:-4]]
    assert all(isinstance(ev, BlockStored) and not ev.token_ids and ev.parent_block_hash is None for _, ev in node)
    assert books.tier is not None and len(books.tier) == 3 and len(tiering.announced) == 2


def test_no_events_without_a_stream():
    books = books_with()
    books.events = False
    tiering = Tiering(books)
    keys = [key("k0")]
    assert published(demote(books, tiering, "ns", [p.CachedBlock(0, keys[0], label(keys, 0))])) == []


def test_a_block_evicted_by_value_or_dropped_is_published_removed():
    books = books_with(budget=3 * BLOCK, engines=(record("a"),))
    tiering = Tiering(books)
    old = [key(f"old{i}") for i in range(3)]
    demote(books, tiering, "ns", [p.CachedBlock(i, k, label(old, i)) for i, k in enumerate(old)])
    new = [key("new0")]
    effects = demote(books, tiering, "other", [p.CachedBlock(0, new[0], label(new, 0))])
    events = published(effects)
    removed = [(t, ev) for t, ev in events if isinstance(ev, BlockRemoved)]
    assert removed == [(b"kv@@ns", BlockRemoved(block_hashes=[low64(old[2])], medium="STORAGE", group_idx=0))]
    assert [(t, ev.block_hashes) for t, ev in events if isinstance(ev, BlockStored)] == \
        [(b"kv@@other", [low64(new[0])])]

    pinned = tiering.on_lookup(b"a", p.TierLookup(engine_id="a", keys=old[:1]))
    assert isinstance(pinned, p.TierPinned) and pinned.lease
    tiering.read(pinned.lease, 0, "checksum")                                   # its bytes failed their check
    effects = performed(books, tiering)
    assert published(effects) == \
        [(b"kv@@ns", BlockRemoved(block_hashes=[low64(old[0])], medium="STORAGE", group_idx=0))]
    assert published(effects, tier=False) == \
        [(b"kv@@ns", BlockRemoved(block_hashes=[old[0][:-4]], medium="STORAGE", group_idx=0))]


def test_an_invalidated_block_is_published_removed_at_once_even_while_a_load_holds_it():
    books = books_with(engines=(record("a"),))
    tiering = Tiering(books)
    keys = [key("k0"), key("k1")]
    demote(books, tiering, "ns", [p.CachedBlock(i, k, label(keys, i)) for i, k in enumerate(keys)])
    pinned = tiering.on_lookup(b"a", p.TierLookup(engine_id="a", keys=keys[:1]))
    assert isinstance(pinned, p.TierPinned) and pinned.lease
    tier = books.tier
    assert tier is not None and tier.invalidate("ns") == 2
    gone = tier.take_released()                                                 # what ``invalidation.py`` emits
    events = published(tiering.deleted(tuple(gone)))
    # k0 is loading still, but never served again: its file goes, and routers hear it now.
    assert sorted(ev.block_hashes[0] for _, ev in events) == sorted([low64(keys[0]), low64(keys[1])])
    assert not tiering.announced
    assert isinstance(tiering.on_release(b"a", p.TierRelease(engine_id="a", lease=pinned.lease)), p.Ok)
    assert published(performed(books, tiering)) == []                           # nothing more to say
    assert tier.held_bytes == 0 and len(tier) == 0


def test_a_vllm_label_is_republished_as_vllm_wrote_it_but_its_medium():
    """The plugin's label is vLLM's own ``BlockStored`` (``block_pool.py``
    ``_label``), its later fields included: they reach routers unchanged."""
    kv = pytest.importorskip("vllm.distributed.kv_events")
    keys = [key("a"), key("b")]
    theirs = kv.BlockStored(block_hashes=[low64(keys[1])], parent_block_hash=low64(keys[0]),
                            token_ids=[1, 2, 3, 4], block_size=4, lora_id=None, medium=kv.MEDIUM_GPU,
                            lora_name="adapter", extra_keys=[("adapter", "salt")], group_idx=0,
                            kv_cache_spec_kind="full_attention")
    event = tier_stored(keys[1], msgspec.msgpack.encode(theirs))
    assert event is not None
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(event), type=kv.BlockStored)
    assert back == msgspec.structs.replace(theirs, medium=kv.MEDIUM_STORAGE)
