"""The daemon's keeper and state file in the simulated node.

The real loop (``kvelastic/daemon/server.py`` with ``succession.py``) has a
keeper process hold every page it creates (deposited on creation, forgotten
on ``ReleasePages``) and rewrites its state file (``saved.save``: the kept
cache) whenever ``orphans.version`` moved: *before* it performs a
``SendPages`` (written ahead: the file never names a slab lent since), after
each input's effects, and at a graceful stop. A new daemon reads the file,
adopts what ``saved.adopt`` accepts of the pages the keeper holds, and has
the keeper let go of every other page. Here ``Keeper`` plays the keeper and
the file (its bytes, in memory) and ``take_back`` the new daemon's start,
through the real ``saved`` functions and ``Allocator.adopt_kept``.

The state file names the running engines' slabs too (lent
records, written as ``saved.Saving`` says: coalesced, but ahead of pages
sent for a slab the last write names otherwise). The successor holds the
pages of the records it accepts for their engines' claims (the keeper
keeps them); an engine that re-registers claiming a slab adopts it with its
pages only on an exact match, and the records no claim matched are let go
at the end of the grace period. Checked from then on (``check_lent``):
every slab a registration holds with pages is what its workers map for it
(a stale record adopted would name pages the worker does not map there, and
its cache, kept later, would serve another slab's KV), and no held
record's page is mapped by a worker of another registration.

A daemon stops in one of three ways (``World.restart_daemon``): gracefully
(SIGTERM: the file written last, nothing unmapped), killed between inputs,
or killed part-way through an input's effects (``World.crash``: often right
after pages went to a worker, before the input's own write). Sometimes the
file is torn (nothing of it may be used) or the keeper is lost (it holds
nothing; half the time its file went with it, half the time the file names
pages nobody holds). What is checked at start, and ever after, is in
``take_back`` and ``World.perform``: no adopted page is mapped by a worker,
each adopted block holds the KV of its key in its namespace, page ids the
new daemon hands out never meet one it adopted or the keeper holds, and no
page is sent to a worker while a worker of another registration maps it.
"""

from __future__ import annotations

import collections
import random
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

from kvelastic import protocol as p
from kvelastic.daemon import saved
from kvelastic.daemon.allocator import Allocator
from kvelastic.daemon.state import Phase
from kvelastic.status_report import RestartStatus
from kvelastic_tools.sim.records import Device, SimWorker

if TYPE_CHECKING:
    from kvelastic_tools.sim.engine import SimEngine


class World(Protocol):
    """What of the simulated node (``world.World``, which holds a ``Keeper``) the keeper reads and checks."""

    allocator: Allocator
    keeper: Keeper
    device: Device
    rng: random.Random
    counts: collections.Counter
    now: float
    stopped: bool
    restored_pages: set[int]

    @property
    def engines(self) -> list[SimEngine]: ...

    def mappers(self) -> Iterator[SimWorker]: ...

    def mapped_pages(self) -> set[int]: ...

    def violation(self, what: str) -> None: ...

    def check_block(self, what: str, namespace: str, page: int, c: p.CachedBlock) -> None: ...

TORN = 0.1             # a restart finds the state file torn (statefile.py refuses it)
KEEPER_LOST = 0.1      # a restart finds the keeper gone (a new one holds nothing)


class Keeper:
    def __init__(self) -> None:
        self.held: set[int] = set()          # the page ids the keeper holds
        self.attached = True                 # the daemon talks to it (not once it stops)
        self.saved: bytes | None = None      # the state file's payload (None: no file)
        self.saving = saved.Saving()         # when the loop writes it (the real rule)
        self.stopped_with = -1               # kept slabs at a graceful stop (-1: it was killed)
        self.daemon: Allocator | None = None  # the daemon whose counts ``harvest`` has not taken yet

    # ------------------------------------------------- where the loop writes
    def save_ahead(self, w: World) -> None:
        """Before a ``SendPages`` is performed: the file never names a slab lent since."""
        self.save(w)

    def save_after(self, w: World) -> None:
        """Once an input's effects are carried out."""
        self.save(w)

    def save_at_stop(self, w: World) -> None:
        """A graceful stop, before the keeper is detached: the next daemon
        must find every kept slab (unless the file is torn or the keeper lost)."""
        self.save(w)
        self.stopped_with = len(w.allocator.orphans.slabs)

    def save(self, w: World) -> None:
        """Write the books if ``saved.Saving`` says so (``Succession.save``)."""
        if not self.attached or w.stopped:
            return
        if not self.saving.due(w.allocator, w.now):
            return
        self.saved = self.saving.payload(w.allocator, w.now)
        self.saving.written(w.allocator, w.now)
        w.counts["state_writes"] += 1

    # --------------------------------------------------------------- pages
    def deposit(self, pages: list[int]) -> None:
        if self.attached:
            self.held.update(pages)

    def forget(self, pages: tuple[int, ...]) -> None:
        if self.attached:                    # a stopping daemon leaves its pages with the keeper
            self.held.difference_update(pages)


