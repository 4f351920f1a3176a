"""Engine death, daemon death and bad input, with real processes."""

import time

import msgspec
import pytest

from kvelastic import protocol as p
from tests.daemon.books import SLAB, held, quiet_status, rejected
from tests.daemon_proc import DaemonProcess, wait_for


def test_kill_9_of_an_engine_returns_its_memory_within_2_s(daemon, engines):
    a = engines(daemon, "a", grace=60)
    b = engines(daemon, "b", grace=60)
    assert a.do("ensure", n=12)["ok"] and b.do("ensure", n=8)["ok"]
    assert b.do("write", value=9)["values"] == [9, 9]
    a.kill()
    start = time.monotonic()
    wait_for(lambda: held(daemon, "a") is None and daemon.status()["memory"]["held"] == 2 * SLAB,
             timeout=2.0, what="engine a's slabs back")
    assert time.monotonic() - start < 2.0
    memory = daemon.status()["memory"]      # a's pages are free, or already released to the kernel
    assert memory["free"] + memory["unallocated"] == daemon.status()["budget_bytes"] - 2 * SLAB
    # the other engine is unaffected and can grow into the freed memory
    assert b.do("read")["values"] == [9, 9]
    assert b.do("ensure", n=20)["ok"] and held(daemon, "b") == 5 * SLAB


def test_daemon_kill_9_and_restart(tmp_path, engines):
    daemon = DaemonProcess(tmp_path).start()
    try:
        a = engines(daemon, "a", grace=60)
        assert a.do("ensure", n=12)["ok"]
        a.do("alloc", n=6)
        a.do("cache", prefix="r")
        assert a.do("write", value=5)["values"] == [5, 5, 5]
        daemon.kill()
        # the engine keeps serving from what it holds
        assert a.do("read")["values"] == [5, 5, 5]
        a.do("free")
        assert a.do("lookup", prefix="r", n=6)["hits"] == 6
        assert not a.do("ensure", n=40, timeout=1)["ok"]          # no daemon: no growth, no crash
        daemon.stop()
        daemon = DaemonProcess(tmp_path).start()
        # Registered, then its index re-sent on the lifeline (a journal after the handshake).
        wait_for(lambda: held(daemon, "a") == 3 * SLAB and daemon.status()["engines"][0]["cached_blocks"] == 6,
                 timeout=10, what="re-registration and the index re-sent")
        s = daemon.status()
        assert s["pages"]["adopted"] == 3 and s["engines"][0]["cached_blocks"] == 6
        assert a.state()["reconnects"] >= 1
        assert a.do("read")["values"] == [5, 5, 5]
        assert a.do("ensure", n=16)["ok"]                           # grows again on the new daemon
        a.close()
        wait_for(lambda: daemon.status()["memory"]["held"] == 0, what="everything back")
        s = daemon.status()
        assert s["pages"]["adopted"] == 0 and s["pages"]["created"] == s["pages"]["free"]
    finally:
        daemon.stop()


