"""What a daemon hands to the next one (warm restarts): its kept cache
and its lent slabs, saved as they change, and taken back at start with the
pages its keeper held.

Two halves, both shells around ``saved.py`` (which decides):

- ``Succession.save`` (the loop): rewrites the state file when
  ``saved.Saving`` says so: *before* any page is sent to an engine, once
  the effects of each input are carried out, and at a graceful stop. The
  kept cache is written whenever it moved (written ahead, the file never
  names a kept slab that was lent since); the lent slabs at most every
  ``saved.LENT_COALESCE`` seconds, or at once before pages go out for a
  slab the last write names otherwise (``saved.py``: trust). A grant
  writes nothing in the usual case.
- ``take_back`` (start): reads the file, asks the keeper what it holds, takes
  the descriptors of the kept slabs ``saved.adopt`` accepts, and of the lent
  slabs it holds for their engines' claims, into the devices, and has the
  keeper let go of every other page (free pages and what nothing proves).
  The held lent records' pages are let go once their engine registers
  without claiming them, or at the end of the grace period
  (``registration.LENT_GRACE``).

Without a keeper nothing is saved (the pages die with the daemon); a keeper
lost while running takes the state file with it (its pages may be gone).
"""

from __future__ import annotations

import logging
import os

from kvelastic.daemon import saved
from kvelastic.daemon.allocator import Allocator
from kvelastic.daemon.devices import Device
from kvelastic.daemon.keeping import PageKeeper
from kvelastic.daemon.orphans import OrphanSlab
from kvelastic.daemon.statefile import StateFileError, StateMissing, read_state, write_state
from kvelastic.errors import KvelasticError
from kvelastic.status_report import RestartStatus
from kvelastic.vmm.errors import VmmError

log = logging.getLogger("kvelastic.daemon")


def state_path(socket_path: str) -> str:
    """The daemon's state file lies beside its socket (as its hash secret does)."""
    return socket_path + ".state"


class Succession:
    def __init__(self, path: str, boot: str, keeper: PageKeeper) -> None:
        self.path = path
        self.boot = boot
        self.keeper = keeper
        self.saving = saved.Saving()   # what was written last, and when the next write is due
        self._dropped = False       # the keeper was lost: nothing is saved any more

    def save(self, allocator: Allocator, now: float, final: bool = False) -> None:
        """Write the books if ``saved.Saving`` says they are due, or whatever
        it says when ``final`` (a graceful stop: no later write would carry a
        lent change it still coalesces)."""
        if self._dropped:
            return
        if self.keeper.client is None:
            self._drop("the keeper was lost")
            return
        if not final and not self.saving.due(allocator, now):
            return
        try:
            write_state(self.path, self.saving.payload(allocator, now), boot=self.boot)
        except OSError as exc:
            self._drop(f"cannot write it ({exc.strerror or exc})")
            self.keeper.detach()       # pages the file cannot vouch for would be let go anyway
            return
        self.saving.written(allocator, now)

    def _drop(self, why: str) -> None:
        log.warning("state file %s removed: %s; the kept cache will not survive this daemon", self.path, why)
        self._dropped = True
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.error("state file %s: cannot remove it (%s): remove it before the next start", self.path, exc)


