"""The daemon's side of the keeper (``kvelastic keeper``, Step 20): every page
the daemon creates is deposited there, every page it lets go is forgotten, so
the keeper always holds the daemon's pages and they outlive its process.

Used when a keeper listens beside the daemon's socket (``$KVELASTIC_SOCKET.keeper``)
at start; none, none used. A keeper that fails (gone, refusing) is dropped with
one log line: the daemon goes on without it, as with none. A stopping daemon
leaves its pages with the keeper (``detach``). Until the daemon's books are
saved (``statefile.py``), a new daemon cannot prove what its predecessor's
pages held, so it has the keeper let them go at start, counted and logged.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

from kvelastic.daemon.devices import Device
from kvelastic.errors import KvelasticError
from kvelastic.keeper.client import KeeperClient
from kvelastic.protocol import keeper_socket_path
from kvelastic.vmm.errors import VmmError

log = logging.getLogger("kvelastic.daemon")
# The loop waits this long at most for the keeper (a local process of the same
# user, answering in well under a millisecond); past it the keeper is dropped.
KEEPER_TIMEOUT = 1.0


class PageKeeper:
    def __init__(self, client: KeeperClient) -> None:
        self.client: KeeperClient | None = client

    @classmethod
    def find(cls, socket_path: str) -> PageKeeper | None:
        """The keeper beside ``socket_path``, or None (none listens, or it cannot be used)."""
        path = keeper_socket_path(socket_path)
        if not os.path.exists(path):
            log.info("no keeper on %s: pages die with the daemon (`kvelastic keeper` keeps them)", path)
            return None
        try:
            return cls(KeeperClient(path, timeout=KEEPER_TIMEOUT))
        except KvelasticError as exc:
            log.warning("keeper on %s not used: %s", path, exc)
            return None

    def start(self) -> int:
        """Let go of what a former daemon deposited (nothing proves it current
        yet); how many pages that was."""
        if self.client is None:
            return 0
        try:
            former = self.client.status().page_ids
            if former:
                self.client.forget(former)
        except (KvelasticError, OSError) as exc:
            self._lost(exc)
            return 0
        log.info("keeper: %d page(s) of the former daemon let go (no saved books to prove them)", len(former))
        return len(former)

    def keep(self, device: Device, page_ids: Sequence[int]) -> None:
        """Deposit new pages of ``device``."""
        if self.client is None or not page_ids:
            return
        fds: list[tuple[int, int]] = []
        try:
            for page_id in page_ids:
                fds.append((page_id, device.export(page_id)))
            self.client.keep(fds)
        except (KvelasticError, OSError, VmmError) as exc:
            self._lost(exc)
        finally:
            for _, fd in fds:
                os.close(fd)

    def forget(self, page_ids: Sequence[int]) -> None:
        """Pages the daemon let go of."""
        if self.client is None or not page_ids:
            return
        try:
            self.client.forget(page_ids)
        except (KvelasticError, OSError) as exc:
            self._lost(exc)

    def detach(self) -> None:
        """The daemon stops: its pages stay with the keeper."""
        if self.client is not None:
            self.client.close()
            self.client = None

    def _lost(self, exc: BaseException) -> None:
        log.warning("keeper failed (%s): going on without it; pages now die with the daemon", exc)
        self.detach()
