"""The node's tier in the simulator (issue 43): a real ``TierIndex`` with a
small budget, handed to the ``Allocator`` as the daemon does, and the loop's
side of it played here as ``world.py`` plays the rest of the loop.

The store is a dict, slot -> the block's namespace, key and *content*: the
KV objects the simulated device holds in the block's places when the daemon
reads its runs (``fx.DemoteBlocks``), so a promoted block can be told apart
from any other write of the same key. It fails as a disk does: a write finds
the disk full (the slot is aborted), a block written is torn (found at read:
``TierData`` size -1, the slot dropped). A new daemon rebuilds its index from
the store with the real ``tier.restart.rebuild`` (the store answers ``scan``).

Engines look keys up on a device miss and fetch through the real handlers
(``TierLookup`` -> ``TierPinned``, ``TierFetch`` -> ``TierData``,
``TierRelease``), as the loop dispatches them; some die holding a lease, some
abandon one (it must end at its deadline). ``kvelastic invalidate`` hits a
namespace, most often one with blocks in the tier.

Invariants (``check``, after every input, and at each effect): the index's
own ``check``; a key in at most one live entry per namespace; bytes in use
within the budget; the store never deletes a live slot a lease holds
(a dead one's file goes at once: it is never served again), and a fetch
never finds its slot's bytes gone; every block served holds exactly what
was demoted into that slot, of the lease's namespace and key, written
whole, and never after its namespace was invalidated (not by a lease
granted before it, nor from a file a new daemon restored); KV the daemon
held for demotion when its namespace was invalidated (kept cache, a
running engine's slab being reclaimed) is never demoted; no lease outlives its engine or its deadline.

Demotion source B (``staging.py``): the sim's engines honour ``Registered.tier``
(``engine.py``): their journals demote the next blocks to be evicted, carry
the last ``TierCopied`` ticket back (``Journal.tier_ack``) and the last
``ClearIndex`` scope applied (sometimes after a flush, as a deferred one in
the client). ``DemoteBlocks(staged=True)`` snapshots each block's content into
``staged`` with no check (a copy may be torn, or of a block rewritten: the ack
rule is there to discard those) and answers ``tier_copied``; a copy's read
fails now and then. ``WriteStaged`` checks each copy it writes as ``demote``
checks a block (KV of that namespace and key, whole, not invalidated, nor
from before an invalidation its engine was told of: that holds for kept
cache demoted and slabs adopted too) and stores it; what it drops is
discarded. Invariants: staged bytes within ``MAX_STAGED_BYTES`` (compressed
here, as the copy deadline is: ``small_staging``) and equal to the copies'
sum; every pending copy staged by the loop; no copy outlives its engine's
registration, nor its deadline past a tick.

The world is seen through ``TierWorld`` (``World`` fits it): this module
does not import ``world.py``.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import random
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

from kvelastic import protocol as p
from kvelastic.daemon import effects as fx
from kvelastic.daemon import staging, tiering
from kvelastic.daemon.allocator import Allocator
from kvelastic.daemon.state import Phase
from kvelastic.errors import InvariantViolation
from kvelastic.tier.disk import DiskEntry, ScanResult
from kvelastic.tier.index import TierIndex
from kvelastic.tier.restart import rebuild
from kvelastic.vmm.base import DEFAULT_PAGE_SIZE as PAGE
from kvelastic_tools.sim.engine import SimEngine
from kvelastic_tools.sim.records import BLOCKS_PER_SLAB, KV, Device

BLOCK_BYTES = PAGE // BLOCKS_PER_SLAB      # a block's bytes in each worker's page (``SimEngine.block_bytes``)
BUDGET_BLOCKS = 10                 # the tier's budget, in one-worker blocks: evictions happen within a run
TIER_ORPHAN_TTL = 1.0             # kept cache's TTL in a seed with a tier: released (demoted) within a run
LEASE_TIMEOUT = 1.0                # the sim's lease deadline (the daemon's is 30 s): abandoned leases end in a run
# Per block written: the disk is full (aborted); the bytes are torn (dropped when read).
DISK_FULL, TORN = 0.05, 0.05
# Per step, on the tier's own draw: an engine looks up (on a miss), an engine
# holding a lease is killed, an invalidation.
LOOKUP, KILL, INVALIDATE = 0.1, 0.006, 0.006
# Of leases granted: abandoned (left to expire), released part-way.
ABANDON, RELEASE = 0.08, 0.12
# Source B: a copy's read fails (``tier_copied`` hears it failed); the staging's
# room, in one-worker blocks, and a copy's deadline, compressed (``small_staging``).
READ_FAILS = 0.02
STAGED_BLOCKS = 6
COPY_TIMEOUT = 1.0


def with_tier(seed: int) -> bool:
    """Half the seeds run with a tier (chosen without a draw: the others replay as before)."""
    return seed % 2 == 1


@contextlib.contextmanager
def short_leases(timeout: float = LEASE_TIMEOUT) -> Iterator[None]:
    """The daemon's lease deadline, compressed as the sim compresses the kept cache's TTL."""
    saved = tiering.LEASE_TIMEOUT
    tiering.LEASE_TIMEOUT = timeout
    try:
        yield
    finally:
        tiering.LEASE_TIMEOUT = saved


@contextlib.contextmanager
def small_staging() -> Iterator[None]:
    """Source B's staging room and copy deadline, compressed as leases' are
    (STAGED_BLOCKS, COPY_TIMEOUT): both are met within a run."""
    saved = staging.MAX_STAGED_BYTES, staging.COPY_TIMEOUT
    staging.MAX_STAGED_BYTES, staging.COPY_TIMEOUT = STAGED_BLOCKS * BLOCK_BYTES, COPY_TIMEOUT
    try:
        yield
    finally:
        staging.MAX_STAGED_BYTES, staging.COPY_TIMEOUT = saved


class TierWorld(Protocol):
    """What the tier uses of the world."""

    @property
    def now(self) -> float: ...

    @property
    def counts(self) -> collections.Counter[str]: ...

    @property
    def device(self) -> Device: ...

    @property
    def allocator(self) -> Allocator: ...

    @property
    def engines(self) -> Sequence[SimEngine]: ...

    @property
    def wires(self) -> dict[bytes, Any]: ...

    @property
    def restart_at(self) -> dict[str, float]: ...

    @property
    def evictions(self) -> bool: ...

    @property
    def stopped(self) -> bool: ...

    def call(self, fn: Any, *args: Any) -> list[fx.Effect]: ...

    def perform(self, effects: list[fx.Effect]) -> None: ...

    def violation(self, what: str) -> None: ...


@dataclasses.dataclass(eq=False)
class Stored:
    """A block in the store: what the daemon wrote at its slot."""

    namespace: str
    key: bytes
    parent: bytes | None
    cost: float
    nbytes: int
    content: tuple[KV | None, ...]     # the device's KV in the block's places when it was read
    epoch: int                         # its namespace's invalidations before it was read
    torn: bool = False
    evicted: bool = False              # a running engine's block (source B)


@dataclasses.dataclass(eq=False)
class StagedCopy:
    """Source B: a running engine's block copied into the loop's staging."""

    namespace: str
    block: fx.DemoteBlock
    content: tuple[KV | None, ...]     # the device's KV in the block's places when copied
    epoch: int                         # its namespace's invalidations before it was copied
    whole: bool                        # the content was that key's, whole, when copied


@dataclasses.dataclass(eq=False)
class Load:
    """An engine's lookup and the lease it got: fetched block by block."""

    identity: bytes
    namespace: str                     # the engine's when it looked up
    keys: list[bytes]
    req: int                           # the request whose answer it waits for
    lease: int = 0
    nbytes: list[int] = dataclasses.field(default_factory=list)
    block: int = 0
    abandoned: bool = False


