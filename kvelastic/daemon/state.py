"""The daemon's books: pages, slabs, engines, budgets. No I/O.

The allocator (``allocator.py``) decides with these records; the loop
(``server.py``) keeps the backend handle of each page id.

Page states (invariant 1: every page is in exactly one):
    free                in ``PagePool.free`` (tagged with its last owner)
    in a slab           ``SlabRecord.pages`` of exactly one engine record's
                        slab, whatever the slab's phase:
                        mapping -> held -> unmapping -> (pages back to free)
    orphaned            in one ``OrphanSlab`` (``orphans.py``): a departed
                        engine's cache, mapped by no process, kept for the
                        next engine of its namespace
Budget (invariant 2): pages created + being created + adopted after a
restart never exceed ``budget_pages``; an engine's slabs never exceed its
``max_slabs``. A free page is reused only by its last owner (or when clean):
anyone else gets a fresh page (invariant 6).
"""

from __future__ import annotations

import dataclasses
import enum
import heapq
import itertools
from collections.abc import ItemsView, Iterator, KeysView, MutableMapping, ValuesView

from kvelastic import protocol as p
from kvelastic.core.journal import ADD_SLAB, JournalBatch, Mirror
from kvelastic.errors import require
from kvelastic.status_report import DeviceStatus, MemoryStatus, PageCounts


class Phase(enum.Enum):
    MAPPING = "mapping"       # pages sent to workers, not every ack in yet
    HELD = "held"             # granted to the engine's pool
    UNMAPPING = "unmapping"   # taken back, waiting for every worker's unmap ack


class Way(enum.Enum):
    """Where a slab's cached blocks go with its pages (``Route``)."""
    NOWHERE = "nowhere"       # its pages go back fresh for anyone else
    NOTED = "noted"           # asked for by a reclaim: its valid blocks now, the tier's if it is given up
    REPLICA = "replica"       # given up for a grow of an engine of its namespace: pages and KV go to it
    TIER = "tier"             # given up, no replica takes it: its blocks go into the tier once unmapped
    ADOPTED = "adopted"       # on the receiver: mapped with its KV, its blocks adopted at the grant


@dataclasses.dataclass(frozen=True)
class Route:
    """A slab's route: where its cached blocks go (``blocks``; ``grow``: the
    seq of the grow a REPLICA route serves). Set only through ``SlabRecord``'s
    transitions below, each checking where it may come from."""
    way: Way = Way.NOWHERE
    blocks: tuple[p.CachedBlock, ...] = ()
    grow: int = -1


NO_ROUTE = Route()


