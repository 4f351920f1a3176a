"""A worker's acks on its page channel (protocol 2): a map arrives with its
pages and is acknowledged there, with no ZMQ hop on a grant's path; an
engine's journal on its lifeline (protocol 3). What else arrives on a page
channel or a lifeline is bad input: refused, counted, and the books stay as
they were; a frame that breaks the framing closes that channel only."""

from __future__ import annotations

import socket

import msgspec
import pytest

from kvelastic import protocol as p
from kvelastic.daemon.peers import MAX_ACK, MAX_JOURNAL
from kvelastic.daemon.server import Daemon
from tests.daemon import threaded
from tests.daemon.hostile import open_lifeline
from tests.daemon_proc import wait_for

MiB = 1 << 20


@pytest.fixture
def served(tmp_path):
    with threaded.served(tmp_path, shrink_grace=60) as parts:
        yield parts


def rejected(daemon: Daemon, reason: str) -> float:
    return daemon.metrics.registry.get_sample_value("kvelastic_rejected_messages_total", {"reason": reason}) or 0.0


def books(daemon: Daemon) -> dict:
    """Every engine's slabs and their phases, and each device's free pages."""
    alloc = daemon.allocator
    return {"engines": {e.engine_id: ({i: s.phase for i, s in e.slabs.items()}, e.failed)
                        for e in alloc.engines.values()},
            "free": {d: sorted(pool.free) for d, pool in alloc.pools.items()}}


def frame(msg: p.Msg | bytes) -> bytes:
    data = msg if isinstance(msg, bytes) else p.encode(msg)
    return len(data).to_bytes(4, "little") + data


def test_a_grant_is_mapped_and_acknowledged_on_the_page_channel(served):
    daemon, engine, worker = served
    errors_before = worker.conn.errors
    assert engine.ensure(8)                       # two slabs: mapped, acknowledged, granted
    assert sorted(worker.slabs) == sorted(engine.pool.slab_ids()) and len(worker.slabs) == 2
    slab = engine.pool.slab_ids()[0]
    engine.pool.take_slab_back(slab)
    engine.conn.call(p.Return(engine_id="e", slabs=[slab]))   # answered once the worker's Unmapped came
    assert slab not in worker.slabs
    assert worker.conn.errors == errors_before    # every ack was taken
    daemon.check()


def test_bad_acks_on_a_page_channel_are_refused_counted_and_change_nothing(served):
    daemon, engine, worker = served
    assert engine.ensure(4)
    slab = engine.pool.slab_ids()[0]
    before = {r: rejected(daemon, r) for r in ("malformed", "unexpected", "unexpected_ack", "not_owner",
                                             "bad_hello")}
    kept = books(daemon)
    # A second channel of the same worker (its secret): bad acks on it are refused one by one.
    own = open_lifeline(daemon.socket_path, "e", rank=0, token=engine.token)
    # An impostor's channel (no secret) for the same worker: nothing it says
    # counts. Its hello and ack in one write: the greeting is read to the
    # hello's end, the ack as an ack.
    impostor = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    impostor.connect(p.fd_socket_path(daemon.socket_path))
    hello = msgspec.msgpack.encode(p.Hello(p.PROTOCOL_VERSION, "e", 0, b""))
    try:
        impostor.sendall(len(hello).to_bytes(4, "little") + hello + frame(p.Mapped(engine_id="e", rank=0, slab=slab,
                                                                                   req_id=8)))
        own.sendall(frame(b"\xc1 not msgpack"))
        own.sendall(frame(p.Heartbeat(engine_id="e")))
        own.sendall(frame(p.Unmapped(engine_id="e", rank=0, slab=slab, req_id=7)))   # no unmap pending
        wait_for(lambda: rejected(daemon, "not_owner") == before["not_owner"] + 1, what="the impostor's ack refused")
        wait_for(lambda: rejected(daemon, "unexpected_ack") == before["unexpected_ack"] + 1, what="the stray ack")
        assert rejected(daemon, "malformed") == before["malformed"] + 1
        assert rejected(daemon, "unexpected") == before["unexpected"] + 1
        assert rejected(daemon, "bad_hello") == before["bad_hello"]
        assert books(daemon) == kept
        # A frame past the limit breaks the framing: that channel is closed, the worker's stays.
        own.sendall((MAX_ACK + 1).to_bytes(4, "little") + b"\0" * 16)
        own.settimeout(5)
        assert own.recv(1) == b""
    finally:
        own.close()
        impostor.close()
    assert engine.ensure(8)                       # the worker's own channel still maps and acknowledges
    daemon.check()


def test_an_engine_journal_on_its_lifeline_is_applied_and_nothing_else_is(served):
    daemon, engine, _ = served
    assert engine.ensure(4)
    mirror = daemon.allocator.engines["e"].mirror
    with engine.lock:
        [block] = engine.pool.allocate(1)
        engine.pool.cache([block], [b"k" * 8])
        engine.flush_journal()                     # on the lifeline, no reply
    wait_for(lambda: mirror.key_of.get(block.block_id) == b"k" * 8, what="the journal applied")
    before = {r: rejected(daemon, r) for r in ("malformed", "unexpected", "not_owner")}
    kept = (dict(mirror.key_of), books(daemon))
    # A second lifeline with the engine's own secret, and an impostor's without it:
    # a journal on either is not the engine's (its order is its first lifeline's).
    second = open_lifeline(daemon.socket_path, "e", rank=-1, token=engine.token)
    impostor = open_lifeline(daemon.socket_path, "e", rank=-1, token=b"")
    wait_for(lambda: sum(peer.rank == -1 for peer in list(daemon.peers.by_fd.values())) == 3, what="greeted")
    clear = p.Journal(engine_id="e", ops=[p.ClearKeys()], occupancy={})
    try:
        second.sendall(frame(clear))
        impostor.sendall(frame(clear))
        wait_for(lambda: rejected(daemon, "not_owner") == before["not_owner"] + 2, what="both journals refused")
        # On its own lifeline: anything but a journal is refused and counted.
        assert engine.conn.write_lifeline(p.encode(p.Heartbeat(engine_id="e")))
        assert engine.conn.write_lifeline(b"\xc1 not msgpack")
        assert engine.conn.write_lifeline(p.encode(p.Journal(engine_id="other", ops=[p.ClearKeys()], occupancy={})))
        wait_for(lambda: rejected(daemon, "malformed") == before["malformed"] + 1, what="the undecodable frame")
        wait_for(lambda: rejected(daemon, "not_owner") == before["not_owner"] + 3, what="another engine's journal")
        assert rejected(daemon, "unexpected") == before["unexpected"] + 1
        assert (dict(mirror.key_of), books(daemon)) == kept          # nothing changed
        # A frame past the limit breaks the framing: that lifeline is closed, the engine's stays.
        second.sendall((MAX_JOURNAL + 1).to_bytes(4, "little") + b"\0" * 16)
        second.settimeout(5)
        assert second.recv(1) == b""
    finally:
        second.close()
        impostor.close()
    assert engine.ensure(8) and not engine.failed   # its own lifeline is open: the engine lives
    assert daemon.allocator.engines["e"].mirror.key_of.get(block.block_id) == b"k" * 8
    daemon.check()
