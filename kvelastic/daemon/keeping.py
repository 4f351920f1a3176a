"""The daemon's side of the keeper (``kvelastic keeper``): every page
the daemon creates is deposited there, every page it lets go is forgotten, so
the keeper always holds the daemon's pages and they outlive its process.

Which keeper (``KVELASTIC_KEEPER``): the one listening beside the daemon's
socket (``$KVELASTIC_SOCKET.keeper``) at start; with none, ``auto`` starts one
in a session of its own, so that it outlives the daemon (a crash, ``kill -9``,
Ctrl-C of a terminal) and lingers ``KVELASTIC_KEEPER_LINGER`` for the next
daemon; ``external`` starts none (systemd and the DaemonSet run their own);
``off`` uses none. A keeper that fails (gone, refusing) is dropped with one
log line: the daemon goes on without it, as with none. A stopping daemon
leaves its pages with the keeper (``detach``). A new daemon takes back the
kept cache its predecessor saved and has the keeper let go of every other
page (``succession.py``).
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

from kvelastic.daemon.devices import Device
from kvelastic.errors import KvelasticError
from kvelastic.keeper.client import KeeperClient, KeeperRefused
from kvelastic.protocol import keeper_socket_path
from kvelastic.vmm.errors import VmmError

log = logging.getLogger("kvelastic.daemon")
# The loop waits this long at most for the keeper (a local process of the same
# user, answering in well under a millisecond); past it the keeper is dropped,
# and the kept cache will not survive this daemon. Well below the workers'
# acknowledgement deadline (``ACK_TIMEOUT``, 5 s), which a loop held longer
# would count against engines whose acks wait unread.
KEEPER_TIMEOUT = 1.0
# A keeper the daemon starts is ready within a second (an interpreter and a
# socket); past this it is given up and the daemon runs without one.
KEEPER_START_TIMEOUT = 20.0


def listening(path: str) -> bool:
    """Whether a connection to ``path`` is accepted: the socket file appears at
    ``bind``, a moment before ``listen``, when a connection is still refused."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
        return True
    except OSError:
        return False
    finally:
        probe.close()


def start_keeper(socket_path: str, linger: float) -> subprocess.Popen[bytes]:
    """``kvelastic keeper --linger`` in a session of its own (no terminal
    signal reaches it), logging to ``$KVELASTIC_SOCKET.keeper.log``; returns
    once it listens. Raises ``KvelasticError`` if it exits or does not listen."""
    path = keeper_socket_path(socket_path)
    if os.path.exists(path):
        os.unlink(path)     # a dead keeper's (``find`` could not connect): its pages died with it
    env = {k: v for k, v in os.environ.items() if k != "NOTIFY_SOCKET"}   # the daemon's readiness is its own
    fd = os.open(path + ".log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        proc = subprocess.Popen([sys.executable, "-m", "kvelastic", "keeper", "--linger", f"{linger:g}"],
                                env=env, stdin=subprocess.DEVNULL, stdout=fd, stderr=fd, start_new_session=True)
    finally:
        os.close(fd)
    deadline = time.monotonic() + KEEPER_START_TIMEOUT
    while proc.poll() is None and time.monotonic() < deadline:
        if listening(path):
            return proc
        time.sleep(0.02)
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    raise KvelasticError(f"the keeper it started did not listen on {path} within {KEEPER_START_TIMEOUT:g} s "
                         f"(exit status {proc.returncode}; its log: {path}.log)")


class PageKeeper:
    def __init__(self, client: KeeperClient, started: subprocess.Popen[bytes] | None = None) -> None:
        self.client: KeeperClient | None = client
        self.started = started       # the keeper this daemon started, or None (one of its own)

    @classmethod
    def open(cls, socket_path: str, mode: str, linger: float) -> PageKeeper | None:
        """The keeper ``mode`` (``KVELASTIC_KEEPER``) says, or None."""
        if mode == "off":
            log.info("KVELASTIC_KEEPER=off: no keeper; pages die with the daemon")
            return None
        found = cls.find(socket_path, quiet=mode == "auto")
        if found is not None or mode == "external":
            return found
        try:
            proc = start_keeper(socket_path, linger)
            keeper = cls(KeeperClient(keeper_socket_path(socket_path), timeout=KEEPER_TIMEOUT), started=proc)
        except (KvelasticError, OSError) as exc:
            log.warning("no keeper: %s; pages die with the daemon", exc)
            return None
        log.info("started a keeper (pid %d) on %s: it outlives this daemon and holds its pages %g s for the "
                 "next one (KVELASTIC_KEEPER_LINGER)", proc.pid, keeper_socket_path(socket_path), linger)
        return keeper

    @classmethod
    def find(cls, socket_path: str, quiet: bool = False) -> PageKeeper | None:
        """The keeper listening beside ``socket_path``, or None (none listens,
        or it cannot be used); ``quiet``: no line for a socket nobody listens on."""
        path = keeper_socket_path(socket_path)
        if not os.path.exists(path):
            if not quiet:
                log.info("no keeper on %s: pages die with the daemon (`kvelastic keeper` keeps them)", path)
            return None
        try:
            return cls(KeeperClient(path, timeout=KEEPER_TIMEOUT))
        except KeeperRefused as exc:
            log.warning("keeper on %s not used: %s", path, exc)
            return None
        except (KvelasticError, OSError) as exc:    # a dead keeper's socket: it starts a new one
            if not quiet:
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