def take_back(w: World, alloc: Allocator, faults: bool = True) -> None:
    """A new daemon's start with a keeper (``succession.take_back``): read
    the file, adopt the kept slabs whose pages the keeper holds, have it let
    go of the rest; then check what was adopted, and save at once.
    ``faults``: the file may be torn, the keeper lost."""
    keeper, rng = w.keeper, w.rng
    harvest(w)
    keeper.daemon = alloc
    old = set(w.device.pages) | keeper.held          # every page the last daemon or the keeper had
    whole = keeper.stopped_with                      # what a graceful stop left (-1: killed)
    keeper.stopped_with = -1
    if faults and rng.random() < KEEPER_LOST:
        w.counts["keeper_lost"] += 1
        whole = -1
        keeper.held = set()
        if rng.random() < 0.5:
            keeper.saved = None                      # lost while the daemon ran: it removed its file
    payload = keeper.saved
    books = saved.SavedBooks(saved.BOOKS_VERSION, 0, [])
    state = "missing" if payload is None else "ok"
    if payload is not None:
        torn = faults and rng.random() < TORN
        state = "torn" if torn else state
        whole = -1 if torn else whole
        if torn:
            w.counts["state_torn"] += 1
            payload = payload[:rng.randrange(len(payload))]
        try:
            books = saved.load(payload)
        except saved.SavedBooksInvalid as exc:
            if not torn:
                w.violation(f"the saved books do not load: {exc}")
        else:
            if torn:
                w.violation("a torn state file decoded as saved books")
                books = saved.SavedBooks(saved.BOOKS_VERSION, 0, [])
    held = set(keeper.held)
    alloc.skip_page_ids(max(held, default=-1) + 1)
    adoption = saved.adopt(books, held, alloc.room(), w.now)
    taken = {page for pages in adoption.pages.values() for page in pages}
    taken.update(page for rec in adoption.lent for page in rec.pages)
    status = RestartStatus(state_file=state, kept_slabs=len(adoption.kept),
                           kept_blocks=sum(len(o.cached) for o in adoption.kept), dropped=adoption.dropped,
                           pages_let_go=len(held - taken), lent_held=len(adoption.lent),
                           lent_dropped=adoption.lent_dropped)
    alloc.adopt_kept(adoption, status, w.now)
    for why, n in adoption.dropped.items():
        w.counts[f"kept_dropped_{why}"] += n
    for why, n in adoption.lent_dropped.items():
        w.counts[f"lent_dropped_{why}"] += n
    w.counts["lent_held"] += len(adoption.lent)
    if whole >= 0 and len(adoption.kept) != whole:
        w.violation(f"a graceful stop left {whole} kept slab(s); its successor adopted {len(adoption.kept)} "
                    f"(dropped: {adoption.dropped}, state file: {state})")
    if adoption.kept:
        w.counts["daemon_restart_kept"] += 1
        w.counts["kept_slabs_restored"] += len(adoption.kept)
    beyond = [page for page in taken | held if page >= alloc.next_page]
    if beyond:
        w.violation(f"the new daemon would hand out page ids {sorted(beyond)[:5]} it adopted or its keeper holds")
    check_adopted(w, alloc)
    keeper.held = taken                              # the keeper lets go of the rest
    keeper.attached = True
    keeper.saving = saved.Saving()
    w.device.pages = set(taken)
    mapped = w.mapped_pages()
    for page in old - taken - mapped:                # nothing holds them any more: gone
        w.device.forget(page)
    w.restored_pages = set(taken)
    # The sim's device names a physical page by its id, so a fresh page
    # takes an id no page still alive in an engine, or remembered, has
    # (the real daemon's ids are its own; it never names those pages).
    alive = set(w.device.content) | {page for page, _offset in w.device.kv} | mapped
    alloc.skip_page_ids(max(alive - taken, default=-1) + 1)
    keeper.save(w)


def check_adopted(w: World, alloc: Allocator) -> None:
    """Each adopted kept slab is mapped by no worker and holds, in every
    page, the KV of each of its keys, of its namespace, written whole."""
    mapped = w.mapped_pages()
    for o in alloc.orphans:
        for page in o.pages:
            if page in mapped:
                w.violation(f"kept slab of {o.engine_id} adopted by a new daemon, but a worker maps its page {page}")
            for c in o.cached:
                w.check_block(f"kept slab of {o.engine_id} adopted by a new daemon for {o.namespace}:",
                              o.namespace, page, c)


def harvest(w: World) -> None:
    """What the last daemon's engines' claims found (its ``RestartStatus``), into the run's counts."""
    alloc, w.keeper.daemon = w.keeper.daemon, None
    restart = alloc.books.restart if alloc is not None else None
    if restart is None:
        return
    w.counts["lent_adopted"] += restart.lent_adopted
    w.counts["lent_let_go"] += restart.lent_let_go
    for why, n in restart.lent_unmatched.items():
        w.counts[f"lent_unmatched_{why}"] += n


def check_lent(w: World, alloc: Allocator) -> None:
    """Every slab a live registration holds with pages is, for each of its
    workers that maps it, exactly those pages (as sets: a worker maps its
    rank's share); the pages of held lent records are mapped by no worker of
    another registration than the one the record names."""
    by_name = {e.name: e for e in w.engines if e.alive}
    for record in alloc.engines.values():
        engine = by_name.get(record.engine_id)
        if engine is None or record.failed or engine.token != record.token:
            continue
        for slab in record.slabs.values():
            if not slab.pages or slab.phase is not Phase.HELD:
                continue
            pages = set(slab.pages)
            for worker in engine.workers:
                mapped = worker.mapped.get(slab.slab_id)
                if mapped is not None and not pages.issuperset(mapped):
                    w.violation(f"engine {record.engine_id}: the daemon books slab {slab.slab_id} as pages "
                                f"{sorted(pages)}, its worker {worker.rank} maps {sorted(mapped)} there")
    held = alloc.registration.held_records()
    if held:
        workers = [(saved.token_digest(worker.token), worker) for worker in w.mappers()]
        for rec in held:
            for digest, worker in workers:
                if digest != rec.token and any(set(rec.pages).intersection(m) for m in worker.mapped.values()):
                    w.violation(f"pages {rec.pages} of a held lent record of {rec.engine_id} are mapped by "
                                f"{worker.identity!r}, of another registration")