def good_engine(**kw):
    fields = dict(version=p.PROTOCOL_VERSION, engine_id="x", pid=1, namespace="n", page_size=SLAB,
                  pages_per_worker=1, num_workers=0, blocks_per_slab=4, block_bytes=SLAB // 4)
    fields.update(kw)
    return p.RegisterEngine(**fields)


# (reason, send): ``send(daemon, e)`` sends one bad input, from a connection of
# its own (``daemon.request``) or on engine e1's own connection (``e.send``).
BAD_INPUTS = [
    ("malformed", lambda d, e: d.send_raw([b"\x93garbage"])),
    ("malformed", lambda d, e: d.send_raw([p.encode(p.Status()), b"extra"])),
    ("oversize", lambda d, e: d.send_raw([b"\x00" * (p.MAX_MESSAGE_BYTES + 1)])),
    ("version", lambda d, e: d.request(good_engine(version=99))),
    ("geometry", lambda d, e: d.request(good_engine(page_size=4096))),
    ("geometry", lambda d, e: d.request(good_engine(blocks_per_slab=0))),
    ("unknown_engine", lambda d, e: d.request(p.Grow(engine_id="ghost", slabs=1))),
    ("unknown_engine", lambda d, e: d.request(p.Journal(engine_id="ghost", ops=[], occupancy={}))),
    ("bad_request", lambda d, e: e.send(p.Grow(engine_id="e1", slabs=0))),
    ("not_held", lambda d, e: e.send(p.Return(engine_id="e1", slabs=[999]))),
    ("not_held", lambda d, e: e.send(p.Return(engine_id="e1", slabs=[0, 0]))),
    ("bad_request", lambda d, e: e.send(p.Return(engine_id="e1", slabs=[0], settled=[1]))),   # settled, not returned
    ("malformed", lambda d, e: d.send_raw([msgspec.msgpack.encode(   # an op that is not one: refused at decoding
        {"type": "Journal", "req_id": 1, "engine_id": "e1", "ops": [[7, 1]], "occupancy": {}})])),
    ("bad_journal", lambda d, e: e.send(p.Journal(engine_id="e1", ops=[p.StoreKey(key=b"k", block=4000)],
                                                  occupancy={}))),
    ("bad_journal", lambda d, e: e.send(p.Journal(engine_id="e1", ops=[], occupancy={0: (9, 9, 9)}))),
    ("unexpected", lambda d, e: d.request(p.Granted(slabs=[1]))),
    ("unexpected_ack", lambda d, e: e.send(p.ReclaimDone(engine_id="e1", given=[], refused=[]))),
    ("unknown_target", lambda d, e: d.request(p.Invalidate(target="nothing"))),
    ("limit", lambda d, e: d.request(p.SetLimit(engine_id="e1", min_bytes=8, max_bytes=4))),
    # Another connection acting for e1: refused, whatever it asks (identity).
    ("not_owner", lambda d, e: d.request(p.Return(engine_id="e1", slabs=[0]))),
    ("not_owner", lambda d, e: d.request(p.Grow(engine_id="e1", slabs=1))),
    ("not_owner", lambda d, e: d.request(p.Unregister(engine_id="e1"))),
    ("not_owner", lambda d, e: d.request(p.Journal(engine_id="e1", ops=[p.ClearKeys()], occupancy={}))),
    ("not_owner", lambda d, e: d.request(p.Heartbeat(engine_id="e1"))),
    ("not_owner", lambda d, e: d.request(p.Mapped(engine_id="e1", rank=0, slab=0))),
    ("engine_exists", lambda d, e: d.request(good_engine(engine_id="e1"))),        # no secret: no takeover
    ("engine_exists", lambda d, e: d.request(good_engine(engine_id="e1", token=b"guess" * 3))),
    ("bad_token", lambda d, e: d.request(p.RegisterWorker(version=p.PROTOCOL_VERSION, engine_id="e1", rank=0,
                                                          pid=1, token=b"guess"))),
]


@pytest.mark.parametrize("reason,send", BAD_INPUTS, ids=[f"{r}-{i}" for i, (r, _) in enumerate(BAD_INPUTS)])
def test_bad_input_gets_a_typed_error_is_counted_and_changes_nothing(daemon, engines, reason, send):
    e = engines(daemon, "e1", workers=0, grace=60)
    assert e.do("ensure", n=4)["ok"]
    before = wait_for(lambda: quiet_status(daemon), what="a quiet daemon")
    counted = rejected(daemon).get(reason, 0)
    reply = send(daemon, e)
    assert isinstance(reply, p.Error) and reply.reason == reason, reply
    assert daemon.status() == before
    assert rejected(daemon)[reason] == counted + 1
    assert "rejected" in daemon.log() and reason in daemon.log()
    assert e.do("ensure", n=8)["ok"]                               # the daemon is still serving


def test_slab_returned_twice_is_rejected(daemon, engines):
    e = engines(daemon, "e1", workers=0, grace=60)
    assert e.do("ensure", n=4)["ok"]
    slab = e.state()["slabs"][0]
    forged = daemon.request(p.Return(engine_id="e1", slabs=[slab]))   # another client: not e1's to return
    assert isinstance(forged, p.Error) and forged.reason == "not_owner"
    assert isinstance(e.send(p.Return(engine_id="e1", slabs=[slab])), p.Ok)
    again = e.send(p.Return(engine_id="e1", slabs=[slab]))
    assert isinstance(again, p.Error) and again.reason == "not_held"


def test_garbage_on_the_page_channel_is_refused(daemon):
    import socket

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(p.fd_socket_path(daemon.socket))
    sock.sendall((10).to_bytes(4, "little") + b"not-msgpak")
    wait_for(lambda: rejected(daemon).get("bad_hello") == 1, what="bad hello counted")
    sock.close()
    assert isinstance(daemon.request(p.Status()), p.StatusReply)


def test_decode_rejects_unknown_tags():
    with pytest.raises(msgspec.ValidationError):
        p.decode(msgspec.msgpack.encode({"type": "Nope", "req_id": 1}))
