"""``kvelastic keeper``: a process that holds page descriptors for the daemon.

A page is a memfd (a CUDA allocation exported as a POSIX descriptor on a
GPU): its memory lives as long as one descriptor of it is open somewhere.
The daemon deposits every page it creates here and forgets the ones it
releases, so when the daemon dies (``kill -9``, the OOM killer, an upgrade)
its pages do not: the next daemon takes them back. The keeper decides
nothing about memory; it only holds what it is given and gives it back to
the daemon's user (``SO_PEERCRED``: that uid or root, no one else).

A loop over one listening socket and its connections; every request is
answered within ``REQUEST_TIMEOUT`` or its connection is closed (a stalled
peer never holds the loop), and a request refused changes nothing.

A keeper the daemon started itself (``KVELASTIC_KEEPER=auto``) lingers: with
no connection for ``linger`` seconds (no daemon came back), it lets go of
its pages and exits, so a daemon stopped for good does not pin its memory.
A keeper run on its own (systemd, a sidecar) has no linger and stays.
"""

from __future__ import annotations

import logging
import os
import resource
import selectors
import socket
import time
from collections.abc import Callable

import msgspec

from kvelastic.client.trust import peer_credentials
from kvelastic.errors import KvelasticError
from kvelastic.keeper import messages as m
from kvelastic.keeper.holdings import Holdings
from kvelastic.vmm.errors import FdChannelError, PeerClosed
from kvelastic.vmm.fdchannel import FdChannel, listen

log = logging.getLogger("kvelastic.keeper")
REQUEST_TIMEOUT = 5.0          # s: a request's bytes must all arrive within this
SPARE_FDS = 64                 # descriptors the keeper keeps for itself (sockets, logs)


def fd_budget() -> int:
    """Pages the keeper may hold: its descriptor limit, raised to the hard one, less a margin."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return max(0, resource.getrlimit(resource.RLIMIT_NOFILE)[0] - SPARE_FDS)


class KeeperError(KvelasticError):
    reason = "keeper"


def lingered(linger: float | None, connections: int, idle_since: float, now: float) -> bool:
    """Whether a keeper is done waiting for a daemon: it has a linger, no
    connection, and has had none since ``idle_since`` (its start, or its last
    connection's close) for ``linger`` seconds."""
    return linger is not None and connections == 0 and now - idle_since >= linger


class Keeper:
    def __init__(self, path: str, max_pages: int | None = None, linger: float | None = None) -> None:
        self.path = path
        self.linger = linger
        self.connections = 0
        self.idle_since = time.monotonic()
        self.holdings = Holdings(fd_budget() if max_pages is None else max_pages)
        self.uid = os.geteuid()
        if os.path.exists(path):
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(path)
            except OSError:
                os.unlink(path)        # a former keeper's socket: the pages it held died with it
            else:
                raise KeeperError(f"a keeper already listens on {path}: one keeper per daemon socket")
            finally:
                probe.close()
        self.listener = listen(path)
        os.chmod(path, 0o600)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ)

    def serve(self, stop: Callable[[], bool], tick: float = 0.5) -> bool:
        """Until ``stop()``; True when it returned because it lingered out."""
        while not stop():
            for key, _ in self.selector.select(tick):
                if key.fileobj is self.listener:
                    self._accept()
                else:
                    self._answer(key.data)
            if lingered(self.linger, self.connections, self.idle_since, time.monotonic()):
                return True
        return False

    def _accept(self) -> None:
        chan = FdChannel.accept(self.listener)
        pid, uid, _ = peer_credentials(chan.sock)
        if uid not in (0, self.uid):
            log.warning("keeper: refused a connection of pid %d (uid %d): only uid %d may use the keeper",
                        pid, uid, self.uid)
            self.holdings.refused["not_allowed"] = self.holdings.refused.get("not_allowed", 0) + 1
            chan.close()
            return
        chan.sock.settimeout(REQUEST_TIMEOUT)
        self.selector.register(chan.sock, selectors.EVENT_READ, chan)
        self.connections += 1
        log.info("keeper: pid %d connected (%d pages held)", pid, len(self.holdings.fds))

    def _drop(self, chan: FdChannel) -> None:
        self.selector.unregister(chan.sock)
        chan.close()
        self.connections -= 1
        if not self.connections:
            self.idle_since = time.monotonic()

    def _answer(self, chan: FdChannel) -> None:
        try:
            batch, command = chan.recv_batch()
        except PeerClosed:
            self._drop(chan)
            return
        except (FdChannelError, OSError) as exc:      # out of step, or stalled past REQUEST_TIMEOUT
            log.warning("keeper: a connection dropped: %s", exc)
            self._drop(chan)
            return
        try:
            request = m.decode_request(command)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            answer = self.holdings.refuse("bad_request", f"not a keeper request: {exc}", batch)
        else:
            answer = self.holdings.handle(request, batch)
        reply = answer.reply
        if isinstance(reply, m.KeeperStatus):
            reply.bytes = sum(os.fstat(fd).st_size for fd in self.holdings.fds.values())
        if isinstance(reply, m.Refused):
            log.warning("keeper: refused a request (%s): %s", reply.reason, reply.message)
        for fd in answer.close:        # before the reply: once answered, what was let go is gone
            os.close(fd)
        try:
            chan.send(answer.send, m.encode(reply))
        except (FdChannelError, OSError) as exc:
            log.warning("keeper: a reply was lost: %s", exc)
            self._drop(chan)

    def close(self) -> None:
        self.selector.close()
        self.listener.close()
        try:
            os.unlink(self.path)       # no dead keeper's socket for the next daemon to find
        except FileNotFoundError:
            pass
        for fd in self.holdings.fds.values():
            os.close(fd)
        self.holdings.fds.clear()
