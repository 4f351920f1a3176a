"""One device pool: a backend, the pages created on it, and its budget.

The daemon keeps one ``Device`` per GPU (or one for host memory). Page ids are
unique across devices, so a slab's page list says unambiguously where each
page lives. ``take`` is all-or-nothing: pages are reused, scrubbed or created,
and a failed creation puts everything back.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator

from kvelastic.daemon.state import PagePool
from kvelastic.vmm.base import Backend, Page

log = logging.getLogger("kvelastic.daemon")

_page_ids: Iterator[int] = itertools.count()


class Device:
    def __init__(self, name: str, backend: Backend, budget_bytes: int) -> None:
        self.name = name
        self.backend = backend
        self.page_size = backend.page_size
        self.pool = PagePool(budget_bytes // self.page_size, id_source=lambda: next(_page_ids))
        self.pages: dict[int, Page] = {}

    @property
    def budget_bytes(self) -> int:
        return self.pool.budget_pages * self.page_size

    def take(self, n: int, owner: str) -> list[int] | None:
        """``n`` pages for ``owner``, or None when the budget has no room."""
        taken = self.pool.take(n, owner)
        if taken is None:
            return None
        same, dirty, create = taken
        created: list[int] = []
        self.backend.make_current()   # several GPUs share the daemon's one thread
        try:
            for page_id in dirty:
                self.backend.zero(self.pages[page_id])  # it moves to another engine or namespace
            for page_id in self.pool.new_ids(create):
                self.pages[page_id] = self.backend.create_page()
                created.append(page_id)
        except Exception as exc:
            log.error("device %s: page creation failed: %s", self.name, exc)
            for page_id in created:
                self.backend.release_page(self.pages.pop(page_id))
            self.pool.created -= create
            self.pool.put_back(same, owner)
            self.pool.put_back(dirty, "")
            return None
        return same + dirty + created

    def give_back(self, pages: list[int], owner: str) -> None:
        self.pool.put_back(pages, owner)

    def export(self, page_id: int) -> int:
        self.backend.make_current()
        return self.backend.export(self.pages[page_id])

    def scrub_one(self) -> bool:
        """Idle work: zero one page another engine left behind (host: its memory
        goes back to the kernel), so grants rarely wait for a scrub."""
        for page_id, owner in self.pool.free.items():
            if owner:
                self.backend.make_current()
                self.backend.zero(self.pages[page_id])
                self.pool.free[page_id] = ""
                return True
        return False

    def release_all(self) -> None:
        self.backend.make_current()
        for page in self.pages.values():
            self.backend.release_page(page)
        self.pages.clear()

    def status(self, held: int, cached: int) -> dict:
        free = len(self.pool.free) * self.page_size
        return {"device": self.name, "backend": self.backend.name, "budget_bytes": self.budget_bytes,
                "memory": {"held": held, "cached": cached, "free": free,
                           "unallocated": max(0, self.budget_bytes - self.pool.in_use * self.page_size)},
                "pages": {"created": self.pool.created, "free": len(self.pool.free),
                          "adopted": self.pool.adopted}}

    def check(self, in_slabs: list[int], adopted: int) -> None:
        """Invariants 1 and 2 for this device (``in_slabs``: its pages held in slabs)."""
        assert len(in_slabs) == len(set(in_slabs)), "a page is in two slabs"
        assert not set(in_slabs) & set(self.pool.free), "a page is both free and held"
        assert len(in_slabs) + len(self.pool.free) == self.pool.created == len(self.pages)
        assert adopted == self.pool.adopted
        assert self.pool.created <= self.pool.budget_pages
