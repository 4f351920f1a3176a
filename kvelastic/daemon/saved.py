"""The daemon's books as a new daemon takes them back (warm restarts): what is
saved in the state file (``statefile.py``) and what, of it, a successor may
adopt. No I/O: the loop writes and reads the file, the keeper holds pages.

Two kinds of record are saved:

- the **kept cache** (``orphans.py``): departed engines' slabs with their
  pages, namespaces and cached keys, which only the daemon holds;
- the **lent slabs**: which pages back which slab of which
  running engine's registration (its engine id, namespace, uid and a digest
  of its secret). A running engine re-registers with the slab ids it maps
  (``registration.py``); a lent record lets the successor adopt such a slab
  *with* its pages, so that the engine's cache can be kept when it leaves.

Trust. A saved kept slab is adopted only if every one of its pages is held
by the keeper (the memory is alive) on a device of the same name, within the
device's budget. The kept cache is written *ahead*: before any page leaves
it for an engine, the file is rewritten without it, so a slab the file names
was never lent since. A lent record is used only when a re-registering
engine claims that very slab with the same engine id, namespace, uid and
secret, and every page is held by the keeper and named once in the whole
file; and the file never names a slab with other pages than a worker may
map for it, nor a page under a slab other than the one it is sent for:
before pages go to a worker for a slab whose record (or whose pages'
records) the last write names otherwise, the file is rewritten (``Saving``).
A record of a slab returned since is harmless: no claim names it (and if
its id was lent again, the write-ahead replaced it). Anything else is
dropped and counted by reason, never served.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from collections.abc import Iterable, Iterator
from typing import Protocol

import msgspec

from kvelastic import protocol as p
from kvelastic.daemon.orphans import OrphanCache, OrphanSlab
from kvelastic.daemon.state import SlabShape

# Bumped when the payload's meaning changes (the file's own format has its
# version in ``statefile.VERSION``); another one is dropped, not guessed at.
# Version 1 (kept cache only) is still read: it has no lent records.
BOOKS_VERSION = 2
READABLE = (1, 2)
# Lent slabs that changed without endangering anything (a slab granted with
# pages the last write names nowhere else, one returned) are written at most
# this often: a grant waits for no file write. A slab granted within this
# window before a crash is adopted without its pages (its cache is not kept
# when its engine leaves): a loss, never a wrong page.
LENT_COALESCE = 0.25


class SavedSlab(msgspec.Struct, array_like=True, frozen=True):
    namespace: str
    shape: SlabShape
    pages: list[int]
    page_devices: list[str]
    cached: list[p.CachedBlock]
    age: float                     # seconds it had been kept (its TTL goes on from there)
    engine_id: str


class SavedLent(msgspec.Struct, array_like=True, frozen=True):
    """A slab lent to a running engine's registration, with its pages."""

    engine_id: str
    namespace: str
    uid: int                       # the registering peer's uid (-1: an in-process caller)
    token: bytes                   # ``token_digest`` of the registration's secret
    slab_id: int
    device: str                    # the engine's device
    pages: list[int]
    page_devices: list[str]


class SavedBooks(msgspec.Struct, frozen=True):
    version: int
    next_page: int                 # page ids below it may be named by the keeper
    kept: list[SavedSlab]
    lent: list[SavedLent] = []


class SavedBooksInvalid(ValueError):
    """The payload decodes as no ``SavedBooks`` of this version."""


