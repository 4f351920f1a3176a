"""The daemon's books as a new daemon takes them back (Step 20): what is
saved in the state file (``statefile.py``) and what, of it, a successor may
adopt. No I/O: the loop writes and reads the file, the keeper holds pages.

What is saved is the kept cache (``orphans.py``): departed engines' slabs
with their pages, namespaces and cached keys. It is the one thing that only
the daemon holds and that is worth a restart: a running engine re-registers
with the slabs it maps (adopted, ``registration.py``), free pages hold
nothing, the tier's index is rebuilt from its disk, the hash secret is kept
beside the socket.

Trust. A saved slab is adopted only if every one of its pages is held by the
keeper (the memory is alive) on a device of the same name, within the
device's budget. The file is current because it is written *ahead*: before
any page leaves the kept cache for an engine (``Daemon._send_pages``), the
file is rewritten without it, so a slab the file names was never lent since.
Anything else is dropped and counted by reason, never served.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import msgspec

from kvelastic import protocol as p
from kvelastic.daemon.orphans import OrphanSlab
from kvelastic.daemon.state import SlabShape

# Bumped when the payload's meaning changes (the file's own format has its
# version in ``statefile.VERSION``); another one is dropped, not guessed at.
BOOKS_VERSION = 1


class SavedSlab(msgspec.Struct, array_like=True, frozen=True):
    namespace: str
    shape: SlabShape
    pages: list[int]
    page_devices: list[str]
    cached: list[p.CachedBlock]
    age: float                     # seconds it had been kept (its TTL goes on from there)
    engine_id: str


class SavedBooks(msgspec.Struct, frozen=True):
    version: int
    next_page: int                 # page ids below it may be named by the keeper
    kept: list[SavedSlab]


class SavedBooksInvalid(ValueError):
    """The payload decodes as no ``SavedBooks`` of this version."""


@dataclasses.dataclass
class Adoption:
    """What a new daemon takes back of a saved state, and what it drops."""

    kept: list[OrphanSlab]
    pages: dict[str, list[int]]           # device -> the adopted slabs' pages, to take from the keeper
    dropped: dict[str, int]               # reason -> saved slabs not adopted
    next_page: int


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(SavedBooks)


def save(kept: Iterable[OrphanSlab], next_page: int, now: float) -> bytes:
    slabs = [SavedSlab(o.namespace, o.shape, list(o.pages), list(o.page_devices), list(o.cached),
                       max(0.0, now - o.since), o.engine_id) for o in kept]
    return _encoder.encode(SavedBooks(BOOKS_VERSION, next_page, slabs))


def load(payload: bytes) -> SavedBooks:
    try:
        books = _decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise SavedBooksInvalid(f"the saved books do not decode: {exc}") from None
    if books.version != BOOKS_VERSION:
        raise SavedBooksInvalid(f"saved books of version {books.version}, this daemon reads {BOOKS_VERSION}")
    return books


def adopt(saved: SavedBooks, held: set[int], room: dict[str, int], now: float) -> Adoption:
    """The saved kept slabs a daemon may take back: every page held by the
    keeper (``held``) and named once, on a device it has, within ``room``
    (device -> pages it may adopt). Oldest first, as the cache evicts."""
    out = Adoption([], {}, {}, saved.next_page)
    seen: set[int] = set()
    left = dict(room)
    for slab in sorted(saved.kept, key=lambda s: -s.age):
        why = _unfit(slab, held, seen, left, saved.next_page)
        if why:
            out.dropped[why] = out.dropped.get(why, 0) + 1
            continue
        seen.update(slab.pages)
        for page, device in zip(slab.pages, slab.page_devices):
            left[device] -= 1
            out.pages.setdefault(device, []).append(page)
        out.kept.append(OrphanSlab(slab.namespace, slab.shape, list(slab.pages), list(slab.page_devices),
                                   tuple(slab.cached), now - slab.age, slab.engine_id))
    return out


def _unfit(slab: SavedSlab, held: set[int], seen: set[int], left: dict[str, int], next_page: int) -> str:
    """Why ``slab`` cannot be adopted ("" when it can): a page named twice
    or past the ids its daemon handed out is a file no daemon wrote."""
    if not slab.pages or len(slab.pages) != len(slab.page_devices) or not slab.cached:
        return "malformed"
    if any(device not in left for device in slab.page_devices) or slab.shape.device not in left:
        return "device_gone"
    if len(set(slab.pages)) != len(slab.pages) or seen.intersection(slab.pages) \
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