@dataclasses.dataclass
class SlabRecord:
    slab_id: int
    pages: list[int]                   # empty for an adopted slab
    page_devices: list[str]            # the device of each page
    phase: Phase
    waiting: set[int]                  # worker ranks whose ack is still due
    asked: set[int] = dataclasses.field(default_factory=set)   # ranks sent its unmap (a late ack counts)
    adopted_pages: int = 0             # pages that exist only in the engine's workers
    failed: bool = False               # a worker could not map it: it goes straight back
    return_req: tuple[bytes, int] | None = None  # (client, Return req_id) answered once unmapped
    deadline: float = 0.0              # mapping/unmapping: every ack due by then
    busy_until: dict[int, float] = dataclasses.field(default_factory=dict)  # rank -> its ack due (``Busy``)
    late_grant: bool = False           # its grow was answered before it was mapped
    # Where its cached blocks go with its pages (``Route``): on the giver's
    # record, to a replica's grow or the tier; on the receiver's, adopted at
    # the grant. Written only by the transitions below.
    route: Route = NO_ROUTE
    orphan: bool = False               # its engine left: once unmapped, its valid blocks stay as cache

    # Routes: NOWHERE -> NOTED (a reclaim asked) -> REPLICA | TIER | NOWHERE
    # (given up) or -> NOWHERE (refused); NOWHERE -> ADOPTED (mapped with KV)
    # -> NOWHERE (granted). An invalidation empties the blocks, not the way.
    def note(self, valid: tuple[p.CachedBlock, ...]) -> None:
        """A reclaim asked for this held slab: its valid blocks now."""
        require(self.phase is Phase.HELD, f"slab {self.slab_id}: noted while {self.phase.value}")
        self.route = Route(Way.NOTED, valid)

    @property
    def noted(self) -> tuple[p.CachedBlock, ...]:
        return self.route.blocks if self.route.way is Way.NOTED else ()

    def unnote(self) -> None:
        """Refused, or not answered: held on, nothing noted."""
        if self.phase is Phase.HELD:
            self.route = NO_ROUTE

    def given_up(self, way: Way, blocks: tuple[p.CachedBlock, ...] = (), grow: int = -1) -> None:
        """Given up by a reclaim: its route from here (REPLICA to ``grow``, TIER or NOWHERE)."""
        require(self.phase is Phase.HELD and way in (Way.REPLICA, Way.TIER, Way.NOWHERE)
                and (way is Way.REPLICA) == (grow >= 0), f"slab {self.slab_id}: given up to {way.value} "
                f"for grow {grow} while {self.phase.value}")
        self.route = Route(way, blocks, grow) if way is not Way.NOWHERE else NO_ROUTE

    def adopting(self, blocks: tuple[p.CachedBlock, ...]) -> None:
        """Mapped with its KV (handed on, or kept cache): adopted at the grant
        (held already when no worker had to acknowledge, granted with the grow)."""
        require(self.phase is not Phase.UNMAPPING, f"slab {self.slab_id}: adopting while unmapping")
        self.route = Route(Way.ADOPTED, blocks) if blocks else NO_ROUTE

    def take_adopted(self) -> tuple[p.CachedBlock, ...]:
        """The grant carries its blocks: they are the engine's now."""
        blocks = self.route.blocks if self.route.way is Way.ADOPTED else ()
        if self.route.way is Way.ADOPTED:
            self.route = NO_ROUTE
        return blocks

    def forget_blocks(self) -> None:
        """An invalidation: its blocks may be of before, none travels (its pages still do)."""
        if self.route.blocks:
            self.route = dataclasses.replace(self.route, blocks=())

    # Lifecycle: MAPPING -> HELD -> UNMAPPING -> (gone: pages back to the pool);
    # a slab that failed to map goes MAPPING -> UNMAPPING.
    def mark_held(self) -> None:
        require(self.phase is Phase.MAPPING and not self.failed, f"slab {self.slab_id} is not mapping: {self.phase}")
        self.phase = Phase.HELD

    def begin_unmap(self, waiting: set[int], deadline: float) -> None:
        """Every rank in ``waiting`` must acknowledge the unmap by ``deadline``."""
        self.phase = Phase.UNMAPPING
        self.waiting = waiting
        self.deadline = deadline
        self.busy_until = {}

    def overdue(self, now: float) -> bool:
        """A rank still owes its ack past its deadline (a rank in a long step
        that said ``Busy`` has its own, later one)."""
        return now > self.deadline and any(now > self.busy_until.get(rank, 0.0) for rank in self.waiting)


