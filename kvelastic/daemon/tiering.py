"""The tier's decisions in the allocator (docs/tier.md): what kept cache is
demoted into the node's tier, and the leases under which engines load
blocks back. No I/O: it emits ``fx.DemoteBlocks`` and ``fx.ReadTierBlock``,
and the loop (``tier_io.py``) moves the bytes and reports back.

**Demotion, source A.** When kept cache (``orphans.py``) is released on the
host backend (expired, or yielded to a demand; never when invalidated), the
daemon holds its pages alone: no process maps them. Each kept block is
reserved in the index, and the loop reads its bytes from the pages before
they are released, writes them to the store and commits (``written``).
Likewise a slab reclaimed from a running engine for another's demand
(``reclaims.py``), once every worker unmapped it (``unmapping.py``): its
blocks valid when the daemon asked for it (``valid_blocks``: keys of
finished steps, as kept cache's) and still cached when the engine gave it
up (``reclaimed``), unless they go on to a replica with the pages or the
namespace was invalidated meanwhile.

Where a block's bytes lie (``block_runs``): a slab has, in each worker
(rank ``r``: pages ``r * pages_per_worker`` on), ``regions`` regions of
``pages_per_region`` consecutive pages (layer-outer: a region per layer,
vLLM's ``[layer][block]`` layout; block-outer: one region), and block ``k``
of the slab takes ``k * stride`` to ``(k + 1) * stride`` of each region,
``stride = pages_per_region * page_size / blocks_per_slab``. A block's
payload is its runs in that order: rank 0's region 0 (layer 0), region 1,
..., then rank 1's: for one worker, "layer 0's bytes | layer 1's | ...",
what a worker's ``[L, B, block bytes]`` view of its KV gives for ``v[:, k]``.

**Leases.** ``TierLookup`` pins the longest committed run of the engine's
keys (in its registration's namespace, never one the message names) under
a lease; ``TierFetch`` reads one block of it (in chunks under
``p.MAX_MESSAGE_BYTES``), the last chunk unpinning it as loaded; a block
that fails its check is dropped; ``TierRelease``, the lease's deadline and
the engine's departure unpin what is left. No pin outlives its engine.

**Shared fairly.** A lease keeps its slots only (a slot names one block for
life; the key a read checks comes from the index, ``key_of``), and what
leases hold is bounded per tenant (the engine's uid), not only per engine:
``MAX_LEASES`` an engine, ``MAX_TENANT_LEASES`` a tenant, and the pins of a
tenant's leases within its share of the tier (``tier/pins.py``: a quarter of
the budget's bytes, ``MAX_TENANT_PINS`` pins, and no block pinned on and on
without loads). A lookup past its tenant's share pins what fits, or is
refused ``BUSY`` when nothing does; each refusal is counted
(``TierStats.refused``). So a tenant's lease state is at most
``MAX_TENANT_LEASES`` records and ``MAX_TENANT_PINS`` slots, whatever its
engines send.

**Routers see it.** A committed block is published as ``BlockStored`` with the
medium ``STORAGE`` under the pseudo-engine of the tier (topic ``kv@@NAMESPACE``,
``kv_events.tier_topic``): on the tier stream, its label, the engine's own
event for it (vLLM's hash, parent, token ids), parents before children; on
the node stream, as the engines' blocks there (its key, no token ids). When
its file goes (evicted, invalidated, dropped: at once for the last two, even
while a load pins it, since it is never served again), ``deleted`` publishes its
``BlockRemoved`` on both. A block without a usable label is kept and
served, never published.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import cast

from kvelastic import protocol as p
from kvelastic.daemon import effects as fx
from kvelastic.daemon.books import Books
from kvelastic.daemon.events import node_stored, parents_first, tier_stored
from kvelastic.daemon.orphans import OrphanSlab
from kvelastic.daemon.rejected import Rejected
from kvelastic.daemon.state import EngineRecord, SlabRecord, SlabShape, shape_of
from kvelastic.errors import require
from kvelastic.kv_events import MEDIUM_STORAGE, BlockRemoved, BlockStored, KVEvent, tier_topic
from kvelastic.tier.index import TierIndex
from kvelastic.tier.store import StoredBlock

log = logging.getLogger("kvelastic.daemon")

MAX_LEASES = 64              # leases one engine may hold at once
# And one tenant (uid), all its engines together: with the index's bound on
# its pins (``tier/pins.py``), its lease state is bounded whatever its number
# of engines (a reader engine holds no slab, so nothing else bounds them).
MAX_TENANT_LEASES = 256
LEASE_TIMEOUT = 30.0         # a lease not released by then is ended (its blocks unpinned, counted as failed loads)
CHUNK = p.MAX_MESSAGE_BYTES - (64 << 10)   # bytes of a block per TierData (room for the envelope)

Run = tuple[str, int, int, int]   # (device, page id, offset in the page, length)


def block_runs(shape: SlabShape, page_size: int, pages: list[int], page_devices: list[str],
               offset: int) -> list[Run] | None:
    """Where block ``offset`` of a slab of ``shape`` lies in the slab's
    ``pages``, in payload order (module docstring). None when the shape does
    not split into whole blocks that way (nothing is demoted then)."""
    run = shape.pages_per_region
    workers = max(1, shape.num_workers)
    if run <= 0 or shape.pages_per_worker % run or not 0 <= offset < shape.blocks_per_slab \
            or len(pages) != shape.pages_per_worker * workers or (run * page_size) % shape.blocks_per_slab:
        return None
    regions = shape.pages_per_worker // run
    stride = run * page_size // shape.blocks_per_slab
    if stride * regions * workers != shape.block_bytes:
        return None
    out: list[Run] = []
    for rank in range(workers):
        for region in range(regions):
            first = rank * shape.pages_per_worker + region * run    # the region's first page in ``pages``
            at, left = offset * stride, stride
            while left:
                i, within = divmod(at, page_size)
                n = min(left, page_size - within)
                out.append((page_devices[first + i], pages[first + i], within, n))
                at, left = at + n, left - n
    return out


@dataclasses.dataclass
class Lease:
    """Pins of one lookup. Its slots only, never the keys asked for: a slot
    names one block for life, and the key its read checks is the index's
    (``TierIndex.key_of``, there while pinned)."""
    lease: int
    engine_id: str
    serial: int                       # the registration that holds it
    uid: int                          # its tenant: the index counts its pins against that tenant's share
    namespace: str
    slots: list[int]
    done: list[bool]                  # unpinned already (loaded, or dropped)
    deadline: float
    started: float                    # when its TierLookup came: each block's load latency runs from here


class Tiering:
    """The allocator's part for the tier: demotion plans and load leases."""

    def __init__(self, books: Books) -> None:
        self.books = books
        self.leases: dict[int, Lease] = {}
        self._next_lease = 1
        self._engine_leases: dict[int, int] = {}   # registration serial -> its leases
        self.tenant_leases: dict[int, int] = {}    # uid -> its engines' leases
        # The tier's blocks as routers hear of them, by slot: (namespace, event).
        self._announcing: dict[int, tuple[str, bytes, BlockStored]] = {}   # reserved, written not yet
        self.announced: dict[int, tuple[str, bytes, BlockStored]] = {}     # published stored
        # Slots being written from running engines, counted apart once committed:
        # slabs reclaimed from them, blocks they were about to evict (``staging.py``).
        self.counted_as: dict[int, str] = {}

    @property
    def tier(self) -> TierIndex | None:
        return self.books.tier

    # ---------------------------------------------------------- demotion
    def demote(self, slabs: list[OrphanSlab]) -> None:
        """Kept slabs about to be released, or handed to an engine: reserve
        their blocks in the tier (those not in it already) and have the loop
        write them first (host backend only: the daemon reads the memfd pages
        it holds, which no worker maps yet)."""
        if self.tier is None or self.books.backend != "host" or not slabs:
            return
        for o in slabs:
            self.reserve(o.namespace, o.shape, o.pages, o.page_devices, o.cached)
        self._delete_released()

    def takes_reclaimed(self, engine: EngineRecord) -> bool:
        """Whether the cached blocks of a slab reclaimed from ``engine`` may go
        into the tier: a tier on the host backend, and an engine that shares
        its cache (a private one's weights may have changed in memory)."""
        return self.tier is not None and self.books.backend == "host" and not engine.private

    @staticmethod
    def valid_blocks(engine: EngineRecord, slab_ids: list[int]) -> dict[int, tuple[p.CachedBlock, ...]]:
        """Each slab's blocks whose key the engine stored in a model step that
        finished (the mirror, as for kept cache; a block the engine marked
        ``DEMOTE`` counts too: only when its key is dropped was left open, not
        its bytes), in the order their keys came (step, then place): the
        prefix's order as far as the daemon knows it. Costs what the slabs
        hold and the engine's demoted blocks, never what its geometry allows."""
        mirror, bps = engine.mirror, engine.blocks_per_slab
        wanted = set(slab_ids)
        demoted: dict[int, list[int]] = {}
        for block in mirror.demoted:
            if block // bps in wanted:
                demoted.setdefault(block // bps, []).append(block)
        out: dict[int, tuple[p.CachedBlock, ...]] = {}
        for slab_id in wanted:
            first = slab_id * bps
            blocks = [first + offset for offset, _ in mirror.valid_in(slab_id, bps)]
            blocks += [b for b in demoted.get(slab_id, ()) if mirror.stored_in.get(b, mirror.done + 1) <= mirror.done]
            found = sorted((mirror.stored_in[b], b - first, cast(bytes, mirror.key_of[b]),
                            mirror.label_of.get(b, b"")) for b in blocks)
            out[slab_id] = tuple(p.CachedBlock(offset, key, label) for _, offset, key, label in found)
        return out

    @staticmethod
    def reclaimed(valid: tuple[p.CachedBlock, ...], given: list[p.CachedBlock]) -> tuple[p.CachedBlock, ...]:
        """Of a reclaimed slab's blocks valid when the daemon asked for it,
        those the engine still cached under the same key when it gave the
        slab up (a block rewritten since would have been live, and refused,
        or keyed anew)."""
        still = {(c.offset, c.key) for c in given}
        return tuple(c for c in valid if (c.offset, c.key) in still)

    def demote_reclaimed(self, engine: EngineRecord, slab: SlabRecord) -> None:
        """Every worker of a running engine let go of a slab reclaimed for
        another engine: the daemon holds its pages alone, so its cached
        blocks (``slab.route``, ``Way.TIER``) are written to the tier before
        the pages are reused (``fx.DemoteBlocks`` ahead of any effect that
        re-grants or releases them)."""
        if not self.takes_reclaimed(engine) or not slab.route.blocks or not slab.pages:
            return
        reserved = [slot for slot, _ in self.reserve(engine.namespace, shape_of(engine), slab.pages,
                                                     slab.page_devices, slab.route.blocks)]
        self.counted_as.update(dict.fromkeys(reserved, "demotions_reclaimed"))
        if reserved:
            log.info("engine %s: %d cached block(s) of reclaimed slab %d go to the tier", engine.engine_id,
                     len(reserved), slab.slab_id)
        self._delete_released()

    def reserve(self, namespace: str, shape: SlabShape, pages: list[int], page_devices: list[str],
                cached: tuple[p.CachedBlock, ...], staged: bool = False) -> list[tuple[int, p.CachedBlock]]:
        """Reserve ``cached`` (a slab's blocks, in the prefix's order as far as
        known) and emit their ``DemoteBlocks``; (slot, block) of those reserved.
        ``staged`` (source B): blocks of a running engine's LRU, in no
        prefix's order: no parent, each the cost of one block."""
        tier, books = self.tier, self.books
        assert tier is not None
        blocks: list[fx.DemoteBlock] = []
        out: list[tuple[int, p.CachedBlock]] = []
        parent: bytes | None = None
        for position, c in enumerate(cached, 1):
            runs = block_runs(shape, books.page_size, pages, page_devices, c.offset)
            if runs is None:
                break
            nbytes = shape.block_bytes
            # Cost: a monotone proxy of the work to compute it again (its
            # place in the slab's order, which is the prefix's as far as known).
            cost, par = float((1 if staged else position) * nbytes), parent if parent != c.key else None
            slot = tier.reserve(namespace, c.key, nbytes, cost, books.now, par)
            parent = None if staged else c.key
            if slot is not None:
                blocks.append(fx.DemoteBlock(slot, c.key, par, cost, tuple(runs), c.label, tier.level_of(slot)))
                out.append((slot, c))
                event = tier_stored(c.key, c.label)
                if event is not None and books.events:
                    self._announcing[slot] = (namespace, c.key, event)
        moves = tier.take_moves()
        if moves:          # before the new blocks' writes: the memory above is let go before it is filled
            books.emit(fx.MoveTierBlocks(tuple(moves), tuple(tier.nbytes(s) for s in moves)))
        if blocks:
            books.emit(fx.DemoteBlocks(namespace, tuple(blocks), staged=staged))
        return out

    def written(self, committed: list[int], failed: list[tuple[int, str]]) -> None:
        """The loop wrote (or could not write) the blocks of a ``DemoteBlocks``
        (or a ``WriteStaged``)."""
        tier = self.tier
        if tier is None:
            return
        stored: dict[str, list[tuple[bytes, BlockStored]]] = {}
        moves = {s for s in committed if tier.moving(s)} | {s for s, _ in failed if tier.moving(s)}
        for slot in committed:
            if slot in moves:              # moved down (or cancelled by its delete): findable below
                tier.moved(slot)
        for slot, reason in failed:
            if slot in moves:              # not moved: its bytes go, the block with them
                tier.drop(slot, reason)
        committed = [s for s in committed if s not in moves]
        failed = [(s, r) for s, r in failed if s not in moves]
        for slot in committed:
            counter = self.counted_as.pop(slot, None)
            if tier.commit(slot) and counter is not None:
                setattr(tier.stats, counter, getattr(tier.stats, counter) + 1)
            if slot in self._announcing:
                namespace, key, event = self.announced[slot] = self._announcing.pop(slot)
                stored.setdefault(namespace, []).append((key, event))
        for slot, reason in failed:
            tier.abort(slot, reason)
            self.counted_as.pop(slot, None)
            self._announcing.pop(slot, None)
        for effect in self._published(stored):
            self.books.emit(effect)
        self._delete_released()

    def restored(self, entries: list[StoredBlock]) -> list[fx.Effect]:
        """A new daemon's tier rebuilt from disk: the blocks restored whose
        label names them are published stored, as the first daemon did."""
        tier = self.tier
        if tier is None or not self.books.events:
            return []
        stored: dict[str, list[tuple[bytes, BlockStored]]] = {}
        for e in entries:
            event = tier_stored(e.key, e.label) if tier.servable(e.slot) else None
            if event is not None:
                self.announced[e.slot] = (e.namespace, e.key, event)
                stored.setdefault(e.namespace, []).append((e.key, event))
        return self._published(stored)

    @staticmethod
    def _published(stored: dict[str, list[tuple[bytes, BlockStored]]]) -> list[fx.Effect]:
        """``BlockStored`` of each namespace's blocks, parents first, on the node stream and the tier's."""
        out: list[fx.Effect] = []
        for namespace, blocks in stored.items():
            topic, ordered = tier_topic(namespace), parents_first([e for _, e in blocks])
            keys = {id(e): k for k, e in blocks}
            out.append(fx.Publish(topic, tuple(node_stored(keys[id(e)], e) for e in ordered)))
            out.append(fx.Publish(topic, tuple(ordered), tier=True))
        return out

    def deleted(self, slots: tuple[int, ...]) -> list[fx.Effect]:
        """The loop deleted the files of ``slots`` (``fx.DeleteTierBlocks``:
        freed, or dead under a load): the announced ones are published removed."""
        removed: dict[str, tuple[list[KVEvent], list[KVEvent]]] = {}     # namespace -> (node's, tier's)
        for slot in slots:
            self._announcing.pop(slot, None)
            entry = self.announced.pop(slot, None)
            if entry is not None:
                namespace, key, event = entry
                node, own = removed.setdefault(namespace, ([], []))
                node.append(BlockRemoved(block_hashes=node_stored(key, event).block_hashes, medium=MEDIUM_STORAGE,
                                         group_idx=event.group_idx))
                own.append(BlockRemoved(block_hashes=event.block_hashes, medium=MEDIUM_STORAGE,
                                        group_idx=event.group_idx))
        return [fx.Publish(tier_topic(ns), tuple(events), tier=on_tier)
                for ns, both in removed.items() for on_tier, events in zip((False, True), both)]

    def _delete_released(self) -> None:
        tier = self.tier
        if tier is not None:
            gone = tier.take_released()
            if gone:
                self.books.emit(fx.DeleteTierBlocks(tuple(gone)))

    # ------------------------------------------------------------ leases
    def on_lookup(self, identity: bytes, m: p.TierLookup) -> p.Msg:
        engine = self.books.own_engine(identity, m.engine_id)
        tier = self.tier
        if tier is None or not m.keys:
            return p.TierPinned(lease=0, nbytes=[])
        if self._engine_leases.get(engine.serial, 0) >= MAX_LEASES:
            raise Rejected(p.Reason.BUSY, f"engine {engine.engine_id} holds {MAX_LEASES} tier leases already")
        if self.tenant_leases.get(engine.uid, 0) >= MAX_TENANT_LEASES:
            tier.stats.refused["leases"] += 1
            raise Rejected(p.Reason.BUSY, f"uid {engine.uid}'s engines hold {MAX_TENANT_LEASES} tier leases already")
        slots, cut = tier.pin(engine.namespace, m.keys, self.books.now, tenant=engine.uid)
        if not slots:
            if cut:
                raise Rejected(p.Reason.BUSY, self._refusal(engine.uid, cut))
            return p.TierPinned(lease=0, nbytes=[])
        lease = Lease(self._next_lease, engine.engine_id, engine.serial, engine.uid, engine.namespace, slots,
                      [False] * len(slots), self.books.now + LEASE_TIMEOUT, self.books.now)
        self._next_lease += 1
        self.leases[lease.lease] = lease
        self._engine_leases[engine.serial] = self._engine_leases.get(engine.serial, 0) + 1
        self.tenant_leases[engine.uid] = self.tenant_leases.get(engine.uid, 0) + 1
        return p.TierPinned(lease=lease.lease, nbytes=[tier.nbytes(s) for s in slots])

    def _refusal(self, uid: int, cut: str) -> str:
        """Why a lookup pinned nothing of what the tier holds."""
        tier = self.tier
        assert tier is not None
        if cut == "pin_held":
            return "the tier's first block asked for was pinned too long: it rests (not pinned again yet)"
        share = int(tier.budget_bytes * tier.pins.share)
        return f"uid {uid} pins its share of the tier ({share} bytes, {tier.pins.max_pins} pins) already"

    def on_fetch(self, identity: bytes, m: p.TierFetch) -> p.Msg | None:
        lease = self._own_lease(identity, m.engine_id, m.lease)
        if not 0 <= m.block < len(lease.slots) or lease.done[m.block]:
            raise Rejected(p.Reason.BAD_REQUEST, f"block {m.block} of tier lease {m.lease} is not pinned")
        tier = self.tier
        assert tier is not None
        slot = lease.slots[m.block]
        if not 0 <= m.offset < tier.nbytes(slot):
            raise Rejected(p.Reason.BAD_REQUEST, f"offset {m.offset} is outside block {m.block}")
        if not tier.servable(slot):
            # Invalidated (or dropped) since the lookup pinned it: its KV may
            # be stale, so the lease's pin ends here and nothing is read.
            self._unpin(lease, [m.block], loaded=None)
            return p.TierData(lease=lease.lease, block=m.block, offset=m.offset, size=-1, data=b"")
        namespace, key = tier.key_of(slot)     # pinned: its entry is there
        self.books.emit(fx.ReadTierBlock(identity, m.req_id, lease.lease, m.block, slot, namespace, key, m.offset,
                                         CHUNK))
        return None

    def read(self, lease_id: int, block: int, error: str) -> None:
        """The loop read the last chunk of ``block`` (``error`` empty), or its
        bytes failed their check (``error``: the reason): it is unpinned."""
        lease, tier = self.leases.get(lease_id), self.tier
        if lease is None or tier is None or lease.done[block]:
            return
        if error:
            tier.drop(lease.slots[block], error)
            self._unpin(lease, [block], loaded=None)
        else:
            self._unpin(lease, [block], loaded=True)
            tier.stats.observe_load(self.books.now - lease.started)

    def on_release(self, identity: bytes, m: p.TierRelease) -> p.Msg:
        lease = self._own_lease(identity, m.engine_id, m.lease)
        self._end(lease, loaded=None)
        return p.Ok()

    def end_for(self, engine: EngineRecord) -> None:
        """The engine left: its leases end with it."""
        for lease in [x for x in self.leases.values() if x.serial == engine.serial]:
            self._end(lease, loaded=False)

    def expire(self) -> None:
        now = self.books.now
        for lease in [x for x in self.leases.values() if now > x.deadline]:
            log.warning("engine %s: tier lease %d not released within %g s: ended", lease.engine_id,
                        lease.lease, LEASE_TIMEOUT)
            self._end(lease, loaded=False)

    def pinned(self) -> int:
        return sum(d is False for lease in self.leases.values() for d in lease.done)

    def check(self) -> None:
        """The lease counts are the leases' (the index checks the pins)."""
        engines: dict[int, int] = {}
        tenants: dict[int, int] = {}
        for lease in self.leases.values():
            require(not all(lease.done), f"tier lease {lease.lease} pins nothing and was kept")
            engines[lease.serial] = engines.get(lease.serial, 0) + 1
            tenants[lease.uid] = tenants.get(lease.uid, 0) + 1
        require(engines == self._engine_leases and tenants == self.tenant_leases, "tier lease counts are off")
        require(all(n <= MAX_TENANT_LEASES for n in tenants.values()), "a tenant holds too many tier leases")

    def _end(self, lease: Lease, loaded: bool | None) -> None:
        self._unpin(lease, [i for i, d in enumerate(lease.done) if not d], loaded)

    def _unpin(self, lease: Lease, blocks: list[int], loaded: bool | None) -> None:
        """These blocks of ``lease`` are done with (``loaded``: ``TierIndex.unpin``);
        the lease ends with its last pin."""
        tier = self.tier
        assert tier is not None
        for block in blocks:
            lease.done[block] = True
        if blocks:
            tier.unpin([lease.slots[b] for b in blocks], loaded=loaded, tenant=lease.uid, now=self.books.now)
        if all(lease.done) and self.leases.pop(lease.lease, None) is not None:
            for counts, holder in ((self._engine_leases, lease.serial), (self.tenant_leases, lease.uid)):
                counts[holder] -= 1
                if not counts[holder]:
                    del counts[holder]
        self._delete_released()

    def _own_lease(self, identity: bytes, engine_id: str, lease_id: int) -> Lease:
        engine = self.books.own_engine(identity, engine_id)
        lease = self.leases.get(lease_id)
        if lease is None or lease.serial != engine.serial:
            raise Rejected(p.Reason.BAD_REQUEST, f"no tier lease {lease_id} of engine {engine_id}")
        return lease
