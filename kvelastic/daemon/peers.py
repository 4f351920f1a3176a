"""The daemon's AF_UNIX side: page channels to workers, lifelines to engines.

Every engine and worker opens one connection and greets with a ``Hello``
saying who it is. The daemon sends page descriptors to workers on theirs,
each batch with the ``MapSlab`` that names them, and ``UnmapSlab`` commands
(batches without pages), nothing else. A worker
sends its acks (``Mapped``, ``Unmapped``) back on it, each framed like the
hello (``<u32 size><msgpack>``, at most ``MAX_ACK`` bytes). An engine sends
its journal on its lifeline, framed the same way (at most ``MAX_JOURNAL``
bytes a frame): once ``send`` returns, the frame is in the daemon's socket,
so it outlives a ``kill -9`` of the engine, and the daemon reads it before
the end of the stream. A connection's closing tells the daemon the process
died, whatever its PID namespace.

Nothing here blocks the loop: connections are accepted and greetings read
without blocking, a greeting must be complete within ``HELLO_TIMEOUT``, and
descriptors are sent with a short timeout (a worker that does not read its
channel fails, it does not stall the daemon).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import struct

import msgspec
import zmq

from kvelastic import protocol as p
from kvelastic.daemon.tenancy import Credential, Tenancy, groups_of
from kvelastic.vmm import fdchannel

log = logging.getLogger("kvelastic.daemon")
MAX_HELLO = 4096
MAX_ACK = 4096                # one ack frame on a worker's channel
MAX_JOURNAL = p.MAX_MESSAGE_BYTES   # one journal frame on an engine's lifeline (the client ships parts)
READ_CHUNK = 16384            # read from a worker's channel per pass: a flood never holds the loop
LIFELINE_READ = 1 << 20       # read from an engine's lifeline per pass (a journal frame is at most MAX_JOURNAL)
MAX_GREETING = 256            # connections still greeting; more wait in the kernel's backlog
MIN_CHANNELS_PER_TENANT = 64  # the least a tenant may hold open, whatever the descriptor limit


@dataclasses.dataclass
class Peer:
    channel: fdchannel.FdChannel
    engine_id: str
    rank: int           # -1: the engine itself
    since: float = 0.0  # greeted at
    token: bytes = b""  # the secret its hello showed
    cred: Credential | None = None
    inbox: bytearray = dataclasses.field(default_factory=bytearray)   # a frame read in part
    refused: int = 0    # acks on it the loop refused (logged once)


@dataclasses.dataclass(frozen=True)
class Access:
    """Who may open a page channel (checked with ``SO_PEERCRED``): root, the
    daemon's own user, and members of ``group`` (default: the daemon's group)."""

    uid: int = dataclasses.field(default_factory=os.geteuid)
    group: int = dataclasses.field(default_factory=os.getegid)

    def allows(self, conn: socket.socket) -> tuple[int, int, int] | None:
        """The peer's ``(uid, gid, pid)`` if it may connect, else None."""
        pid, uid, gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                            struct.calcsize("3i")))
        if uid in (0, self.uid) or gid == self.group or self.group in groups_of(pid):
            return uid, gid, pid
        log.warning("page channel: refused pid %d (uid %d, gid %d): not the daemon's user nor in group %d",
                    pid, uid, gid, self.group)
        return None


@dataclasses.dataclass
class Greeting:
    sock: socket.socket
    deadline: float
    cred: Credential
    data: bytes = b""


