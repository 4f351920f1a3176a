"""A journal reaches the daemon ahead of any message that hands slabs back.

The daemon takes a journal only while every slab it names is the engine's
(``journal_intake.check_blocks``), and drops a journal it refuses whole: its
keys with it. ``kvelastic bench elastic``'s hand-off part took an engine's
slabs back from its pool and sent the ``Return`` itself (``conn.call``),
while the last grant's ``AddSlab`` still waited in the journal: the daemon
unmapped the slabs, then refused the journal (``AddSlab names slab 14,
which engine handoff-b does not hold``). Had that journal carried the drop
of a key in a slab the engine kept, the daemon's mirror would have gone on
naming a block the engine may rewrite, and the cache kept after the engine
left would have served it. The client now ships the journal before any
``Return`` or ``ReclaimDone``, whoever sends it.

A real daemon (its loop on a thread) and a real engine client and worker
(host pages, mapped and unmapped) over the real sockets; the journal goes
out only when the test says (an interval of an hour), so the order is the
test's, not the clock's."""

from __future__ import annotations

import threading

import pytest

from kvelastic import protocol as p
from kvelastic.client.engine import EngineClient
from kvelastic.client.worker import WorkerClient
from kvelastic.core.pool import SlabPool
from kvelastic.daemon.devices import Device
from kvelastic.daemon.server import Daemon
from kvelastic.vmm import get_backend
from tests.daemon import threaded
from tests.daemon_proc import wait_for

MiB = 1 << 20


@pytest.fixture
def served(tmp_path):
    with threaded.served(tmp_path, keep_idle_slabs=0, shrink_grace=3600) as (daemon, engine, worker):
        engine.journal_interval = 3600.0      # shipped only when the test (or the client's own order) says
        yield daemon, engine, worker


def refused_journals(daemon: Daemon) -> float:
    return daemon.metrics.registry.get_sample_value("kvelastic_rejected_messages_total",
                                                    {"reason": "bad_journal"}) or 0.0


def sync(engine: EngineClient) -> None:
    """Ship what is left of the journal and wait until the daemon applied it."""
    with engine.lock:
        engine.flush_journal(sync=True)


def mirrored_keys(daemon: Daemon) -> dict[int, bytes]:
    return dict(daemon.allocator.engines["e"].mirror.key_of)


def test_a_return_sent_right_after_a_grant_follows_its_journal(served):
    """The bench's sequence: a demand grant (its ``AddSlab`` not shipped yet),
    every slab taken back from the pool, and the ``Return`` sent at once."""
    daemon, engine, worker = served
    errors = engine.conn.errors
    assert engine.ensure(4)
    assert engine.ensure(8)                    # the second grant's AddSlab waits in the journal
    slabs = engine.pool.slab_ids()
    assert len(slabs) == 2
    with engine.lock:
        for slab_id in slabs:
            engine.pool.take_slab_back(slab_id, reason="return")
    assert isinstance(engine.conn.call(p.Return(engine_id="e", slabs=slabs), 5.0), p.Ok)   # once unmapped
    sync(engine)
    assert refused_journals(daemon) == 0 and engine.conn.errors == errors
    assert not daemon.allocator.engines["e"].slabs and not worker.slabs
    daemon.check()


def test_a_dropped_key_reaches_the_mirror_before_another_slab_goes_back(served):
    """A key dropped in a slab the engine keeps, then another slab returned
    by hand: the drop must reach the daemon's mirror (a refused journal
    would leave the key there, naming a block the engine may rewrite, in
    the cache kept after it leaves)."""
    daemon, engine, _worker = served
    assert engine.ensure(8)
    with engine.lock:
        blocks = engine.pool.allocate(4)
        engine.pool.cache(blocks, [b"k0", b"k1", b"k2", b"k3"])
        engine.pool.free(blocks)
    sync(engine)
    assert sorted(mirrored_keys(daemon).values()) == [b"k0", b"k1", b"k2", b"k3"]
    keep = blocks[0].block_id // engine.pool.blocks_per_slab
    (other,) = [s for s in engine.pool.slab_ids() if s != keep]
    with engine.lock:
        assert engine.pool.uncache(blocks[:1]) == 1            # k0 dropped: its block may be written again
        engine.pool.take_slab_back(other, reason="return")
    assert isinstance(engine.conn.call(p.Return(engine_id="e", slabs=[other]), 5.0), p.Ok)
    sync(engine)
    assert refused_journals(daemon) == 0
    assert mirrored_keys(daemon) == {b: k for k, b in engine.pool.cached_keys()}
    assert b"k0" not in mirrored_keys(daemon).values()
    daemon.check()