@dataclasses.dataclass
class Adoption:
    """What a new daemon takes back of a saved state, and what it drops."""

    kept: list[OrphanSlab]
    pages: dict[str, list[int]]           # device -> the adopted slabs' pages, to take from the keeper
    dropped: dict[str, int]               # reason -> saved slabs not adopted
    next_page: int
    # Lent records held for their engines' claims (their pages held, named once, on a known device).
    lent: list[SavedLent] = dataclasses.field(default_factory=list)
    lent_dropped: dict[str, int] = dataclasses.field(default_factory=dict)   # reason -> lent records dropped
    lent_gone: list[tuple[str, int]] = dataclasses.field(default_factory=list)   # their (engine, slab)

    def lent_pages(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for rec in self.lent:
            for page, device in zip(rec.pages, rec.page_devices):
                out.setdefault(device, []).append(page)
        return out


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(SavedBooks)


def token_digest(token: bytes) -> bytes:
    """What the file keeps of a registration's secret: enough to recognise it, not to show it."""
    return hashlib.sha256(b"kvelastic-lent\0" + token).digest()


def save(kept: Iterable[OrphanSlab], next_page: int, now: float, lent: Iterable[SavedLent] = ()) -> bytes:
    slabs = [SavedSlab(o.namespace, o.shape, list(o.pages), list(o.page_devices), list(o.cached),
                       max(0.0, now - o.since), o.engine_id) for o in kept]
    return _encoder.encode(SavedBooks(BOOKS_VERSION, next_page, slabs, list(lent)))


def load(payload: bytes) -> SavedBooks:
    try:
        books = _decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise SavedBooksInvalid(f"the saved books do not decode: {exc}") from None
    if books.version not in READABLE:
        raise SavedBooksInvalid(f"saved books of version {books.version}, this daemon reads {BOOKS_VERSION}")
    if books.version == 1 and books.lent:
        raise SavedBooksInvalid("saved books of version 1 with lent records")
    return books


def adopt(saved: SavedBooks, held: set[int], room: dict[str, int], now: float) -> Adoption:
    """The saved kept slabs a daemon may take back: every page held by the
    keeper (``held``) and named once in the whole file, on a device it has,
    within ``room`` (device -> pages it may adopt). Oldest first, as the
    cache evicts. And, first, the lent records it may hold for their
    engines' claims: every page held, named once in the file, on a device it
    has, within ``room`` (held pages count against the budget: they are
    memory in use)."""
    out = Adoption([], {}, {}, saved.next_page)
    names = collections.Counter(pg for slab in saved.kept for pg in slab.pages)
    names.update(pg for rec in saved.lent for pg in rec.pages)
    twice = {pg for pg, n in names.items() if n > 1}      # no daemon wrote that: every record naming it goes
    left = dict(room)
    keys = collections.Counter((rec.engine_id, rec.slab_id) for rec in saved.lent)
    for rec in saved.lent:       # first: a running engine's pages are memory in use, kept cache is not
        why = _unfit_lent(rec, held, twice, left, saved.next_page, keys[(rec.engine_id, rec.slab_id)] > 1)
        if why:
            out.lent_dropped[why] = out.lent_dropped.get(why, 0) + 1
            out.lent_gone.append((rec.engine_id, rec.slab_id))
            continue
        out.lent.append(rec)
        for device in rec.page_devices:
            left[device] -= 1
    for slab in sorted(saved.kept, key=lambda s: -s.age):
        why = _unfit(slab, held, twice, left, saved.next_page)
        if why:
            out.dropped[why] = out.dropped.get(why, 0) + 1
            continue
        for page, device in zip(slab.pages, slab.page_devices):
            left[device] -= 1
            out.pages.setdefault(device, []).append(page)
        out.kept.append(OrphanSlab(slab.namespace, slab.shape, list(slab.pages), list(slab.page_devices),
                                   tuple(slab.cached), now - slab.age, slab.engine_id))
    return out


def _unfit(slab: SavedSlab, held: set[int], twice: set[int], left: dict[str, int], next_page: int) -> str:
    """Why ``slab`` cannot be adopted ("" when it can): a page named twice
    or past the ids its daemon handed out is a file no daemon wrote."""
    if not slab.pages or len(slab.pages) != len(slab.page_devices) or not slab.cached:
        return "malformed"
    if any(device not in left for device in slab.page_devices) or slab.shape.device not in left:
        return "device_gone"
    if len(set(slab.pages)) != len(slab.pages) or twice.intersection(slab.pages) \
            or any(page >= next_page for page in slab.pages):
        return "malformed"
    if not held.issuperset(slab.pages):
        return "pages_gone"
    need: dict[str, int] = {}
    for device in slab.page_devices:
        need[device] = need.get(device, 0) + 1
    if any(left[device] < n for device, n in need.items()):
        return "over_budget"
    return ""


def _unfit_lent(rec: SavedLent, held: set[int], twice: set[int], devices: dict[str, int], next_page: int,
                slab_twice: bool) -> str:
    if not rec.pages or len(rec.pages) != len(rec.page_devices) or rec.slab_id < 0 or slab_twice \
            or len(set(rec.pages)) != len(rec.pages) or twice.intersection(rec.pages) \
            or any(page >= next_page for page in rec.pages):
        return "malformed"
    if rec.device not in devices or any(device not in devices for device in rec.page_devices):
        return "device_gone"
    if not held.issuperset(rec.pages):
        return "pages_gone"
    need = collections.Counter(rec.page_devices)
    if any(devices[device] < n for device, n in need.items()):
        return "over_budget"
    return ""


# ------------------------------------------------------------------ writes
class SavedSource(Protocol):
    """What of the allocator ``Saving`` reads (``Allocator`` fits it)."""

    @property
    def orphans(self) -> OrphanCache: ...

    @property
    def next_page(self) -> int: ...

    def lent_version(self) -> tuple[int, ...]: ...

    def lent_new(self) -> Iterator[tuple[str, int, list[int]]]: ...

    def lent_records(self) -> list[SavedLent]: ...

    def lent_written(self) -> None: ...


class Saving:
    """When the books must be written, and what (pure: the loop's
    ``Succession`` and the simulator's keeper write what it says).

    - The kept cache moved: now (the write-ahead rule of the kept cache).
    - A slab started mapping whose pages or id the last write names under
      another slab (a record of (engine, slab) with other pages, or one of
      its pages under another (engine, slab)): now, before its pages go out.
      So the file never names a page under a slab other than the one a
      worker maps it for, and a record that the file names and an engine
      claims always has the pages that engine's workers map for it.
    - Any other change of the lent slabs: at most every ``LENT_COALESCE``
      seconds (a missing or late record costs only a slab adopted without
      its pages; a record of a slab since returned is never claimed).
    """

    def __init__(self, coalesce: float = LENT_COALESCE) -> None:
        self.coalesce = coalesce
        self.kept_version = -1
        self.lent: tuple[int, ...] | None = None
        self.written_at = float("-inf")
        self.slabs: dict[tuple[str, int], tuple[int, ...]] = {}     # (engine, slab) -> pages, as written
        self.pages: dict[int, tuple[str, int]] = {}                 # page -> its (engine, slab), as written
        self._lent: list[SavedLent] = []

    def due(self, books: SavedSource, now: float) -> bool:
        if books.orphans.version != self.kept_version:
            return True
        if books.lent_version() == self.lent:
            return False
        return now - self.written_at >= self.coalesce or self.conflict(books)

    def conflict(self, books: SavedSource) -> bool:
        for engine_id, slab_id, pages in books.lent_new():
            key = (engine_id, slab_id)
            if self.slabs.get(key, tuple(pages)) != tuple(pages) \
                    or any(self.pages.get(page, key) != key for page in pages):
                return True
        return False

    def payload(self, books: SavedSource, now: float) -> bytes:
        """The books to write now; ``written`` once they are."""
        self._lent = books.lent_records()
        return save(books.orphans, books.next_page, now, self._lent)

    def written(self, books: SavedSource, now: float) -> None:
        self.kept_version = books.orphans.version
        self.lent = books.lent_version()
        self.written_at = now
        self.slabs = {(r.engine_id, r.slab_id): tuple(r.pages) for r in self._lent}
        self.pages = {page: (r.engine_id, r.slab_id) for r in self._lent for page in r.pages}
        books.lent_written()
