"""Demotion source A's byte layout and the tier's lease rules, in process.

The layout: a worker maps a slab's memfd pages where the daemon says
(``EngineRecord.worker_offsets``) and vLLM views its arena layer-outer, block
``b`` of layer ``l`` at ``l * layer_stride + b * block_stride``; the daemon,
holding the same pages, reads a kept block's bytes with ``block_runs`` and
``read_runs``, and they must be the worker's block, layer 0 then layer 1 ...,
rank 0 then rank 1. The leases: what a lookup pins is unpinned by the fetch
of its last chunk, by a release, by the lease's deadline and by its engine's
departure, never twice; a pinned slot is never freed; another tenant's
namespace is never reached; bad input is refused, nothing changed.
"""

from __future__ import annotations

import pytest
import torch

from kvelastic import protocol as p
from kvelastic.daemon import effects as fx
from kvelastic.daemon.books import Books
from kvelastic.daemon.devices import Device
from kvelastic.daemon.orphans import OrphanSlab
from kvelastic.daemon.rejected import Rejected
from kvelastic.daemon.requests import Timing
from kvelastic.daemon.state import EngineRecord, shape_of
from kvelastic.daemon.tier_io import read_runs
from kvelastic.daemon.tiering import LEASE_TIMEOUT, Tiering, block_runs
from kvelastic.tier.index import TierIndex
from kvelastic.vmm.host import HostBackend

MiB = 1 << 20
PAGE = 2 * MiB


def record(ppw: int, run: int, bps: int, workers: int = 1, max_slabs: int = 4, engine_id: str = "e",
           namespace: str = "ns") -> EngineRecord:
    block_bytes = ppw * PAGE * workers // bps
    return EngineRecord(engine_id=engine_id, namespace=namespace, pid=1, page_size=PAGE, pages_per_worker=ppw,
                        num_workers=workers, blocks_per_slab=bps, block_bytes=block_bytes, block_tokens=16,
                        key_group_suffix=False, min_bytes=0, max_bytes=0, max_slabs=max_slabs,
                        device="cpu", pages_per_region=run, identity=engine_id.encode())


@pytest.mark.parametrize("ppw,run,bps,workers", [
    (2, 1, 128, 1),      # the tiny Llama on the CPU build: a page per layer, 16 KiB a block per layer
    (4, 1, 64, 1),       # four layers
    (1, 1, 8, 1),        # block-outer: one region
    (6, 3, 2, 1),        # blocks that no page divides: a block's run crosses pages
    (2, 1, 32, 2),       # two workers: rank 0's layers, then rank 1's
])
def test_a_kept_block_read_from_the_pages_is_the_block_the_worker_wrote(ppw, run, bps, workers):
    engine = record(ppw, run, bps, workers)
    backend = HostBackend(PAGE)
    device = Device("cpu", backend, 64 * PAGE)
    slab_id = 1
    pages = device.create(list(range(ppw * workers)))
    regions = ppw // run
    region_bytes = engine.max_slabs * run * PAGE                # vLLM's layer stride over the arena
    stride = run * PAGE // bps                                   # a block's bytes in one region (layer)
    expected: dict[int, bytes] = dict.fromkeys(range(bps), b"")
    arenas = []
    for rank in range(workers):
        arena = backend.reserve(ppw * engine.max_slabs * PAGE)
        arenas.append(arena)
        mine = pages[rank * ppw:(rank + 1) * ppw]
        for page_id, at in zip(mine, engine.worker_offsets(slab_id, rank)):
            arena.map(at, device.pages[page_id])
        # vLLM's layer-outer views over the arena: [layer][block][stride bytes]
        flat = arena.tensor(torch.uint8, (arena.size,))
        layers = flat[:regions * region_bytes].view(regions, engine.max_slabs * bps, stride)
        first = slab_id * bps
        gen = torch.Generator().manual_seed(rank)
        layers[:, first:first + bps] = torch.randint(0, 256, (regions, bps, stride), dtype=torch.uint8,
                                                     generator=gen)
        for k in range(bps):
            expected[k] += layers[:, first + k].contiguous().numpy().tobytes()
    try:
        shape = shape_of(engine)
        for k in range(bps):
            runs = block_runs(shape, PAGE, pages, ["cpu"] * len(pages), k)
            assert runs is not None
            got = read_runs({"cpu": device}, tuple(runs))
            assert len(got) == engine.block_bytes and got == expected[k], f"block {k}"
    finally:
        for arena in arenas:
            for at in list(arena.mapped()):
                arena.unmap(at)
            arena.close()
        device.release_all()


def test_a_shape_that_does_not_split_into_whole_blocks_is_not_demoted():
    engine = record(2, 1, 128)
    shape = shape_of(engine)
    assert block_runs(shape, PAGE, [0, 1], ["cpu"] * 2, 128) is None                 # no such block
    assert block_runs(shape, PAGE, [0], ["cpu"], 0) is None                          # pages missing
    odd = record(2, 1, 128)
    odd.block_bytes += 1                                                              # padding somewhere
    assert block_runs(shape_of(odd), PAGE, [0, 1], ["cpu"] * 2, 0) is None