def take_back(path: str, boot: str, keeper: PageKeeper, devices: dict[str, Device],
              allocator: Allocator, now: float) -> RestartStatus:
    """Adopt what the predecessor kept and the keeper holds; let go of the rest."""
    held = keeper.held()
    status = RestartStatus(state_file="ok")
    try:
        books = saved.load(read_state(path, boot=boot))
    except StateFileError as exc:
        status.state_file = exc.reason
        if not isinstance(exc, StateMissing):
            log.warning("%s: not trusted, every kept slab it names is dropped", exc)
        books = saved.SavedBooks(saved.BOOKS_VERSION, 0, [])
    except saved.SavedBooksInvalid as exc:
        status.state_file = "invalid"
        log.warning("state file %s: %s: not trusted, every kept slab it names is dropped", path, exc)
        books = saved.SavedBooks(saved.BOOKS_VERSION, 0, [])
    except OSError as exc:
        status.state_file = "io"
        log.warning("state file %s: cannot read it (%s): every kept slab it names is dropped", path, exc)
        books = saved.SavedBooks(saved.BOOKS_VERSION, 0, [])
    allocator.skip_page_ids(max(held, default=-1) + 1)
    adoption = saved.adopt(books, set(held), allocator.room(), now)
    adoption = _import(adoption, keeper, devices)
    taken = {page for pages in adoption.pages.values() for page in pages}
    taken.update(page for rec in adoption.lent for page in rec.pages)
    status.kept_slabs = len(adoption.kept)
    status.kept_blocks = sum(len(o.cached) for o in adoption.kept)
    status.dropped = adoption.dropped
    status.lent_held = len(adoption.lent)
    status.lent_dropped = adoption.lent_dropped
    status.pages_let_go = keeper.let_go([page for page in held if page not in taken])
    allocator.adopt_kept(adoption, status, now)
    dropped = ", ".join(f"{n} {why}" for why, n in sorted(adoption.dropped.items())) or "none"
    lent_dropped = ", ".join(f"{n} {why}" for why, n in sorted(adoption.lent_dropped.items())) or "none"
    log.info("taken back from the last daemon (state file: %s): %d kept slab(s) with %d cached block(s); "
             "kept slabs dropped: %s; %d running engines' slab(s) held for their claims (dropped: %s); "
             "%d other page(s) of the keeper let go", status.state_file, status.kept_slabs, status.kept_blocks,
             dropped, status.lent_held, lent_dropped, status.pages_let_go)
    return status


def _import(adoption: saved.Adoption, keeper: PageKeeper, devices: dict[str, Device]) -> saved.Adoption:
    """Take the adopted kept slabs' and the held lent records' descriptors
    from the keeper into their devices; one of whose pages cannot be had is
    dropped (``pages_gone``), and its pages that came are released again."""
    wanted = [page for pages in adoption.pages.values() for page in pages]
    wanted += [page for rec in adoption.lent for page in rec.pages]
    fds = dict(keeper.take(wanted))
    kept: list[OrphanSlab] = []
    pages_of: dict[str, list[int]] = {}
    for o in adoption.kept:
        if not _import_pages(o.pages, o.page_devices, fds, devices, f"a kept slab of {o.namespace}"):
            adoption.dropped["pages_gone"] = adoption.dropped.get("pages_gone", 0) + 1
            continue
        kept.append(o)
        for page, device in zip(o.pages, o.page_devices):
            pages_of.setdefault(device, []).append(page)
    lent: list[saved.SavedLent] = []
    gone = list(adoption.lent_gone)
    for rec in adoption.lent:
        if _import_pages(rec.pages, rec.page_devices, fds, devices, f"slab {rec.slab_id} of {rec.engine_id}"):
            lent.append(rec)
        else:
            adoption.lent_dropped["pages_gone"] = adoption.lent_dropped.get("pages_gone", 0) + 1
            gone.append((rec.engine_id, rec.slab_id))
    for fd in fds.values():
        os.close(fd)
    return saved.Adoption(kept, pages_of, adoption.dropped, adoption.next_page, lent, adoption.lent_dropped, gone)


def _import_pages(pages: list[int], page_devices: list[str], fds: dict[int, int], devices: dict[str, Device],
                  what: str) -> bool:
    """Import every one of ``pages`` (their descriptors popped from ``fds``)
    into its device; if one cannot be, none stays (False)."""
    ok = all(page in fds for page in pages)
    imported: list[tuple[str, int]] = []
    for page, device in zip(pages, page_devices):
        fd = fds.pop(page, None)
        if fd is None:
            continue
        try:
            if ok:
                devices[device].adopt(page, fd)
                imported.append((device, page))
                continue
        except (KvelasticError, OSError, VmmError) as exc:
            log.warning("page %d of %s cannot be imported: %s", page, what, exc)
            ok = False
        os.close(fd)
    if not ok:
        for device in {d for d, _ in imported}:
            devices[device].release(tuple(pg for d, pg in imported if d == device))
    return ok