class PeerTable:
    def __init__(self, path: str, poller: zmq.Poller, access: Access | None = None,
                 tenancy: Tenancy | None = None, max_per_tenant: int = 1024) -> None:
        self.access = access or Access()
        self.tenancy = tenancy or Tenancy()
        # Descriptors one tenant uid may hold open here (channels and greetings):
        # none can run the daemon out of them for the pages and the others.
        self.max_per_tenant = max(MIN_CHANNELS_PER_TENANT, max_per_tenant)
        self.open_by_uid: dict[int, int] = {}
        self.refused = 0          # connections refused for their credentials (counted by the loop)
        self.over_limit = 0       # connections refused: their uid holds too many (counted by the loop)
        self.listener = fdchannel.listen(path, backlog=64)
        self.listener.setblocking(False)
        self.poller = poller
        self.poller.register(self.listener.fileno(), zmq.POLLIN)
        self.by_fd: dict[int, Peer] = {}
        self.by_key: dict[tuple[str, int, bytes], int] = {}   # (engine id, rank, secret) -> fd, the first one
        self.greeting: dict[int, Greeting] = {}
        self.accept_paused_until = 0.0
        self.listening = True

    def _listen(self, on: bool) -> None:
        if on != self.listening:
            (self.poller.register(self.listener.fileno(), zmq.POLLIN) if on
             else self.poller.unregister(self.listener.fileno()))
            self.listening = on

    def accept(self, now: float) -> None:
        """Take waiting connections (their greetings are read as they come).
        While too many are greeting, or the process is out of descriptors, the
        listener leaves the poller (it would be readable on every pass) and the
        kernel's backlog holds the rest."""
        if self.listening and now < self.accept_paused_until:
            self._listen(False)
        if not self.listening and now >= self.accept_paused_until and len(self.greeting) < MAX_GREETING:
            self._listen(True)
        if not self.listening:
            return
        while True:
            if len(self.greeting) >= MAX_GREETING:
                self._listen(False)
                return
            try:
                conn, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:   # out of file descriptors: try again shortly, never crash
                log.error("page channel: cannot accept a connection: %s", exc)
                self.accept_paused_until = now + 0.5
                self._listen(False)
                return
            ids = self.access.allows(conn)
            if ids is None:
                self.refused += 1
                conn.close()
                continue
            cred = self.tenancy.credential(*ids)
            if cred.tenant and self.open_by_uid.get(cred.uid, 0) >= self.max_per_tenant:
                if not self.over_limit:
                    log.warning("page channel: refused pid %d: uid %d holds %d channels, the most a tenant may",
                                cred.pid, cred.uid, self.max_per_tenant)
                self.over_limit += 1
                conn.close()
                continue
            self.open_by_uid[cred.uid] = self.open_by_uid.get(cred.uid, 0) + 1
            conn.setblocking(False)
            self.greeting[conn.fileno()] = Greeting(conn, now + p.HELLO_TIMEOUT, cred)
            self.poller.register(conn.fileno(), zmq.POLLIN)

    def read_greetings(self, ready: set[int], now: float) -> tuple[list[Peer], int]:
        """Greetings completed (new peers), and how many were bad or too slow."""
        opened: list[Peer] = []
        bad = 0
        for fd, g in list(self.greeting.items()):
            if fd in ready and not self._read_hello(g):
                self._forget_greeting(fd)
                continue
            hello, why = self._parse(g.data)
            if hello is not None:
                del self.greeting[fd]
                # A tenant's engine ids carry its uid (``tenancy.py``): its
                # hello can only ever name its own engines.
                peer = Peer(fdchannel.FdChannel(g.sock), g.cred.scope(hello.engine_id), hello.rank, now,
                            hello.token, g.cred)
                self.by_fd[fd] = peer
                self.by_key.setdefault((peer.engine_id, peer.rank, peer.token), fd)
                if peer.rank < 0:
                    # A lifeline wakes the loop only when it closes. Its journal
                    # is read before the engine's next message, at its end, and
                    # on the loop's periodic pass (``lifelines``): a seal on the
                    # engine's scheduler thread then costs no wake-up of the
                    # daemon, which would run on the writer's core (docs/benchmarks.md).
                    self.poller.modify(fd, zmq.POLLERR)
                opened.append(peer)
            elif why or now > g.deadline:
                log.warning("page channel: bad hello (%s)", why or f"not complete within {p.HELLO_TIMEOUT:g} s")
                bad += 1
                self._forget_greeting(fd)
        return opened, bad

    @staticmethod
    def _read_hello(g: Greeting) -> bool:
        """Read what has come of ``g``'s hello, to its end and not beyond: what
        follows it (a worker's first ack) is read as such once the greeting
        is done. False when the peer closed."""
        while True:
            have = len(g.data)
            size = int.from_bytes(g.data[:4], "little") if have >= 4 else 0
            left = 4 - have if have < 4 else 4 + size - have
            if left <= 0 or size > MAX_HELLO:
                return True          # complete, or announcing too much: ``_parse`` says which
            try:
                chunk = g.sock.recv(left)
            except (BlockingIOError, InterruptedError):
                return True
            except OSError:
                return False
            if not chunk:
                return False
            g.data += chunk

    @staticmethod
    def _parse(data: bytes) -> tuple[p.Hello | None, str]:
        if len(data) < 4:
            return None, ""
        size = int.from_bytes(data[:4], "little")
        if size > MAX_HELLO or len(data) > 4 + size:
            return None, f"hello of {size} bytes"
        if len(data) < 4 + size:
            return None, ""
        try:
            hello = msgspec.msgpack.decode(data[4:], type=p.Hello)
        except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError, RecursionError) as exc:
            return None, f"undecodable: {exc}"
        if hello.version != p.PROTOCOL_VERSION:
            return None, f"protocol version {hello.version}, expected {p.PROTOCOL_VERSION}"
        return hello, ""

    def _forget_greeting(self, fd: int) -> None:
        g = self.greeting.pop(fd)
        self.poller.unregister(fd)
        g.sock.close()
        self._closed(g.cred)

    def _closed(self, cred: Credential | None) -> None:
        if cred is None:
            return
        left = self.open_by_uid[cred.uid] - 1
        if left:
            self.open_by_uid[cred.uid] = left
        else:
            del self.open_by_uid[cred.uid]

    @staticmethod
    def send_pages(peer: Peer, items: list[tuple[int, int]], command: bytes = b"") -> None:
        """Descriptors to a worker, with the command that names them, waiting at
        most ``SEND_PAGES_TIMEOUT`` for room in its socket (sockets stay
        non-blocking otherwise)."""
        peer.channel.sock.settimeout(p.SEND_PAGES_TIMEOUT)
        try:
            peer.channel.send(items, command)
        finally:
            peer.channel.sock.setblocking(False)

    def find(self, engine_id: str, rank: int, token: bytes) -> Peer | None:
        """The channel of that worker (rank -1: the engine's lifeline) that
        showed its engine's secret (an impostor's hello for the same engine
        and rank never gets descriptors, nor speaks for it)."""
        fd = self.by_key.get((engine_id, rank, token))
        return None if fd is None else self.by_fd[fd]

    def lifelines(self) -> list[int]:
        """The engines' lifelines (their journals are read on a periodic pass)."""
        return [fd for fd, peer in self.by_fd.items() if peer.rank < 0]

    def receive(self, fd: int) -> tuple[list[bytes], bool]:
        """What a peer sent, without waiting: its complete frames (a worker's
        acks, an engine's journal; a frame may arrive in parts), and whether
        it closed after them, or broke the framing (the frames before the
        break still count: they came before it)."""
        peer = self.by_fd[fd]
        lifeline = peer.rank < 0
        budget = LIFELINE_READ if lifeline else READ_CHUNK
        limit = MAX_JOURNAL if lifeline else MAX_ACK
        inbox = peer.inbox
        frames: list[bytes] = []
        closed = False
        while budget > 0:
            try:
                data = peer.channel.sock.recv(min(budget, 1 << 18), socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                closed = True
                break
            if not data:
                closed = True
                break
            budget -= len(data)
            inbox += data
            while len(inbox) >= 4:
                size = int.from_bytes(inbox[:4], "little")
                if size > limit:
                    log.warning("%s of %s: a frame of %d bytes (at most %d); closing it",
                                "lifeline" if lifeline else f"page channel rank {peer.rank}", peer.engine_id,
                                size, limit)
                    return frames, True
                if len(inbox) < 4 + size:
                    break
                frames.append(bytes(inbox[4:4 + size]))
                del inbox[:4 + size]
            if not lifeline:
                break      # a worker's acks are small: one read a pass
        return frames, closed

    def unclaimed(self, known: set[tuple[str, bytes]], now: float) -> list[int]:
        """Channels open for ``REGISTER_TIMEOUT`` that speak for no registration
        (registered or departing): no such engine, or not its secret. Nobody's,
        so they are closed (a cap on what any local process can hold open)."""
        return [fd for fd, peer in self.by_fd.items()
                if (peer.engine_id, peer.token) not in known and now - peer.since > p.REGISTER_TIMEOUT]

    def drop(self, fd: int) -> Peer:
        """The peer on ``fd`` closed its end: forget it."""
        peer = self.by_fd.pop(fd)
        key = (peer.engine_id, peer.rank, peer.token)
        if self.by_key.get(key) == fd:
            del self.by_key[key]
            for other, rest in self.by_fd.items():   # another channel with the same name takes its place
                if (rest.engine_id, rest.rank, rest.token) == key:
                    self.by_key[key] = other
                    break
        self.poller.unregister(fd)
        peer.channel.close()
        self._closed(peer.cred)
        return peer

    def close(self) -> None:
        for peer in self.by_fd.values():
            peer.channel.close()
        for g in self.greeting.values():
            g.sock.close()
        self.by_fd.clear()
        self.by_key.clear()
        self.greeting.clear()
        self.open_by_uid.clear()
        self.listener.close()
