"""The client's Connection: one way to send (``send``) and one to call
(``call``, or ``call_async`` with a callback), each safe from any thread, the
I/O thread that owns the socket included (its handshake, its periodic work)."""

from __future__ import annotations

import threading

from kvelastic import protocol as p
from kvelastic.client.connection import Connection
from tests.daemon.hostile import register_message
from tests.daemon_proc import wait_for


def test_send_and_call_work_from_any_thread(daemon):
    seen: dict[str, object] = {}
    answered = threading.Event()

    def handshake(conn: Connection) -> None:          # on the I/O thread, before it is connected
        seen["registered"] = conn.call(register_message("conn"), timeout=5.0)

    def on_tick(now: float) -> None:                   # on the I/O thread, once connected
        if "tick_status" not in seen:
            seen["tick_status"] = conn.call(p.Status(), timeout=5.0)
            conn.send(p.Grow(engine_id="ghost", slabs=1))   # rejected: counted in ``errors``

    def on_reply(reply: p.Msg) -> None:
        seen["async_thread"] = threading.current_thread().name
        seen["async_reply"] = reply
        answered.set()

    conn = Connection(daemon.socket, "conn", -1, handshake=handshake, on_command=lambda msg: None,
                      on_tick=on_tick, name="conn-io")
    conn.start()
    try:
        assert isinstance(seen["registered"], p.Registered)
        assert isinstance(conn.call(p.Status()), p.StatusReply)
        conn.call_async(p.Status(), on_reply)
        assert answered.wait(5.0)
        assert isinstance(seen["async_reply"], p.StatusReply) and seen["async_thread"] == "conn-io"
        conn.send(p.Grow(engine_id="ghost", slabs=1))
        wait_for(lambda: "tick_status" in seen and conn.errors == 2, timeout=5.0,
                 what="both rejected sends answered")
        assert isinstance(seen["tick_status"], p.StatusReply)
    finally:
        conn.close()


def test_a_lifeline_write_that_fits_goes_at_once_and_one_that_does_not_never_blocks():
    """``send_now`` (the lifeline's write on the scheduler's path, holding the
    GIL): all of a frame that fits, nothing (not a wait) where the socket's
    buffer is full, and a typed OSError once the daemon's end is gone."""
    import errno
    import socket

    from kvelastic.client.nowait import send_now

    ours, theirs = socket.socketpair()
    try:
        assert send_now(ours.fileno(), b"frame") == 5
        assert theirs.recv(16) == b"frame"
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        sent = [send_now(ours.fileno(), b"x" * 1024) for _ in range(1024)]   # nobody reads: it fills
        assert sent[0] == 1024 and sent[-1] == 0          # a full buffer: 0 at once, never a blocked thread
        theirs.close()
        try:
            send_now(ours.fileno(), b"frame")
        except OSError as exc:
            assert exc.errno in (errno.EPIPE, errno.ECONNRESET)
        else:
            raise AssertionError("a write to a closed peer must fail")
    finally:
        ours.close()