def test_a_refused_journal_is_followed_by_the_whole_index(served):
    """Should a journal be refused all the same (here: a client that sends
    its ``Return`` with no regard for the journal), the daemon's mirror is
    repaired: the engine sends its whole index again, as after a reconnect."""
    daemon, engine, _worker = served
    engine.conn.before_send = None            # the order the bench had
    assert engine.ensure(8)
    with engine.lock:
        blocks = engine.pool.allocate(4)
        engine.pool.cache(blocks, [b"k0", b"k1", b"k2", b"k3"])
        engine.pool.free(blocks)
    sync(engine)
    keep = blocks[0].block_id // engine.pool.blocks_per_slab
    (other,) = [s for s in engine.pool.slab_ids() if s != keep]
    with engine.lock:
        engine.pool.uncache(blocks[:1])
        engine.pool.take_slab_back(other, reason="return")
    assert isinstance(engine.conn.call(p.Return(engine_id="e", slabs=[other]), 5.0), p.Ok)
    sync(engine)
    assert refused_journals(daemon) == 1                 # dropped whole: k0 still in the mirror, for now
    wait_for(lambda: b"k0" not in mirrored_keys(daemon).values(), 5.0, what="the index sent again")
    sync(engine)
    assert mirrored_keys(daemon) == {b: k for k, b in engine.pool.cached_keys()}
    assert refused_journals(daemon) == 1
    daemon.check()


def test_a_grant_waiting_for_the_pool_when_the_daemon_restarts_is_in_the_registration(tmp_path):
    """A grant the I/O thread queued while the scheduler held the pool, then
    the daemon restarts: the engine's registration with the new daemon
    lists that slab too (its worker mapped it), so the journal that adds it
    is taken, not refused."""
    def serve() -> tuple[Daemon, threading.Event, threading.Thread]:
        daemon = Daemon([Device("0", get_backend("host"), 16 * MiB)], str(tmp_path / "k.sock"))
        stop = threading.Event()
        thread = threading.Thread(target=daemon.serve, args=(stop.is_set,), daemon=True)
        thread.start()
        return daemon, stop, thread

    def halt(daemon: Daemon, stop: threading.Event, thread: threading.Thread) -> None:
        stop.set()
        thread.join(5)
        daemon.close()

    first = serve()
    engine = EngineClient(SlabPool(4), socket_path=first[0].socket_path, engine_id="e", namespace="n",
                          page_size=2 * MiB, pages_per_worker=1, num_workers=1, block_bytes=MiB // 2,
                          low_watermark=0, keep_idle_slabs=0, shrink_grace=3600).start()
    engine.journal_interval = 3600.0
    worker = WorkerClient(get_backend("host"), socket_path=first[0].socket_path, engine_id="e", rank=0,
                          token=engine.token).start()
    second = None
    try:
        assert engine.ensure(4)
        with engine.lock:       # the scheduler is busy: a grant that comes now waits in the queue
            grant = engine.conn.call(p.Grow(engine_id="e", slabs=1, demand=True), 5.0)
            assert isinstance(grant, p.Granted) and len(grant.slabs) == 1
            engine._grants.append(grant)
            halt(*first)
            second = serve()
        daemon = second[0]
        wait_for(lambda: "e" in daemon.allocator.engines and len(daemon.allocator.engines["e"].slabs) == 2,
                 10.0, what="the engine re-registered with both slabs")
        sync(engine)
        assert engine.pool.slab_ids() == sorted(daemon.allocator.engines["e"].slabs)
        assert refused_journals(daemon) == 0
    finally:
        engine.close()
        worker.close()
        if second is not None:
            halt(*second)
