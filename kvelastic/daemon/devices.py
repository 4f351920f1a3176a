"""One device: a backend and the handles of the pages created on it.

The allocator keeps the books (which page is free, whose it was, the budget);
this holds what only the loop may touch: backend page objects, created and
released on the allocator's word. Page ids come from the allocator and are
unique across devices.
"""

from __future__ import annotations

import logging
import os

from kvelastic.vmm.base import Backend, Page

log = logging.getLogger("kvelastic.daemon")

# Pages created per backend call: big enough that CUDA's per-call scrub cost
# (map, access, memset, sync) is spread thin, small enough that the scratch
# range (address space only) stays modest and one failure retries few pages.
BATCH = 64


class Device:
    def __init__(self, name: str, backend: Backend, budget_bytes: int, aliases: tuple[str, ...] = ()) -> None:
        self.name = name
        self.aliases = aliases          # other names workers may give it (a GPU's UUID)
        self.backend = backend
        self.page_size = backend.page_size
        self.budget_pages = budget_bytes // self.page_size
        self.pages: dict[int, Page] = {}
        # Adopted pages on a backend that cannot re-export them (CUDA: the
        # driver exports only handles its own process created): the keeper's
        # descriptor, kept open and passed on as copies. Closed on release.
        self.kept_fds: dict[int, int] = {}

    @property
    def budget_bytes(self) -> int:
        return self.budget_pages * self.page_size

    def create(self, page_ids: list[int]) -> list[int]:
        """Create pages under these ids, in order; stops at the first failure
        (out of device memory) and returns the ids created.

        Pages are made ``BATCH`` at a time (``create_pages``: on CUDA one scrub
        for the batch instead of one per page). A batch is all or none, so a
        failed one is retried page by page: the pages that still fit are
        created and counted, as before batching."""
        self.backend.make_current()   # several GPUs share the daemon's one thread
        done: list[int] = []
        for start in range(0, len(page_ids), BATCH):
            batch = page_ids[start:start + BATCH]
            try:
                pages = self.backend.create_pages(len(batch))
            except Exception as exc:  # noqa: BLE001 - backends fail differently (CUDA, memfd); retried one by one
                log.warning("device %s: creating %d pages at once failed (%s); one by one", self.name,
                            len(batch), exc)
                if not self._create_one_by_one(batch, done):
                    break
                continue
            self.pages.update(zip(batch, pages))
            done.extend(batch)
        return done

    def _create_one_by_one(self, page_ids: list[int], done: list[int]) -> bool:
        """Appends the ids created to ``done``; False at the first failure."""
        for page_id in page_ids:
            try:
                self.pages[page_id] = self.backend.create_page()
            except Exception as exc:  # noqa: BLE001 - backends fail differently (CUDA, memfd); each stops the batch
                log.error("device %s: page creation failed: %s", self.name, exc)
                return False
            done.append(page_id)
        return True

    def release(self, page_ids: tuple[int, ...]) -> None:
        self.backend.make_current()
        for page_id in page_ids:
            page = self.pages.pop(page_id, None)
            if page is not None:
                self.backend.release_page(page)
            fd = self.kept_fds.pop(page_id, None)
            if fd is not None:
                os.close(fd)

    def adopt(self, page_id: int, fd: int) -> None:
        """A page a former daemon made (its descriptor, from the keeper) under its id;
        takes ``fd`` on success (kept for ``export``), leaves it open on failure."""
        self.backend.make_current()
        if self.backend.exports_imported:
            self.pages[page_id] = self.backend.import_page(fd)
            return
        copy = os.dup(fd)
        try:
            self.pages[page_id] = self.backend.import_page(copy)   # takes ``copy`` on success
        except BaseException:
            os.close(copy)
            raise
        self.kept_fds[page_id] = fd

    def export(self, page_id: int) -> int:
        """A new descriptor of the page, for a worker or the keeper (the caller closes it)."""
        fd = self.kept_fds.get(page_id)
        if fd is not None:
            return os.dup(fd)
        self.backend.make_current()
        return self.backend.export(self.pages[page_id])

    def release_all(self) -> None:
        self.release(tuple(self.pages))