class SimStore:
    """What ``rebuild`` asks of a ``DiskStore``: its blocks, and deleting one."""

    def __init__(self, blocks: dict[int, Stored]) -> None:
        self.blocks = blocks

    def scan(self, *, verify_payloads: bool = False) -> ScanResult:
        return ScanResult([DiskEntry(slot, b.namespace, b.key, b.parent, b.nbytes, b.cost)
                           for slot, b in sorted(self.blocks.items())])

    def delete(self, slot: int) -> None:
        self.blocks.pop(slot, None)


class SimTier:
    def __init__(self, world: TierWorld, seed: int) -> None:
        self.world = world
        self.rng = random.Random(seed * 1_000_003 + 43)     # its own draws: the world's stream is unchanged
        self.store: dict[int, Stored] = {}
        self.index = TierIndex(BUDGET_BLOCKS * BLOCK_BYTES)
        self.invalidated: collections.Counter[str] = collections.Counter()   # namespace -> invalidations
        self.stale: dict[int, KV] = {}     # KV on the device when its namespace was invalidated (by id; held)
        self.loads: dict[bytes, Load] = {}  # engine identity -> its load in flight
        self.leased_through_invalidation: set[int] = set()   # leases held when their namespace was invalidated
        self.restored_invalidated: set[int] = set()          # slots of invalidated blocks a new daemon restored
        self.last_tick = 0.0               # when the allocator last ticked (``run.tick``): leases expire then
        self.staged: dict[int, StagedCopy] = {}   # source B: the loop's staging (``TierIO.staged``)
        self.cancelled: set[int] = set()          # staged copies deleted (their entry died) before written
        # KV on the device when its namespace was invalidated (by id; held): a
        # running engine clears its keys (``ClearIndex``), so none is written to the tier after.
        self.superseded: dict[int, KV] = {}
        self.tallied: collections.Counter[str] = collections.Counter()   # the index's counters counted so far

    def new_index(self) -> TierIndex:
        """A daemon starts: its index rebuilt from the store, as ``main.open_tier`` does."""
        self.tally()
        self.index = TierIndex(BUDGET_BLOCKS * BLOCK_BYTES)
        self.tallied.clear()
        self.staged.clear()                # the loop's staging went with the daemon
        self.cancelled.clear()
        if self.store:
            rebuild(self.index, SimStore(self.store), self.world.now)   # type: ignore[arg-type]
            self.world.counts["tier_rebuilt"] += 1
            back = {slot for slot, b in self.store.items() if b.epoch != self.invalidated[b.namespace]}
            if back:
                self.world.counts["tier_invalidated_restored"] += len(back)
            self.restored_invalidated |= back
        self.loads.clear()                 # the leases went with the daemon
        self.leased_through_invalidation.clear()
        return self.index

    # ------------------------------------------------------------ effects
    def perform(self, e: fx.Effect) -> list[fx.Effect]:
        """One of the tier's effects, as the loop (``tier_io.py``) does it."""
        if isinstance(e, fx.DemoteBlocks):
            return self.stage(e) if getattr(e, "staged", False) else self.demote(e)
        if isinstance(e, fx.WriteStaged):
            return self.write_staged(e)
        if isinstance(e, fx.ReadTierBlock):
            return self.read(e)
        if isinstance(e, fx.DeleteTierBlocks):
            # A dead slot's file may go while pinned (it is never served
            # again); a live one's never, while a lease may still fetch it.
            held = {s for lease in self.world.allocator.tiering.leases.values()
                    for s, done in zip(lease.slots, lease.done) if not done}
            for slot in e.slots:
                if slot in held and self.index.servable(slot):
                    self.world.violation(f"tier: live slot {slot} deleted while a lease holds it")
                self.store.pop(slot, None)
                copy = self.staged.pop(slot, None)
                if copy is not None:             # as ``TierIO.delete``: never written
                    self.cancelled.add(slot)
                    if not copy.whole:
                        self.world.counts["tier_staged_torn_dropped"] += 1   # kept off the disk by its death
            return self.world.allocator.tiering.deleted(e.slots)    # as the loop: announced ones published removed
        return []

    def demote(self, e: fx.DemoteBlocks) -> list[fx.Effect]:
        w, device = self.world, self.world.device
        done: list[int] = []
        failed: list[tuple[int, str]] = []
        for block in e.blocks:
            content = tuple(device.kv.get((page, within // BLOCK_BYTES)) for _dev, page, within, _n in block.runs)
            self.check_content(e.namespace, block.key, content)
            if self.rng.random() < DISK_FULL:
                failed.append((block.slot, "disk_full"))
                w.counts["tier_disk_full"] += 1
                continue
            nbytes = sum(n for _dev, _page, _within, n in block.runs)
            self.store[block.slot] = Stored(e.namespace, block.key, block.parent, block.cost, nbytes, content,
                                            self.invalidated[e.namespace], torn=self.rng.random() < TORN)
            done.append(block.slot)
        w.counts["tier_demoted"] += len(done)
        before = self.index.stats.demotions_reclaimed
        effects = w.call(w.allocator.tier_written, done, failed, w.now)
        w.counts["tier_demoted_reclaimed"] += self.index.stats.demotions_reclaimed - before   # of those
        return effects

    def check_content(self, namespace: str, key: bytes, content: tuple[KV | None, ...], staged: bool = False,
                      current: bool = True) -> None:
        """What is written to the tier as ``namespace``'s ``key``: that KV,
        whole, never invalidated, nor from before an invalidation its engine
        was told of (the daemon trusts none of its keys until its journal says
        it applied the ``ClearIndex``: neither kept cache nor copies). A
        ``staged`` copy made before its namespace was invalidated (not
        ``current``) is the exception: its slot died with the namespace."""
        w = self.world
        whence = "written from a staged copy" if staged else "demoted from pages"
        for kv in content:
            if kv is None or kv.namespace != namespace or kv.key != key or not kv.complete:
                what = "no KV" if kv is None else f"KV of {kv.namespace}:{kv.key!r} by {kv.writer} " \
                    f"step {kv.step}{'' if kv.complete else ' (torn)'}"
                w.violation(f"tier: block {key!r} of {namespace} {whence} holding {what}")
            elif id(kv) in self.stale:
                of = "written from a staged copy of" if staged else "demoted from"
                w.violation(f"tier: block {key!r} of {namespace} {of} KV invalidated (by {kv.writer} step {kv.step})")
            elif id(kv) in self.superseded and staged and not current:
                w.counts["tier_staged_superseded"] += 1
            elif id(kv) in self.superseded:
                w.violation(f"tier: block {key!r} of {namespace} {whence if staged else 'demoted from'} "
                            f"{'of ' if staged else ''}KV written before its namespace was invalidated (by "
                            f"{kv.writer} step {kv.step})")

    def whole(self, namespace: str, key: bytes, content: tuple[KV | None, ...]) -> bool:
        """The content is what ``check_content`` lets a staged copy write."""
        return all(kv is not None and kv.namespace == namespace and kv.key == key and kv.complete
                   and id(kv) not in self.stale and id(kv) not in self.superseded for kv in content)

    # ----------------------------------------------------- source B
    def stage(self, e: fx.DemoteBlocks) -> list[fx.Effect]:
        """A running engine's demoted blocks copied into staging, unchecked:
        whether a copy is whole is the engine's next journal's to say."""
        w, device = self.world, self.world.device
        done: list[int] = []
        failed: list[tuple[int, str]] = []
        for block in e.blocks:
            if self.rng.random() < READ_FAILS:
                failed.append((block.slot, "io"))
                w.counts["tier_staged_read_failed"] += 1
                continue
            content = tuple(device.kv.get((page, within // BLOCK_BYTES)) for _dev, page, within, _n in block.runs)
            copy = StagedCopy(e.namespace, block, content, self.invalidated[e.namespace],
                              self.whole(e.namespace, block.key, content))
            self.staged[block.slot] = copy
            if not copy.whole:
                w.counts["tier_staged_torn"] += 1       # copied after the engine rewrote it (or invalidated)
            done.append(block.slot)
        w.counts["tier_staged"] += len(done)
        return w.call(w.allocator.tier_copied, done, failed, w.now)

    def write_staged(self, e: fx.WriteStaged) -> list[fx.Effect]:
        """The copies found whole written (and checked as a demotion is), the others discarded."""
        w = self.world
        for slot in e.drop:
            copy = self.staged.pop(slot, None)
            self.cancelled.discard(slot)
            w.counts["tier_staged_dropped"] += 1
            if copy is not None and not copy.whole:
                w.counts["tier_staged_torn_dropped"] += 1   # the ack rule kept a torn copy off the disk
        done: list[int] = []
        cancelled: list[int] = []
        failed: list[tuple[int, str]] = []
        for slot in e.write:
            copy = self.staged.pop(slot, None)
            if copy is None and slot in self.cancelled:
                self.cancelled.discard(slot)
                cancelled.append(slot)          # reported done: its dead entry is freed, nothing written
                w.counts["tier_staged_cancelled"] += 1
                continue
            if copy is None:
                w.violation(f"tier: slot {slot} written from staging, where no copy of it is")
                failed.append((slot, "io"))
                continue
            block = copy.block
            # Copied before its namespace was invalidated: the slot died with
            # it (committed, it is freed and its file deleted; never served,
            # which ``check_served`` holds to, a restart in between included).
            # Copied after: the engine had to clear its keys first.
            current = copy.epoch == self.invalidated[copy.namespace]
            if not current:
                w.counts["tier_staged_written_invalidated"] += 1
            self.check_content(copy.namespace, block.key, copy.content, staged=True, current=current)
            if self.rng.random() < DISK_FULL:
                failed.append((slot, "disk_full"))
                w.counts["tier_disk_full"] += 1
                continue
            nbytes = sum(n for _dev, _page, _within, n in block.runs)
            self.store[slot] = Stored(copy.namespace, block.key, block.parent, block.cost, nbytes, copy.content,
                                      copy.epoch, torn=self.rng.random() < TORN, evicted=True)
            done.append(slot)
        w.counts["tier_staged_written"] += len(done)
        return w.call(w.allocator.tier_written, done + cancelled, failed, w.now)

    def tally(self) -> None:
        """The index's source-B counters, into the world's (each index counts from zero)."""
        stats, w = self.index.stats, self.world
        for name, n in (("tier_staged_committed", stats.demotions_evicted),
                        ("tier_staged_raced", stats.failures.get("raced", 0)),
                        ("tier_staged_unconfirmed", stats.failures.get("unconfirmed", 0))):
            if n > self.tallied[name]:
                w.counts[name] += n - self.tallied[name]
                self.tallied[name] = n

    def read(self, e: fx.ReadTierBlock) -> list[fx.Effect]:
        """A fetch: the block's bytes (here: its content checked) or its failure."""
        w = self.world
        b = self.store.get(e.slot)
        error = ""
        if b is None:
            w.violation(f"tier: lease {e.lease} fetches slot {e.slot}, whose bytes were deleted")
            error = "io"
        elif (b.namespace, b.key) != (e.namespace, e.key):
            error = "identity"
        elif b.torn:
            error = "torn"
            w.counts["tier_torn"] += 1
        else:
            self.check_served(e, b)
            if b.evicted and e.offset + e.chunk >= b.nbytes:
                w.counts["tier_promoted_evicted"] += 1      # demoted from a running engine, loaded back
        size = -1 if error or b is None else b.nbytes
        finished = size < 0 or e.offset + e.chunk >= size
        reply = p.TierData(req_id=e.req_id, lease=e.lease, block=e.block, offset=e.offset, size=size, data=b"")
        follow = w.call(w.allocator.tier_read, e.lease, e.block, error, w.now) if finished else []
        return [fx.Send(e.to, reply), *follow]

    def check_served(self, e: fx.ReadTierBlock, b: Stored) -> None:
        w = self.world
        if b.epoch != self.invalidated[b.namespace]:
            restored = " (restored by a new daemon)" if e.slot in self.restored_invalidated else ""
            w.violation(f"tier: slot {e.slot} ({b.namespace}:{b.key!r}) served after its namespace was "
                        f"invalidated (lease {e.lease}){restored}")
        load = self.loads.get(e.to)
        if load is not None and load.lease == e.lease and load.namespace != e.namespace:
            w.violation(f"tier: an engine of {load.namespace} is served block {e.key!r} of {e.namespace}")
        for kv in b.content:
            if kv is None or kv.namespace != e.namespace or kv.key != e.key or not kv.complete:
                w.violation(f"tier: slot {e.slot} served as {e.namespace}:{e.key!r} holds other KV")
                return

    # ------------------------------------------------------------ engines
    def step(self) -> None:
        """The tier's part of a simulated step, on its own draws."""
        w, rng = self.world, self.rng
        if w.stopped:
            return
        r = rng.random()
        if r < LOOKUP:
            self.lookup(rng.choice(list(w.engines)))
        elif r < LOOKUP + KILL:
            holding = [e for e in w.engines if e.alive and (load := self.loads.get(e.identity)) and load.lease]
            if holding:
                engine = rng.choice(holding)
                engine.crash()                 # mid-lease: the daemon must end its lease with it
                w.restart_at[engine.name] = w.now + rng.uniform(0.1, 2.0)
                w.counts["tier_kill_mid_lease"] += 1
        elif r < LOOKUP + KILL + INVALIDATE:
            self.invalidate()

    def lookup(self, engine: SimEngine) -> None:
        """A device miss: the engine asks the tier for the rest of a prompt's keys."""
        if not engine.alive or not engine.registered or engine.dying or engine.leaving \
                or engine.identity in self.loads:
            return
        rng = self.rng
        held = sorted(self.index._keys.get(engine.namespace, {}))     # mostly a prompt the tier holds a part of
        if held and rng.random() < 0.7:
            _ns, prompt_s, first_s = rng.choice(held).decode().rsplit(":", 2)
            prompt, first = int(prompt_s), int(first_s)      # the prefix before it was on the device
        else:
            prompt, first = rng.randrange(12), 0
        keys = [engine.key(prompt, i) for i in range(first, first + rng.randint(1, 6))]
        keys = keys[len(engine.pool.lookup(keys)):]
        if keys:
            req = engine.send(p.TierLookup(engine_id=engine.name, keys=keys))
            self.loads[engine.identity] = Load(engine.identity, engine.namespace, keys, req)

    def on_reply(self, engine: SimEngine, msg: p.Msg) -> bool:
        """A message to ``engine``: True when it is the tier's (taken here)."""
        load = self.loads.get(engine.identity)
        if load is None or msg.req_id != load.req:
            return isinstance(msg, (p.TierPinned, p.TierData))
        w, rng = self.world, self.rng
        if isinstance(msg, p.TierPinned) and msg.lease:
            load.lease, load.nbytes = msg.lease, list(msg.nbytes)
            x = rng.random()
            if msg.nbytes[0] != engine.block_bytes:   # another layout of its namespace: not loaded (as the connector)
                w.counts["tier_other_layout"] += 1
                self.release(engine, load)
            elif x < ABANDON:
                load.abandoned = True          # never fetched nor released: its deadline ends it
                w.counts["tier_lease_abandoned"] += 1
            elif x < ABANDON + RELEASE:
                self.release(engine, load)
            else:
                self.fetch(engine, load, 0)
            return True
        if isinstance(msg, p.TierData):
            if msg.size >= 0 and (msg.block != load.block or msg.size != load.nbytes[load.block]):
                w.violation(f"tier: engine {engine.name} asked for block {load.block} of lease {load.lease} "
                            f"({load.nbytes[load.block]} bytes), got block {msg.block} of {msg.size}")
            if msg.size >= 0 and msg.offset + tiering.CHUNK < msg.size:
                self.fetch(engine, load, msg.offset + tiering.CHUNK)
                return True
            w.counts["tier_promoted" if msg.size >= 0 else "tier_dropped_at_fetch"] += 1
            load.block += 1
            if load.block < len(load.nbytes) and load.nbytes[load.block] != engine.block_bytes:
                w.counts["tier_other_layout"] += 1
                self.release(engine, load)
            elif load.block >= len(load.nbytes):
                del self.loads[engine.identity]       # the daemon ended the lease with its last block
            elif rng.random() < RELEASE / 2:
                self.release(engine, load)
            else:
                self.fetch(engine, load, 0)
            return True
        del self.loads[engine.identity]               # a miss, an Error, the Ok of a release
        return True

    def fetch(self, engine: SimEngine, load: Load, offset: int) -> None:
        load.req = engine.send(p.TierFetch(engine_id=engine.name, lease=load.lease, block=load.block, offset=offset))

    def release(self, engine: SimEngine, load: Load) -> None:
        load.req = engine.send(p.TierRelease(engine_id=engine.name, lease=load.lease))
        self.world.counts["tier_released"] += 1

    def invalidate(self) -> None:
        """``kvelastic invalidate``, mostly of a namespace with tier blocks."""
        w = self.world
        in_tier = sorted(self.index.namespaces())
        names = in_tier if in_tier and self.rng.random() < 0.8 else sorted({e.namespace for e in w.engines})
        target = self.rng.choice(names)
        # Its KV that the daemon could still demote never reaches the tier:
        # kept cache's, and that of slabs given up by its running engines and
        # unmapping, noted for the tier. (The rest is the engines' own to
        # clear, and the sim's engines ignore ``ClearIndex``: KV they go on
        # caching, in a slab a reclaim asked for and they kept included, is
        # not checked here.)
        alloc = w.allocator
        going = {page for slab in alloc.orphans if slab.namespace == target for page in slab.pages}
        for engine in alloc.engines.values():
            if target in (engine.namespace, engine.engine_id):
                going.update(page for slab in engine.slabs.values()
                             if slab.phase is Phase.UNMAPPING and slab.handoff_to == tiering.TO_TIER
                             for page in slab.pages)
        for page in going:
            for offset in range(BLOCKS_PER_SLAB):
                kv = w.device.kv.get((page, offset))
                if kv is not None:
                    self.stale[id(kv)] = kv
        if w.evictions:
            # The engines registered in it are told to clear their keys
            # (``ClearIndex``): none of their KV reaches the tier or another
            # engine from now on. (An engine on its way to a registration
            # hears none: what it caches is not checked,
            # ``tier_invalidated_unregistered`` counts them.)
            for sim in w.engines:
                record = alloc.engines.get(sim.name)
                told = sim.alive and record is not None and record.identity == sim.identity \
                    and record.namespace == target
                if not told and sim.alive and sim.namespace == target:
                    w.counts["tier_invalidated_unregistered"] += 1
                for worker in sim.workers if told else ():
                    for page in {page for pages in worker.mapped.values() for page in pages}:
                        for offset in range(BLOCKS_PER_SLAB):
                            kv = w.device.kv.get((page, offset))
                            if kv is not None and kv.namespace == target:
                                self.superseded[id(kv)] = kv
        self.invalidated[target] += 1
        self.leased_through_invalidation.update(lease.lease for lease in w.allocator.tiering.leases.values()
                                                if lease.namespace == target)
        w.counts["tier_invalidated" if target in in_tier else "invalidated"] += 1
        effects = w.call(w.allocator.handle, b"kvelastic-cli", p.Invalidate(target=target), w.now)
        if any(isinstance(x, fx.DemoteBlocks) for x in effects):
            w.violation(f"tier: invalidating {target} demoted blocks")
        w.perform(effects)

    # ------------------------------------------------------------- checks
    def check(self) -> None:
        w, index, alloc = self.world, self.index, self.world.allocator
        if w.stopped or alloc.books.tier is not index:
            return
        try:
            index.check()
        except InvariantViolation as exc:
            w.violation(f"tier index: {exc}")
        if index.bytes_used > index.budget_bytes:
            w.violation(f"tier: {index.bytes_used} bytes in use > budget {index.budget_bytes}")
        seen: dict[tuple[str, bytes], int] = {}
        for slot, entry in index._entries.items():       # every entry, not the key map the index checks
            if not entry.dead:
                if (entry.namespace, entry.key) in seen:
                    w.violation(f"tier: {entry.namespace}:{entry.key!r} in live slots "
                                f"{seen[(entry.namespace, entry.key)]} and {slot}")
                seen[(entry.namespace, entry.key)] = slot
        leases = alloc.tiering.leases
        for lease in leases.values():
            record = alloc.engines.get(lease.engine_id)
            if record is None or record.serial != lease.serial:
                w.violation(f"tier: lease {lease.lease} outlived its engine {lease.engine_id}")
            elif self.last_tick > lease.deadline:     # a tick after its deadline ends it
                w.violation(f"tier: lease {lease.lease} of {lease.engine_id} outlived its deadline "
                            f"({lease.deadline:.3f}; ticked at {self.last_tick:.3f})")
            for slot, done in zip(lease.slots, lease.done):
                if not done and slot not in index._entries:
                    w.violation(f"tier: slot {slot} of lease {lease.lease} freed while pinned")
                elif not done and index.servable(slot) and slot not in self.store:
                    w.violation(f"tier: live slot {slot} of lease {lease.lease}: its file deleted while pinned")
        self.check_staging()
        self.tally()
        for identity, load in list(self.loads.items()):
            if identity not in w.wires:       # the engine died
                if load.lease:
                    w.counts["lease_engine_died"] += 1
                del self.loads[identity]
            elif load.lease and load.lease not in leases:
                if load.abandoned:
                    w.counts["lease_expired"] += 1
                    del self.loads[identity]

    def check_staging(self) -> None:
        """Source B's books: staged bytes within the room and what the copies
        add up to; every pending copy staged by the loop; none outlives its
        engine's registration, nor its deadline past a tick."""
        w, st = self.world, self.world.allocator.staging
        if st.staged_bytes > staging.MAX_STAGED_BYTES:
            w.violation(f"tier: {st.staged_bytes} bytes staged > {staging.MAX_STAGED_BYTES}")
        if st.staged_bytes != sum(c.nbytes for c in st.copies.values()):
            w.violation(f"tier: {st.staged_bytes} bytes staged, the copies add up to "
                        f"{sum(c.nbytes for c in st.copies.values())}")
        serials = {record.serial: record.engine_id for record in w.allocator.engines.values()}
        for slot, c in st.copies.items():
            if c.serial not in serials:
                w.violation(f"tier: copy of block {c.block} (slot {slot}, ticket {c.ticket}) outlived its "
                            f"engine's registration {c.serial}")
            elif self.last_tick > c.deadline:
                w.violation(f"tier: copy of block {c.block} of {serials[c.serial]} (slot {slot}) outlived its "
                            f"deadline ({c.deadline:.3f}; ticked at {self.last_tick:.3f})")
            if slot not in self.staged and slot not in self.cancelled:
                w.violation(f"tier: copy of block {c.block} (slot {slot}) pending, not in the loop's staging")

    def settled(self) -> None:
        """Every engine left: no lease is left, nothing is pinned."""
        leases = self.world.allocator.tiering.leases
        if leases:
            self.world.violation(f"tier: leases {sorted(leases)} left after every engine exited")
        copies = self.world.allocator.staging.copies
        if copies or self.staged:
            self.world.violation(f"tier: copies {sorted(copies)} pending, {sorted(self.staged)} staged after "
                                 "every engine exited")
