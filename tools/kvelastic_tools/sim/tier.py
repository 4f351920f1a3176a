"""The node's tier in the simulator: a real ``TierIndex`` with a
small budget, handed to the ``Allocator`` as the daemon does, and the loop's
side of it played here as ``world.py`` plays the rest of the loop.

The disk is ``tier_writer.py``'s: a store that remembers the KV each block
held when the loop read it, and the writer thread as the daemon has it (a
FIFO of writes that end later, reported at the loop's next pass; a delete
cancels a write queued; a graceful stop writes what is queued, a kill -9
loses it). A new daemon rebuilds its index from the store with the real
``tier.restart.rebuild``, and restores nothing of a namespace invalidated
(and answered) before the stop.

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
granted before it, nor from a file a new daemon restored: none is
restored); KV the daemon held for demotion when its namespace was
invalidated (kept cache, a running engine's slab being reclaimed) is never
demoted; no lease outlives its engine or its deadline.

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
cache demoted and slabs adopted too) and hands it to the writer; what it
drops is discarded, a copy deleted meanwhile (its entry died) is reported
written at once. Invariants: staged bytes within ``MAX_STAGED_BYTES`` (compressed
here, as the copy deadline is: ``small_staging``) and equal to the copies'
sum; every pending copy staged by the loop; no copy outlives its engine's
registration, nor its deadline past a tick.

The writer's invariants are ``tier_writer.py``'s. ``kvelastic invalidate``
comes often while writes of its namespace are in flight, now and then
followed at once by a graceful stop or a kill -9 (``INVALIDATE_WRITING``,
``STOP_AFTER``: the audit's case). It is final once answered (its files go
before the reply); one whose daemon was killed before it answered is not:
what it did not tell goes on as before it.

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
from kvelastic.daemon.state import Phase, Way
from kvelastic.errors import InvariantViolation
from kvelastic.tier.index import TierIndex
from kvelastic.tier.restart import rebuild
from kvelastic.vmm.base import DEFAULT_PAGE_SIZE as PAGE
from kvelastic_tools.sim.engine import SimEngine
from kvelastic_tools.sim.records import BLOCKS_PER_SLAB, KV, Device
from kvelastic_tools.sim.tier_loads import TierLoads
from kvelastic_tools.sim.tier_writer import SimStore, SimWriter, Stored, WriteJob, check_restored

BLOCK_BYTES = PAGE // BLOCKS_PER_SLAB      # a block's bytes in each worker's page (``SimEngine.block_bytes``)
BUDGET_BLOCKS = 10                 # the tier's budget, in one-worker blocks: evictions happen within a run
TIER_ORPHAN_TTL = 1.0             # kept cache's TTL in a seed with a tier: released (demoted) within a run
LEASE_TIMEOUT = 1.0                # the sim's lease deadline (the daemon's is 30 s): abandoned leases end in a run
# Per step, on the tier's own draw: an engine looks up (on a miss), an engine
# holding a lease is killed, an invalidation; one of a namespace whose
# writes are in flight (when some are), followed at once by a graceful stop
# below STOP_AFTER, by a kill -9 below twice that.
LOOKUP, KILL, INVALIDATE, INVALIDATE_WRITING = 0.1, 0.006, 0.006, 0.1
STOP_AFTER = 0.25
CLI = b"kvelastic-cli"             # the operator's ``kvelastic invalidate``: its answer makes it final
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

    def restart_daemon(self, corrupt: SimEngine | None = None, kill: bool = False) -> None: ...

    def violation(self, what: str) -> None: ...


@dataclasses.dataclass(eq=False)
class StagedCopy:
    """Source B: a running engine's block copied into the loop's staging."""

    namespace: str
    block: fx.DemoteBlock
    content: tuple[KV | None, ...]     # the device's KV in the block's places when copied
    epoch: int                         # its namespace's invalidations before it was copied
    whole: bool                        # the content was that key's, whole, when copied


class SimTier:
    def __init__(self, world: TierWorld, seed: int) -> None:
        self.world = world
        self.rng = random.Random(seed * 1_000_003 + 43)     # its own draws: the world's stream is unchanged
        self.store: dict[int, Stored] = {}
        # The disk's writer, on draws of its own: its pace moves neither stream.
        self.writer = SimWriter(self.store, random.Random(seed * 1_000_003 + 47), world)
        self.index = TierIndex(BUDGET_BLOCKS * BLOCK_BYTES)
        self.invalidated: collections.Counter[str] = collections.Counter()   # namespace -> invalidations
        self.final: collections.Counter[str] = collections.Counter()   # namespace -> of those, the answered ones
        self.answering = ""                # the namespace of the invalidation whose answer is due
        self.told: set[bytes] = set()      # the engines sent its ``ClearIndex`` meanwhile
        self.stale: dict[int, KV] = {}     # KV on the device when its namespace was invalidated (by id; held)
        self.loading = TierLoads(world, self.rng)    # engines' lookups and leases (``tier_loads.py``)
        self.leased_through_invalidation: set[int] = set()   # leases held when their namespace was invalidated
        self.restored_invalidated: set[int] = set()          # slots of invalidated blocks a new daemon restored
        self.last_tick = 0.0               # when the allocator last ticked (``run.tick``): leases expire then
        self.staged: dict[int, StagedCopy] = {}   # source B: the loop's staging (``TierIO.staged``)
        self.unstaged: set[int] = set()           # staged copies deleted (their entry died) before written
        # KV on the device when its namespace was invalidated (by id; held): a
        # running engine clears its keys (``ClearIndex``), so none is written to the tier after.
        self.superseded: dict[int, KV] = {}
        self.tallied: collections.Counter[str] = collections.Counter()   # the index's counters counted so far

    def new_index(self) -> TierIndex:
        """A daemon starts: its index rebuilt from the store, as ``main.open_tier``
        does (the last one's writer stopped: ``stop``)."""
        self.tally()
        self.index = TierIndex(BUDGET_BLOCKS * BLOCK_BYTES)
        self.tallied.clear()
        self.staged.clear()                # the loop's staging went with the daemon
        self.unstaged.clear()
        if self.writer.in_flight():
            self.world.violation("tier: a new daemon starts while its predecessor's writer holds writes")
        if self.store:
            rebuild(self.index, SimStore(self.store), self.world.now)   # type: ignore[arg-type]
            self.world.counts["tier_rebuilt"] += 1
            self.restored_invalidated |= check_restored(self.world, self.store, self.invalidated, self.final,
                                                        self.writer.stopped_by)
        self.loading.loads.clear()         # the leases went with the daemon
        self.leased_through_invalidation.clear()
        return self.index

    def stop(self, graceful: bool) -> None:
        """The daemon stops (``World.restart_daemon``): its writer with it."""
        self.writer.stop(graceful, self.invalidated)

    def pump(self) -> None:
        """Each step: the writer writes, the loop takes what it wrote."""
        self.writer.pump(self.index)

    def sent(self, to: bytes, msg: p.Msg) -> None:
        """While an invalidation's effects are performed (``World.send``): the
        operator heard its answer (it is final), or an engine its ``ClearIndex``."""
        if to == CLI:
            self.final[self.answering] = self.invalidated[self.answering]
            self.answering = ""
        elif isinstance(msg, p.ClearIndex):
            self.told.add(to)

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
            self.delete(e.slots)
            return self.world.allocator.tier_deleted(e.slots)    # as the loop: announced ones published removed
        return []

    def delete(self, slots: tuple[int, ...]) -> None:
        """``TierIO.delete``: a dead slot's file may go while pinned (it is
        never served again); a live one's never, while a lease may still
        fetch it. A staged copy or a write queued of it never reaches the
        disk, a file written but not reported yet goes too; neither may be
        a live entry's."""
        w = self.world
        held = {s for lease in w.allocator.tiering.leases.values() for s, done in zip(lease.slots, lease.done)
                if not done}
        for slot in slots:
            if slot in held and self.index.servable(slot):
                w.violation(f"tier: live slot {slot} deleted while a lease holds it")
            self.writer.delete(slot, self.index)
            copy = self.staged.pop(slot, None)
            if copy is not None:             # never written
                self.unstaged.add(slot)
                if not copy.whole:
                    w.counts["tier_staged_torn_dropped"] += 1   # kept off the disk by its death

    def demote(self, e: fx.DemoteBlocks) -> list[fx.Effect]:
        """Kept cache or a reclaimed slab: each block read now (checked) and handed to the writer."""
        device = self.world.device
        for block in e.blocks:
            content = tuple(device.kv.get((page, within // BLOCK_BYTES)) for _dev, page, within, _n in block.runs)
            self.check_content(e.namespace, block.key, content)
            nbytes = sum(n for _dev, _page, _within, n in block.runs)
            self.writer.submit(WriteJob(block.slot, Stored(e.namespace, block.key, block.parent, block.cost, nbytes,
                                                           content, self.invalidated[e.namespace]), staged=False))
        return []    # the writes' reports come later (``pump``)

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
        """The copies found whole handed to the writer (checked as a demotion
        is), the others discarded; one deleted meanwhile (its entry died) is
        reported written at once, with nothing written (``TierIO.write_staged``)."""
        w = self.world
        for slot in e.drop:
            copy = self.staged.pop(slot, None)
            self.unstaged.discard(slot)
            w.counts["tier_staged_dropped"] += 1
            if copy is not None and not copy.whole:
                w.counts["tier_staged_torn_dropped"] += 1   # the ack rule kept a torn copy off the disk
        cancelled: list[int] = []
        failed: list[tuple[int, str]] = []
        for slot in e.write:
            copy = self.staged.pop(slot, None)
            if copy is None and slot in self.unstaged:
                self.unstaged.discard(slot)
                cancelled.append(slot)          # reported done: its dead entry is freed, nothing written
                w.counts["tier_staged_cancelled"] += 1
                continue
            if copy is None:
                w.violation(f"tier: slot {slot} written from staging, where no copy of it is")
                failed.append((slot, "io"))
                continue
            block = copy.block
            # Copied before its namespace was invalidated: the slot died with
            # it (its copy deleted then: never written, never served, which
            # ``check_served`` holds to, a restart in between included).
            # Copied after: the engine had to clear its keys first.
            current = copy.epoch == self.invalidated[copy.namespace]
            if not current:
                w.counts["tier_staged_written_invalidated"] += 1
            self.check_content(copy.namespace, block.key, copy.content, staged=True, current=current)
            nbytes = sum(n for _dev, _page, _within, n in block.runs)
            self.writer.submit(WriteJob(slot, Stored(copy.namespace, block.key, block.parent, block.cost, nbytes,
                                                     copy.content, copy.epoch, evicted=True), staged=True))
        return w.call(w.allocator.tier_written, cancelled, failed, w.now) if cancelled or failed else []

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
        load = self.loading.loads.get(e.to)
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
            self.loading.lookup(rng.choice(list(w.engines)), self.index)
        elif r < LOOKUP + KILL:
            holding = [e for e in w.engines if e.alive and (load := self.loading.loads.get(e.identity)) and load.lease]
            if holding:
                engine = rng.choice(holding)
                engine.crash()                 # mid-lease: the daemon must end its lease with it
                w.restart_at[engine.name] = w.now + rng.uniform(0.1, 2.0)
                w.counts["tier_kill_mid_lease"] += 1
        elif r < LOOKUP + KILL + INVALIDATE:
            self.invalidate()
        elif r < LOOKUP + KILL + INVALIDATE + INVALIDATE_WRITING:
            self.invalidate_writing()

    def writing(self) -> list[WriteJob]:
        """The writes in flight (queued, or written and not reported) of
        blocks whose namespace was not invalidated since they were read."""
        return [job for job in self.writer.in_flight()
                if job.block.epoch == self.invalidated[job.block.namespace] and not job.cancelled]

    def invalidate_writing(self) -> None:
        """The audit's case: ``kvelastic invalidate`` of a namespace whose
        blocks the writer holds (queued, or written and not reported yet),
        now and then followed at once by a graceful stop or a kill -9."""
        w, rng = self.world, self.rng
        writing = sorted({job.block.namespace for job in self.writing()})
        if not writing:
            return
        self.invalidate(rng.choice(writing))
        x = rng.random()
        if x < 2 * STOP_AFTER and not w.stopped:
            w.counts["tier_stop_after_invalidation" if x < STOP_AFTER else "tier_crash_after_invalidation"] += 1
            w.restart_daemon(kill=x >= STOP_AFTER)

    def on_reply(self, engine: SimEngine, msg: p.Msg) -> bool:
        """A message to ``engine``: True when it is the tier's (``TierLoads.on_reply``)."""
        return self.loading.on_reply(engine, msg)

    def invalidate(self, target: str = "") -> None:
        """``kvelastic invalidate`` (of ``target``), mostly of a namespace with tier blocks."""
        w = self.world
        in_tier = sorted(self.index.namespaces())
        if not target:
            names = in_tier if in_tier and self.rng.random() < 0.8 else sorted({e.namespace for e in w.engines})
            target = self.rng.choice(names)
        if any(job.block.namespace == target for job in self.writing()):
            w.counts["tier_invalidated_with_writes_queued"] += 1
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
                             if slab.phase is Phase.UNMAPPING and slab.route.way is Way.TIER
                             for page in slab.pages)
        marked: dict[bytes, list[int]] = {CLI: []}   # what this one marks, by whom told (CLI: the daemon)
        for page in going:
            for offset in range(BLOCKS_PER_SLAB):
                kv = w.device.kv.get((page, offset))
                if kv is not None and id(kv) not in self.stale:
                    self.stale[id(kv)] = kv
                    marked[CLI].append(id(kv))
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
                            if kv is not None and kv.namespace == target and id(kv) not in self.superseded:
                                self.superseded[id(kv)] = kv
                                marked.setdefault(sim.identity, []).append(id(kv))
        self.invalidated[target] += 1
        self.leased_through_invalidation.update(lease.lease for lease in w.allocator.tiering.leases.values()
                                                if lease.namespace == target)
        w.counts["tier_invalidated" if target in in_tier else "invalidated"] += 1
        effects = w.call(w.allocator.handle, CLI, p.Invalidate(target=target), w.now)
        if any(isinstance(x, fx.DemoteBlocks) for x in effects):
            w.violation(f"tier: invalidating {target} demoted blocks")
        self.answering, self.told = target, set()    # final once its answer is sent (``sent``)
        w.perform(effects)
        if self.answering:
            # The daemon was killed before it answered: not final. What it
            # did not tell goes on as before it (an engine not sent its
            # ``ClearIndex`` keeps its keys; the kept cache is the state
            # file's, written before it), as the operator heard no answer.
            w.counts["tier_invalidation_unanswered"] += 1
            self.answering = ""
            for whom, ids in marked.items():
                for kv_id in ids if whom not in self.told else ():
                    (self.stale if whom == CLI else self.superseded).pop(kv_id, None)

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
        pins = index.pins
        for uid, held in pins.tenants.items():       # two tenants share the tier (``World.cred_of``)
            if uid is not None and (held.pins > pins.max_pins or (
                    held.pins > 1 and held.nbytes > int(index.budget_bytes * pins.share))):
                w.violation(f"tier: uid {uid} pins {held.pins} block(s) of {held.nbytes} bytes, past its share")
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
        self.writer.check(index, {*self.staged, *self.unstaged, *alloc.staging.copies})
        self.tally()
        self.loading.check(leases)

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
            if slot not in self.staged and slot not in self.unstaged:
                w.violation(f"tier: copy of block {c.block} (slot {slot}) pending, not in the loop's staging")

    def settled(self) -> None:
        """Every engine left: no lease is left, nothing is pinned. (And what the
        tenants' shares refused, counted: ``World.cred_of``'s two uids.)"""
        leases = self.world.allocator.tiering.leases
        tier = self.world.allocator.books.tier
        for reason, n in (tier.stats.refused.items() if tier is not None else ()):
            self.world.counts[f"tier_refused_{reason}"] += n
        if leases:
            self.world.violation(f"tier: leases {sorted(leases)} left after every engine exited")
        if self.writer.in_flight():
            self.world.violation(f"tier: writes of slots {sorted(self.writer.slots())} in flight after every "
                                 "engine exited")
        copies = self.world.allocator.staging.copies
        if copies or self.staged:
            self.world.violation(f"tier: copies {sorted(copies)} pending, {sorted(self.staged)} staged after "
                                 "every engine exited")
