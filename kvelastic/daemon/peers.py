"""The daemon's AF_UNIX side: page channels to workers, lifelines to engines.

Every engine and worker opens one connection with a ``Hello`` saying who it
is. The daemon sends page descriptors to workers on theirs and nothing else;
peers never send after their hello, so a readable connection means the peer
closed it: the process died, whatever its PID namespace.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import msgspec
import zmq

from kvelastic import protocol as p
from kvelastic.vmm import fdchannel

log = logging.getLogger("kvelastic.daemon")


@dataclasses.dataclass
class Peer:
    channel: fdchannel.FdChannel
    engine_id: str
    rank: int           # -1: the engine itself


class PeerTable:
    def __init__(self, path: str, poller: zmq.Poller, on_bad_hello: Callable[[], None]) -> None:
        self.listener = fdchannel.listen(path)
        self.listener.setblocking(False)
        self.poller = poller
        self.poller.register(self.listener.fileno(), zmq.POLLIN)
        self._on_bad_hello = on_bad_hello
        self.by_fd: dict[int, Peer] = {}

    def accept(self) -> None:
        """Take every waiting connection whose hello is valid."""
        while True:
            try:
                conn, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            try:
                conn.settimeout(1.0)
                hello = p.read_hello(conn)
            except (OSError, ValueError, msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.warning("page channel: bad hello (%s)", exc)
                self._on_bad_hello()
                conn.close()
                continue
            self.by_fd[conn.fileno()] = Peer(fdchannel.FdChannel(conn), hello.engine_id, hello.rank)
            self.poller.register(conn.fileno(), zmq.POLLIN)

    def find(self, engine_id: str, rank: int) -> Peer | None:
        for peer in self.by_fd.values():
            if peer.engine_id == engine_id and peer.rank == rank:
                return peer
        return None

    def drop(self, fd: int) -> Peer:
        """The peer on ``fd`` closed its end: forget it."""
        peer = self.by_fd.pop(fd)
        self.poller.unregister(fd)
        peer.channel.close()
        return peer

    def close(self) -> None:
        for peer in self.by_fd.values():
            peer.channel.close()
        self.by_fd.clear()
        self.listener.close()
