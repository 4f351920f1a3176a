"""What a daemon hands to the next one (Step 20): its kept cache, saved as it
changes, and taken back at start with the pages its keeper held.

Two halves, both shells around ``saved.py`` (which decides):

- ``Succession.save`` (the loop): rewrites the state file whenever the kept
  cache moved: *before* any page is sent to an engine, once the effects of
  each input are carried out, and at a graceful stop. Written ahead, the
  file never names a slab that was lent since (``saved.py``: trust). The
  kept cache changes only when an engine leaves or a kept slab is taken or
  expires, so writes are few.
- ``take_back`` (start): reads the file, asks the keeper what it holds, takes
  the descriptors of the slabs ``saved.adopt`` accepts into the devices, and
  has the keeper let go of every other page (free pages, lent ones, which
  the engines' workers keep mapping, and what nothing proves).

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
        self._version = -1          # the kept cache's version last written (-1: none yet)
        self._dropped = False       # the keeper was lost: nothing is saved any more

    def save(self, allocator: Allocator, now: float) -> None:
        """Write the kept cache if it moved since the last write."""
        if self._dropped:
            return
        if self.keeper.client is None:
            self._drop("the keeper was lost")
            return
        orphans = allocator.orphans
        if orphans.version == self._version:
            return
        try:
            write_state(self.path, saved.save(orphans, allocator.next_page, now), boot=self.boot)
        except OSError as exc:
            self._drop(f"cannot write it ({exc.strerror or exc})")
            self.keeper.detach()       # pages the file cannot vouch for would be let go anyway
            return
        self._version = orphans.version

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
    status.kept_slabs = len(adoption.kept)
    status.kept_blocks = sum(len(o.cached) for o in adoption.kept)
    status.dropped = adoption.dropped
    status.pages_let_go = keeper.let_go([page for page in held if page not in taken])
    allocator.adopt_kept(adoption, status)
    dropped = ", ".join(f"{n} {why}" for why, n in sorted(adoption.dropped.items())) or "none"
    log.info("taken back from the last daemon (state file: %s): %d kept slab(s) with %d cached block(s); "
             "kept slabs dropped: %s; %d other page(s) of the keeper let go", status.state_file,
             status.kept_slabs, status.kept_blocks, dropped, status.pages_let_go)
    return status


def _import(adoption: saved.Adoption, keeper: PageKeeper, devices: dict[str, Device]) -> saved.Adoption:
    """Take the adopted slabs' descriptors from the keeper into their devices;
    a slab one of whose pages cannot be had is dropped (``pages_gone``), and
    its pages that came are released again."""
    wanted = [page for pages in adoption.pages.values() for page in pages]
    fds = dict(keeper.take(wanted))
    device_of = {page: device for device, pages in adoption.pages.items() for page in pages}
    kept: list[OrphanSlab] = []
    pages_of: dict[str, list[int]] = {}
    for o in adoption.kept:
        ok = all(page in fds for page in o.pages)
        for page in o.pages:
            fd = fds.pop(page, None)
            if fd is None:
                continue
            try:
                if ok:
                    devices[device_of[page]].adopt(page, fd)
                    continue
            except (KvelasticError, OSError, VmmError) as exc:
                log.warning("page %d of a kept slab of %s cannot be imported: %s", page, o.namespace, exc)
                ok = False
            os.close(fd)
        if not ok:
            devices_touched = {device_of[page] for page in o.pages}
            for device in devices_touched:
                devices[device].release(tuple(pg for pg in o.pages if device_of[pg] == device))
            adoption.dropped["pages_gone"] = adoption.dropped.get("pages_gone", 0) + 1
            continue
        kept.append(o)
        for page in o.pages:
            pages_of.setdefault(device_of[page], []).append(page)
    for fd in fds.values():
        os.close(fd)
    return saved.Adoption(kept, pages_of, adoption.dropped, adoption.next_page)