# ------------------------------------------------------------------ leases
def books_with(*engines: EngineRecord) -> Books:
    books = Books({"cpu": 64}, PAGE, "host", Timing(), events=False)
    books.tier = TierIndex(1 << 30)
    for serial, e in enumerate(engines, 1):
        e.serial = serial
        books.engines[e.engine_id] = e
    return books


def demoted(books: Books, tiering: Tiering, namespace: str, keys: list[bytes]) -> list[fx.DemoteBlock]:
    """Kept blocks of ``namespace`` demoted as the loop would: reserved, written, committed."""
    engine = record(2, 1, 128, namespace=namespace)
    cached = tuple(p.CachedBlock(i, k) for i, k in enumerate(keys))
    tiering.demote([OrphanSlab(namespace, shape_of(engine), [10, 11], ["cpu", "cpu"], cached, 0.0, "gone")])
    effects = books.take()
    blocks = [b for e in effects if isinstance(e, fx.DemoteBlocks) for b in e.blocks]
    tiering.written([b.slot for b in blocks], [])
    return blocks


def deleted(books: Books) -> list[int]:
    """Slots whose files the loop is told to delete (freed by the index)."""
    return [s for e in books.take() if isinstance(e, fx.DeleteTierBlocks) for s in e.slots]


def test_demotion_reserves_each_kept_block_with_its_parent_and_a_rising_cost():
    books = books_with()
    tiering = Tiering(books)
    blocks = demoted(books, tiering, "ns", [b"k0", b"k1", b"k2"])
    assert [b.key for b in blocks] == [b"k0", b"k1", b"k2"]
    assert [b.parent for b in blocks] == [None, b"k0", b"k1"]
    assert blocks[0].cost < blocks[1].cost < blocks[2].cost
    assert books.tier is not None and books.tier.stats.demotions == 3
    assert demoted(books, tiering, "ns", [b"k0"]) == []          # in the tier already: nothing to write


def test_demotion_needs_the_host_backend():
    books = books_with()
    books.backend = "cuda"
    assert demoted(books, Tiering(books), "ns", [b"k0"]) == []


def test_a_lease_pins_until_its_last_chunk_and_a_pinned_slot_is_never_freed():
    a = record(2, 1, 128, engine_id="a")
    books = books_with(a)
    tiering = Tiering(books)
    demoted(books, tiering, "ns", [b"k0", b"k1"])
    tier = books.tier
    assert tier is not None
    pinned = tiering.on_lookup(b"a", p.TierLookup(engine_id="a", keys=[b"k0", b"k1", b"k9"]))
    assert isinstance(pinned, p.TierPinned) and pinned.lease and len(pinned.nbytes) == 2
    lease = tiering.leases[pinned.lease]
    books.take()
    tiering.on_fetch(b"a", p.TierFetch(engine_id="a", lease=pinned.lease, block=0))
    read = [e for e in books.take() if isinstance(e, fx.ReadTierBlock)]
    assert [(r.slot, r.offset) for r in read] == [(lease.slots[0], 0)]
    tiering.read(pinned.lease, 0, "")            # its last chunk went out: unpinned, loaded, still in the tier
    assert tier.stats.promotions == 1 and deleted(books) == [] and tier.servable(lease.slots[0])
    tiering.read(pinned.lease, 0, "")            # twice: nothing more
    assert tier.stats.promotions == 1
    assert tier.invalidate("ns") == 2            # block 1 still pinned: dead, its entry kept while pinned
    # ... but its bytes go at once (never served again; a restart must not find them).
    assert tier.take_released() == lease.slots and tier.held_bytes == pinned.nbytes[1]
    # Invalidated since the lookup: its bytes may be stale, so the fetch reads
    # nothing, answers "not served", and the lease's last pin ends.
    reply = tiering.on_fetch(b"a", p.TierFetch(engine_id="a", lease=pinned.lease, block=1))
    assert isinstance(reply, p.TierData) and reply.size == -1 and reply.data == b""
    out = books.take()
    assert not [e for e in out if isinstance(e, fx.ReadTierBlock)]
    assert not [e for e in out if isinstance(e, fx.DeleteTierBlocks)]     # its file went at the invalidation
    assert tier.held_bytes == 0 and not tiering.leases
    assert tier.stats.failures["load"] == 0 and tier.stats.promotions == 1
    tier.check()


def test_a_lease_dies_with_its_engine_and_at_its_deadline():
    a, b = record(2, 1, 128, engine_id="a"), record(2, 1, 128, engine_id="b")
    books = books_with(a, b)
    tiering = Tiering(books)
    demoted(books, tiering, "ns", [b"k0", b"k1"])
    tier = books.tier
    assert tier is not None
    la = tiering.on_lookup(b"a", p.TierLookup(engine_id="a", keys=[b"k0", b"k1"]))
    lb = tiering.on_lookup(b"b", p.TierLookup(engine_id="b", keys=[b"k0"]))
    assert isinstance(la, p.TierPinned) and isinstance(lb, p.TierPinned)
    tiering.end_for(a)
    assert la.lease not in tiering.leases and tier.stats.failures["load"] == 2
    assert tiering.pinned() == 1
    books.now = LEASE_TIMEOUT + 1
    tiering.expire()
    assert not tiering.leases and tier.held_bytes == 0 and tier.stats.failures["load"] == 3
    tier.check()


