"""The page channel and the keeper's socket: AF_UNIX sockets beside the ZMQ
one, and the greeting that opens a page channel.

Page descriptors never travel over ZMQ: they go over the page channel
(``kvelastic.vmm.fdchannel``), each batch with the ``MapSlab`` that names
them (encoded as on the control socket, ``codec.py``); an ``UnmapSlab`` goes
there too, as a batch without pages. A client opens that channel with a
``Hello`` (who it is); a worker sends its ``Mapped`` and ``Unmapped`` back
on it (``<u32 size>`` then the message; ZMQ still takes them too), an engine
nothing; its closing tells the daemon the peer is gone.

The only module of the protocol that touches a socket.
"""

from __future__ import annotations

import socket
from typing import Annotated

import msgspec

from kvelastic.names import Name
from kvelastic.protocol.base import MAX_WORKERS, PROTOCOL_VERSION, Token

# A page channel's rank: a worker's, or -1 for the engine's own lifeline.
Rank = Annotated[int, msgspec.Meta(ge=-1, lt=MAX_WORKERS)]


def fd_socket_path(socket_path: str) -> str:
    """The AF_UNIX page channel lives beside the ZMQ socket."""
    return socket_path + ".fd"


def keeper_socket_path(socket_path: str) -> str:
    """The keeper of the daemon's pages (``kvelastic keeper``) listens beside it too."""
    return socket_path + ".keeper"


# Untagged, plain msgpack: a greeting is read with its type known, never
# through the control socket's decoder.
class Hello(msgspec.Struct):
    version: int
    engine_id: Name
    rank: Rank                   # worker rank, or -1 for the engine's lifeline
    # Its engine's secret: a lifeline or page channel counts for the engine
    # only with it (descriptors go only to such a channel).
    token: Token = b""


def write_hello(sock: socket.socket, engine_id: str, rank: int, token: bytes = b"") -> None:
    data = msgspec.msgpack.encode(Hello(PROTOCOL_VERSION, engine_id, rank, token))
    sock.sendall(len(data).to_bytes(4, "little") + data)


def read_hello(sock: socket.socket) -> Hello:
    size = int.from_bytes(_recv_exact(sock, 4), "little")
    if size > 4096:
        raise ValueError(f"hello of {size} bytes")
    hello = msgspec.msgpack.decode(_recv_exact(sock, size), type=Hello)
    if hello.version != PROTOCOL_VERSION:
        raise ValueError(f"protocol version {hello.version}, expected {PROTOCOL_VERSION}")
    return hello


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ValueError("peer closed during hello")
        data += chunk
    return data