@dataclasses.dataclass
class EngineRecord:
    engine_id: str
    namespace: str
    pid: int
    page_size: int
    pages_per_worker: int
    num_workers: int
    blocks_per_slab: int
    block_bytes: int
    block_tokens: int
    key_group_suffix: bool
    min_bytes: int
    max_bytes: int
    max_slabs: int
    device: str = ""                                        # where rank-less pages live
    pages_per_region: int = 1                               # consecutive pages of a slab per region
    identity: bytes = b""                                   # ZMQ routing id
    worker_devices: dict[int, str] = dataclasses.field(default_factory=dict)  # rank -> device
    workers: dict[int, bytes] = dataclasses.field(default_factory=dict)  # rank -> routing id
    slabs: dict[int, SlabRecord] = dataclasses.field(default_factory=dict)
    in_flight: set[int] = dataclasses.field(default_factory=set)   # slabs mapping or unmapping
    unmapping: int = 0                                      # slabs unmapping
    mirror: Mirror = dataclasses.field(default_factory=Mirror)
    active: dict[int, float] = dataclasses.field(default_factory=dict)  # slab -> last change
    stats: dict[str, int] = dataclasses.field(default_factory=dict)
    last_seen: float = 0.0
    failed: bool = False                                    # missed a deadline: pages quarantined
    token: bytes = b""                                      # its secret (its workers show it too)
    pending_grows: int = 0
    active_at: float = 0.0                                  # last journal with changes, or demand
    received_from: dict[str, float] = dataclasses.field(default_factory=dict)  # engine -> last move to us
    unresponsive: bool = False                              # heartbeats stopped, lifeline still open
    starved_since: float | None = None                      # its hard demand went unmet since then
    # Slabs it was asked to drain for another engine's demand (``Drain``),
    # and until when: meanwhile, while another engine starves, it grows no
    # further than its fair share.
    draining: set[int] = dataclasses.field(default_factory=set)
    drain_until: float = 0.0
    last_unmet: float = 0.0                                 # the last time it did
    grants: int = 0
    returns: int = 0
    reclaims: int = 0
    kept_keys: set[bytes] = dataclasses.field(default_factory=set)   # keys already kept for its namespace
    private: bool = False          # its weights may differ from its namespace's: no cache given, taken or kept
    scope_changes: int = 0         # invalidations and divergences so far (a reclaim answered before one: stale keys)
    # ``ClearIndex`` sent to it, and the last of them its journals say it
    # applied: while ``clears_heard < clears_sent`` its keys may be of before
    # an invalidation (none is kept, copied to the tier or handed on).
    clears_sent: int = 0
    clears_heard: int = 0
    # This registration, among every one the daemon made: an engine id may be
    # registered again while its last registration still departs (unmapping,
    # quarantined); the two records never alias (``Allocator.departing``).
    serial: int = 0
    uid: int = -1                  # the registering peer's uid (-1: an in-process caller); saved with its slabs
    # Its slabs' pages as the state file saves them (``saved.Saving``): bumped
    # on every slab added or removed; slabs started mapping since the last write.
    lent_changes: int = 0
    lent_new: set[int] = dataclasses.field(default_factory=set)
    # Lowest free slab id in O(log n): ids below ``_top`` freed since, in a heap
    # (stale entries skipped); every id at or above ``_top`` not in ``slabs``.
    _freed: list[int] = dataclasses.field(default_factory=list)
    _top: int = 0

    def __post_init__(self) -> None:
        self.mirror.blocks_per_slab = self.blocks_per_slab

    @property
    def pages_per_slab(self) -> int:
        return self.pages_per_worker * max(1, self.num_workers)

    @property
    def slab_bytes(self) -> int:
        return self.pages_per_slab * self.page_size

    # Activity, starvation, silence: what the grows, the journals, the
    # heartbeats and the tick each learn of an engine, changed only here.
    def touched(self, now: float) -> None:
        """It did block work (a journal says so) or asked on demand."""
        self.active_at = now

    def demand_met(self) -> float | None:
        """A demand was met: no longer starved. Returns since when it was, if it was."""
        since, self.starved_since = self.starved_since, None
        return since

    def demand_unmet(self, started: float, now: float) -> bool:
        """A hard demand went unmet (asked at ``started``). True: it starves from now on."""
        self.last_unmet = now
        if self.starved_since is None:
            self.starved_since = started
            return True
        return False

    def stopped_asking(self, now: float, after: float) -> None:
        """No unmet demand for ``after`` seconds: its demand went away."""
        if self.starved_since is not None and now - self.last_unmet > after:
            self.starved_since = None

    def silent(self, unresponsive: bool) -> bool:
        """Heartbeats stopped (or came again). True when that changed."""
        changed, self.unresponsive = self.unresponsive != unresponsive, unresponsive
        return changed

    def owned_slabs(self) -> int:
        """Slabs that count against the engine's limits (not those on their way out)."""
        return len(self.slabs) - self.unmapping

    # Every phase change goes through these four, which keep ``in_flight``
    # (mapping or unmapping: deadlines to watch) and ``unmapping`` counted,
    # so the allocator never scans every slab of a large node for them.
    def start_mapping(self, slab: SlabRecord) -> None:
        self.slabs[slab.slab_id] = slab
        self.in_flight.add(slab.slab_id)
        self.lent_changes += 1
        self.lent_new.add(slab.slab_id)

    def mark_held(self, slab: SlabRecord) -> None:
        slab.mark_held()
        self.in_flight.discard(slab.slab_id)

    def begin_unmap(self, slab: SlabRecord, waiting: set[int], deadline: float) -> None:
        if slab.phase is not Phase.UNMAPPING:
            self.unmapping += 1
        slab.begin_unmap(waiting, deadline)
        self.in_flight.add(slab.slab_id)

    def remove_slab(self, slab: SlabRecord) -> None:
        del self.slabs[slab.slab_id]
        self.lent_changes += 1
        if slab.slab_id < self._top:
            heapq.heappush(self._freed, slab.slab_id)
        if slab.phase is Phase.UNMAPPING:
            self.unmapping -= 1
        self.in_flight.discard(slab.slab_id)

    def overdue(self, now: float) -> bool:
        """A map or unmap acknowledgement is late."""
        return any(self.slabs[s].overdue(now) for s in self.in_flight)

    def held_bytes(self) -> int:
        return len(self.slabs) * self.slab_bytes

    def cached_bytes(self) -> int:
        return sum(occ[1] for occ in self.mirror.slabs.values()) * self.block_bytes

    def free_slab_id(self) -> int | None:
        """Lowest slab index of the arena not in use (ids are arena positions),
        in O(log n) amortized: a large grow never scans every slab held."""
        freed = self._freed
        while freed and freed[0] in self.slabs:
            heapq.heappop(freed)
        if freed:
            return freed[0]
        while self._top < self.max_slabs and self._top in self.slabs:
            self._top += 1
        return self._top if self._top < self.max_slabs else None

    def worker_offsets(self, slab_id: int, rank: int) -> list[int]:
        """Arena offsets of the slab's pages in one worker (layer-outer regions).

        A worker's arena is ``pages_per_worker / pages_per_region`` regions of
        ``max_slabs * pages_per_region`` pages; a slab has ``pages_per_region``
        consecutive pages in each, at the same place in every region.
        """
        run = self.pages_per_region
        region = self.max_slabs * run * self.page_size
        return [r * region + (slab_id * run + j) * self.page_size
                for r in range(self.pages_per_worker // run) for j in range(run)]

    @property
    def keys_current(self) -> bool:
        """Its mirror's keys are of after its last invalidation (it applied
        every ``ClearIndex`` sent to it)."""
        return self.clears_heard >= self.clears_sent

    def apply_journal(self, batch: JournalBatch, now: float) -> None:
        self.mirror.apply(batch)
        for slab_id in batch.occupancy:
            self.active[slab_id] = now
        # The daemon, not the journal, says which slabs the engine holds
        # (only slabs this batch named can have entered the mirror).
        named = set(batch.occupancy) | {op[1] for op in batch.ops if op[0] == ADD_SLAB}
        for slab_id in named:
            slab = self.slabs.get(slab_id)
            if slab_id in self.mirror.slabs and (slab is None or slab.phase is not Phase.HELD):
                self.mirror.release(slab_id)


class FreePages(MutableMapping[int, str]):
    """``PagePool.free``: page id -> last owner tag ("" when never used), as a
    dict, plus an index by owner kept in step with it, so that finding an
    owner's (or clean) pages costs O(pages wanted), not O(free pages).

    Iteration, ``items()`` and ``values()`` follow the order pages became free
    (as a dict's); each owner's pages are handed out in that order too.
    """

    __slots__ = ("_owner", "_by_owner", "_owned")

    def __init__(self) -> None:
        self._owner: dict[int, str] = {}
        self._by_owner: dict[str, dict[int, None]] = {}    # owner -> its free pages, in order
        self._owned: dict[int, None] = {}                   # pages with an owner ("" excluded), in order

    def __getitem__(self, page: int) -> str:
        return self._owner[page]

    def __setitem__(self, page: int, owner: str) -> None:
        old = self._owner.get(page)
        if old is not None:
            if old == owner:
                return
            self._unindex(page, old)
        self._owner[page] = owner
        mine = self._by_owner.get(owner)
        if mine is None:
            mine = self._by_owner[owner] = {}
        mine[page] = None
        if owner:
            self._owned[page] = None

    def __delitem__(self, page: int) -> None:
        self._unindex(page, self._owner.pop(page))

    def _unindex(self, page: int, owner: str) -> None:
        mine = self._by_owner[owner]
        del mine[page]
        if not mine:
            del self._by_owner[owner]
        if owner:
            del self._owned[page]

    def __iter__(self) -> Iterator[int]:
        return iter(self._owner)

    def __len__(self) -> int:
        return len(self._owner)

    def __contains__(self, page: object) -> bool:
        return page in self._owner

    def keys(self) -> KeysView[int]:
        return self._owner.keys()

    def items(self) -> ItemsView[int, str]:
        return self._owner.items()

    def values(self) -> ValuesView[str]:
        return self._owner.values()

    def count(self, owner: str) -> int:
        """Free pages whose last owner is ``owner``."""
        mine = self._by_owner.get(owner)
        return len(mine) if mine else 0

    def first(self, owner: str, n: int) -> list[int]:
        """Up to ``n`` of ``owner``'s free pages, oldest first."""
        mine = self._by_owner.get(owner)
        return list(itertools.islice(mine, n)) if mine and n > 0 else []

    def first_owned(self, n: int) -> list[int]:
        """Up to ``n`` free pages that have an owner, oldest first."""
        return list(itertools.islice(self._owned, n)) if n > 0 else []


class PagePool:
    """One device pool's books: free pages and the budget they are created under."""

    def __init__(self, budget_pages: int) -> None:
        self.budget_pages = budget_pages
        self.created = 0                     # pages that exist in the daemon
        self.creating = 0                    # asked of the loop, not yet reported
        self.adopted = 0                     # pages that exist only in engines (after a restart)
        self.held_lent = 0                   # pages of a predecessor's lent records, held for claims
        self.free = FreePages()              # page id -> last owner ("" when never used)
        self.creation_failed_at = -1e9

    @property
    def in_use(self) -> int:
        return self.created + self.creating + self.adopted + self.held_lent

    # The budget's counters change only here, one method per event, each
    # keeping every counter at or above zero (invariant 2 is ``in_use`` <=
    # ``budget_pages``; where pages may come over it is checked by the caller).
    def asked_to_create(self, n: int) -> None:
        self.creating += n

    def created_pages(self, asked: int, page_ids: list[int], now: float) -> bool:
        """The loop created ``page_ids`` of ``asked``; False: some failed (noted at ``now``)."""
        require(0 <= asked <= self.creating and len(page_ids) <= asked, f"created {len(page_ids)} of {asked} "
                f"with {self.creating} being created")
        self.creating -= asked
        self.created += len(page_ids)
        for page_id in page_ids:
            self.free[page_id] = ""
        if len(page_ids) < asked:
            self.creation_failed_at = now
        return len(page_ids) == asked

    def took_over(self, n: int) -> None:
        """``n`` pages that already exist became the daemon's (kept cache, a lent slab adopted)."""
        self.created += n

    def released(self, n: int) -> None:
        """``n`` of the daemon's pages are let go (not put back in ``free``)."""
        require(n <= self.created, f"released {n} of {self.created} pages")
        self.created -= n

    def engine_held(self, n: int) -> None:
        """``n`` pages exist only in a re-registered engine's workers (after a restart)."""
        self.adopted += n

    def engine_let_go(self, n: int) -> None:
        """An engine-held slab's ``n`` pages: unmapped, or now the daemon's."""
        require(n <= self.adopted, f"let go of {n} of {self.adopted} engine-held pages")
        self.adopted -= n

    def hold_lent(self, n: int) -> None:
        """``n`` pages of a predecessor's lent records are held for their engines' claims."""
        self.held_lent += n

    def lent_settled(self, n: int) -> None:
        """``n`` held lent pages were claimed (counted as adopted now) or let go."""
        require(n <= self.held_lent, f"settled {n} of {self.held_lent} held lent pages")
        self.held_lent -= n

    def creatable(self) -> int:
        return max(0, self.budget_pages - self.in_use)

    def usable(self, owner: str, n: int) -> int:
        """How many of ``n`` pages ``owner`` can take now (its own or clean ones)."""
        free = self.free
        return min(n, free.count(owner) + (free.count("") if owner else 0))

    def take(self, n: int, owner: str) -> list[int]:
        """``n`` free pages of ``owner`` or clean (the caller checked ``usable``)."""
        free = self.free
        pages = free.first(owner, n)
        if len(pages) < n and owner:
            pages += free.first("", n - len(pages))
        for page in pages:
            del free[page]
        return pages

    def take_orphaned(self, live_owners: set[str], limit: int) -> list[int]:
        """Up to ``limit`` free pages whose last owner is no longer registered,
        to release (they leave the books)."""
        stale = [pg for pg, owner in self.free.items() if owner and owner not in live_owners][:limit]
        for page_id in stale:
            del self.free[page_id]
        self.created -= len(stale)
        return stale

    def take_exact(self, pages: list[int], owner: str) -> bool:
        """Take exactly ``pages`` if every one is free under ``owner``'s tag
        (a slab handed on keeps its pages); else take nothing."""
        free = self.free
        if any(free.get(page) != owner for page in pages):
            return False
        for page in pages:
            del free[page]
        return True

    def take_stale(self, n: int) -> list[int]:
        """Up to ``n`` free pages of other owners, to release (they leave the books)."""
        stale = self.free.first_owned(n)
        for page in stale:
            del self.free[page]
        self.created -= len(stale)
        return stale

    def put_back(self, pages: list[int], owner: str) -> None:
        free = self.free
        for page in pages:
            free[page] = owner

    def status(self, name: str, backend: str, held: int, cached: int, page_size: int,
               quarantined: int) -> DeviceStatus:
        return DeviceStatus(
            device=name, backend=backend, budget_bytes=self.budget_pages * page_size,
            memory=MemoryStatus(held=held, cached=cached, free=len(self.free) * page_size,
                                  unallocated=max(0, (self.budget_pages - self.in_use) * page_size)),
            pages=PageCounts(created=self.created, free=len(self.free), adopted=self.adopted,
                               quarantined=quarantined))

    def check(self, in_slabs: list[int], adopted: int) -> None:
        """Invariants 1 and 2 (``in_slabs``: this device's pages held in slabs)."""
        require(len(in_slabs) == len(set(in_slabs)), "a page is in two slabs")
        require(not set(in_slabs) & set(self.free), "a page is both free and held")
        require(len(in_slabs) + len(self.free) == self.created, "a page is lost or counted twice")
        require(adopted == self.adopted, "adopted pages do not match the engines' slabs")
        require(self.in_use <= self.budget_pages, "over budget")


@dataclasses.dataclass(frozen=True)
class SlabShape:
    """Where a slab's blocks lie in its pages: two engines of one shape put
    block ``k`` of a slab at the same bytes of the same pages' devices, so
    their cached blocks can change hands with the pages."""

    device: str
    pages_per_worker: int
    pages_per_region: int
    num_workers: int
    blocks_per_slab: int
    block_bytes: int
    worker_devices: tuple[tuple[int, str], ...]


def shape_of(engine: EngineRecord) -> SlabShape:
    return SlabShape(engine.device, engine.pages_per_worker, engine.pages_per_region, engine.num_workers,
                     engine.blocks_per_slab, engine.block_bytes, tuple(sorted(engine.worker_devices.items())))


def owner_tag(engine: EngineRecord) -> str:
    return f"{engine.engine_id}\0{engine.namespace}"