def test_a_failed_block_is_dropped_and_counted_once():
    a = record(2, 1, 128, engine_id="a")
    books = books_with(a)
    tiering = Tiering(books)
    demoted(books, tiering, "ns", [b"k0"])
    tier = books.tier
    assert tier is not None
    pinned = tiering.on_lookup(b"a", p.TierLookup(engine_id="a", keys=[b"k0"]))
    assert isinstance(pinned, p.TierPinned)
    tiering.read(pinned.lease, 0, "checksum")
    assert tier.stats.failures["checksum"] == 1 and tier.stats.failures["load"] == 0
    assert len(tier) == 0 and not tiering.leases
    assert tiering.on_lookup(b"a", p.TierLookup(engine_id="a", keys=[b"k0"])) == p.TierPinned(lease=0, nbytes=[])


def test_the_namespace_is_the_registrations_and_bad_input_changes_nothing():
    a = record(2, 1, 128, engine_id="a", namespace="tenant-1")
    other = record(2, 1, 128, engine_id="o", namespace="tenant-2")
    books = books_with(a, other)
    tiering = Tiering(books)
    demoted(books, tiering, "tenant-1", [b"k0"])
    assert tiering.on_lookup(b"o", p.TierLookup(engine_id="o", keys=[b"k0"])).lease == 0   # another namespace
    pinned = tiering.on_lookup(b"a", p.TierLookup(engine_id="a", keys=[b"k0"]))
    assert isinstance(pinned, p.TierPinned) and pinned.lease
    for identity, msg in [
        (b"o", p.TierLookup(engine_id="a", keys=[b"k0"])),                        # not its connection
        (b"o", p.TierFetch(engine_id="o", lease=pinned.lease, block=0)),          # not its lease
        (b"o", p.TierRelease(engine_id="o", lease=pinned.lease)),
        (b"a", p.TierFetch(engine_id="a", lease=pinned.lease, block=1)),          # no such block
        (b"a", p.TierFetch(engine_id="a", lease=pinned.lease, block=0, offset=1 << 40)),
        (b"a", p.TierFetch(engine_id="a", lease=999, block=0)),
    ]:
        handler = {p.TierLookup: tiering.on_lookup, p.TierFetch: tiering.on_fetch,
                   p.TierRelease: tiering.on_release}[type(msg)]
        with pytest.raises(Rejected):
            handler(identity, msg)   # type: ignore[operator]
    assert books.take() == [] and list(tiering.leases) == [pinned.lease] and tiering.pinned() == 1


@pytest.mark.parametrize("reason,demotes", [("ttl", True), ("reclaim", True), ("invalidate", False)])
def test_released_kept_cache_is_written_before_its_pages_go_unless_invalidated(reason, demotes):
    from kvelastic.daemon.handoff import CacheHandoff

    books = books_with()
    books.pools["cpu"].created = 2
    handoff = CacheHandoff(books, Tiering(books))
    engine = record(2, 1, 128)
    kept = OrphanSlab("ns", shape_of(engine), [10, 11], ["cpu", "cpu"], (p.CachedBlock(0, b"k0"),), 0.0, "gone")
    handoff.release([kept], "why", reason)
    kinds = [type(e).__name__ for e in books.take()]
    assert kinds == (["DemoteBlocks", "ReleasePages"] if demotes else ["ReleasePages"])


def test_each_block_loaded_counts_its_latency_from_the_lookup_to_its_last_chunk():
    """``kvelastic_tier_load_seconds``: measured on the daemon's clock (``books.now``),
    per block loaded; a block released or dropped is not a load."""
    from kvelastic.tier.stats import LOAD_BUCKETS

    a = record(2, 1, 128, engine_id="a")
    books = books_with(a)
    tiering = Tiering(books)
    demoted(books, tiering, "ns", [b"k0", b"k1", b"k2"])
    tier = books.tier
    assert tier is not None
    books.now = 100.0
    pinned = tiering.on_lookup(b"a", p.TierLookup(engine_id="a", keys=[b"k0", b"k1", b"k2"]))
    assert isinstance(pinned, p.TierPinned) and pinned.lease
    books.now = 100.0003
    tiering.read(pinned.lease, 0, "")               # loaded 300 us after the lookup
    books.now = 102.0
    tiering.read(pinned.lease, 1, "")               # 2 s
    tiering.read(pinned.lease, 2, "checksum")       # dropped: no load
    counts = tier.stats.load_counts
    assert sum(counts) == 2 and abs(tier.stats.load_seconds_sum - 2.0003) < 1e-9
    assert counts[LOAD_BUCKETS.index(0.0005)] == 1 and counts[LOAD_BUCKETS.index(2.5)] == 1
    assert "load_counts" not in tier.stats.counters()  # the counters stay counters
