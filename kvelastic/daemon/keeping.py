"""The daemon's side of the keeper (``kvelastic keeper``): every page
the daemon creates is deposited there, every page it lets go is forgotten, so
the keeper always holds the daemon's pages and they outlive its process.

Used when a keeper listens beside the daemon's socket (``$KVELASTIC_SOCKET.keeper``)
at start; none, none used. A keeper that fails (gone, refusing) is dropped with
one log line: the daemon goes on without it, as with none. A stopping daemon
leaves its pages with the keeper (``detach``). A new daemon takes back the
kept cache its predecessor saved and has the keeper let go of every other
page (``succession.py``).
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
# user, answering in well under a millisecond); past it the keeper is dropped,
# and the kept cache will not survive this daemon. Well below the workers'
# acknowledgement deadline (``ACK_TIMEOUT``, 5 s), which a loop held longer
# would count against engines whose acks wait unread.
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

    def held(self) -> list[int]:
        """The page ids the keeper holds (a former daemon's, at start)."""
        if self.client is None:
            return []
        try:
            return self.client.status().page_ids
        except (KvelasticError, OSError) as exc:
            self._lost(exc)
            return []

    def take(self, page_ids: Sequence[int]) -> list[tuple[int, int]]:
        """``(page id, fd)`` of the held ones among ``page_ids``: the caller's to close (the keeper keeps its own)."""
        if self.client is None or not page_ids:
            return []
        try:
            return self.client.take(page_ids)
        except (KvelasticError, OSError) as exc:
            self._lost(exc)
            return []

    def let_go(self, page_ids: Sequence[int]) -> int:
        """Have the keeper close a former daemon's pages nothing proves current; how many."""
        if self.client is None or not page_ids:
            return 0
        try:
            return len(self.client.forget(page_ids))
        except (KvelasticError, OSError) as exc:
            self._lost(exc)
            return 0

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
