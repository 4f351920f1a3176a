"""A client's link to the daemon: one background I/O thread per connection.

The thread owns the ZMQ DEALER (ZMQ sockets are not thread-safe) and the
AF_UNIX *lifeline*: the page channel for a worker, a bare liveness link for
an engine. Other threads hand it messages through a queue and an eventfd;
``send`` and ``call`` hide which thread the caller is on.
When the lifeline reports the daemon gone, the thread reconnects with
exponential backoff and calls ``handshake`` again (re-registration), so a
daemon restart is invisible to the caller apart from failed requests while
it is down.

Before it says anything, the thread checks who listens on the lifeline
(``trust.check_daemon``): a process that is not the daemon this client may
trust never hears the hello, the registration or the engine's secret.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import msgspec
import zmq

from kvelastic import protocol as p
from kvelastic.client.nowait import send_now
from kvelastic.client.trust import UntrustedDaemon, check_daemon
from kvelastic.errors import KvelasticError
from kvelastic.threadname import name_this_thread
from kvelastic.vmm import fdchannel

log = logging.getLogger("kvelastic.client")

BACKOFF_MIN, BACKOFF_MAX = 0.05, 2.0
ACK_SEND_TIMEOUT = 2   # seconds
NO_SOCKET_GRACE = 3.0
# A call on the I/O thread (a handshake) looks at ``close`` this often.
CALL_POLL_MS = 100
# A registration refused for one of these will be refused again: fail at start.
FATAL_REASONS = ("version", "geometry", "engine_exists", "limit", "unknown_device", "bad_rank", "bad_token",
                 "not_operator")


class DaemonUnavailable(KvelasticError):
    reason = "daemon_unavailable"


class DaemonError(KvelasticError):
    """The daemon answered a request with an ``Error``."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{message} ({reason})")
        self.reason = reason
        self.message = message        # the operator's text, without the reason tag


M = TypeVar("M", bound=p.Msg)


def expect(reply: p.Msg, kind: type[M]) -> M:
    """``reply`` as the type that answers the request; ``DaemonError``
    (reason ``unexpected``) for any other."""
    if not isinstance(reply, kind):
        raise DaemonError("unexpected", f"expected {kind.__name__} from the daemon, got {type(reply).__name__}")
    return reply


class _Pending:
    __slots__ = ("event", "reply", "callback")

    def __init__(self, callback: Callable[[p.Msg], None] | None) -> None:
        self.event = threading.Event()
        self.reply: p.Msg | None = None
        self.callback = callback


class Connection:
    def __init__(self, socket_path: str, engine_id: str, rank: int, *,
                 handshake: Callable[[Connection], None],
                 on_command: Callable[[p.Msg], None],
                 on_tick: Callable[[float], None] | None = None,
                 on_pages: Callable[[fdchannel.FdChannel], None] | None = None,
                 tick_interval: float = 0.01, name: str = "kvelastic-io") -> None:
        self.socket_path = socket_path
        self.engine_id = engine_id
        self.rank = rank
        self.token = b""           # a worker's: its engine's secret, shown in the page channel's hello
        self._handshake = handshake
        self._on_command = on_command
        self._on_tick = on_tick
        # A worker's: reads a batch of page descriptors, with the MapSlab that
        # names them, off the lifeline as soon as it is readable.
        self._on_pages = on_pages
        self._tick_interval = tick_interval
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._dealer: zmq.Socket[bytes] | None = None
        self.lifeline: fdchannel.FdChannel | None = None
        # Messages ``call`` on the I/O thread read while waiting for its reply:
        # delivered before anything newer, so the daemon's order holds.
        self._read_ahead: collections.deque[p.Msg] = collections.deque()
        self._fatal: Exception | None = None
        self._outbox: collections.deque[tuple[p.Msg, _Pending | None]] = collections.deque()
        self._pending: dict[int, _Pending] = {}
        # Wakes the I/O thread. Closed only by close(), once that thread is
        # gone, under _wake_lock: a wake racing a close never writes to a
        # closed (or reused) descriptor.
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._wake_lock = threading.Lock()
        self._tell_lock = threading.Lock()   # acks on the lifeline come from the I/O thread and a step's end
        # True from a wake until the I/O thread next runs its loop: further
        # wakes meanwhile are free (a scheduler may ask hundreds of times a
        # step). Cleared by the I/O thread before it looks at the outbox, and
        # set by a waker after it queued its work: nothing queued is missed.
        self._wake_pending = False
        self._next_req = 0
        self._req_lock = threading.Lock()
        self._stop = threading.Event()
        self.connected = threading.Event()
        self.errors = 0                      # error replies to notifications
        # Called with every message ``send``, ``call`` and ``call_async`` are
        # given, on the sender's thread, before it is queued (an engine ships
        # its journal ahead of a message that hands slabs back: ``EngineClient``).
        self.before_send: Callable[[p.Msg], None] | None = None
        # Called on the I/O thread with an ``Error`` that answers no request
        # (a notification refused: counted in ``errors``).
        self.on_error: Callable[[p.Error], None] | None = None
        self.reconnects = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    # --------------------------------------------------------- caller API
    # Two ways to talk to the daemon, both safe from any thread: ``send`` (fire
    # and forget) and ``call`` (wait for the reply; ``call_async`` hands it to
    # a callback instead). Only the I/O thread touches the socket: another
    # thread's message is queued and the I/O thread woken; the I/O thread's own
    # goes straight out, after whatever is queued, so the daemon sees each
    # thread's messages in the order they were sent.
    def start(self, timeout: float = 10.0) -> None:
        self._thread.start()
        start = time.monotonic()
        while not self.connected.wait(0.05):
            if self._fatal is not None:
                self.close()
                raise self._fatal
            waited = time.monotonic() - start
            # A daemon that is starting shows its socket within seconds; without
            # one there is nothing to wait for.
            if waited > timeout or (waited > NO_SOCKET_GRACE and not os.path.exists(
                    p.fd_socket_path(self.socket_path))):
                break
        if not self.connected.is_set():
            self.close()
            raise DaemonUnavailable(f"no kvelastic daemon answered on {self.socket_path} (is it running? start it "
                                    "with 'make run' or 'kvelastic daemon'; KVELASTIC_SOCKET selects the socket)")

    def send(self, msg: p.Msg) -> None:
        """Fire and forget: the daemon answers only if it rejects the message
        (counted in ``errors``). An answer to a daemon command keeps the
        command's ``req_id``."""
        if msg.req_id == 0:
            msg.req_id = self._new_req_id()
        self._before(msg)
        self._post(msg, None)

    def call(self, msg: p.Msg, timeout: float = 10.0) -> p.Msg:
        """Send a request and wait at most ``timeout`` for its reply. Raises
        ``DaemonError`` for an ``Error`` reply, ``DaemonUnavailable`` for none.
        On the I/O thread (a handshake), which would otherwise wait for itself,
        it reads the socket for the reply; whatever else arrives meanwhile is
        delivered afterwards, in order."""
        msg.req_id = self._new_req_id()
        self._before(msg)
        if self._on_io_thread():
            return self._result(self._call_here(msg, timeout))
        pending = _Pending(None)
        self._post(msg, pending)
        if not pending.event.wait(timeout):
            self._pending.pop(msg.req_id, None)
            # Not sent yet (no daemon, the I/O thread between two attempts): it never will be. A
            # request its caller gave up on must not reach the next daemon (a stale Grow would be
            # granted memory nobody waits for).
            try:
                self._outbox.remove((msg, pending))
            except ValueError:
                pass
            raise DaemonUnavailable(f"no answer to {type(msg).__name__} within {timeout:.1f} s")
        return self._result(pending.reply)

    def call_async(self, msg: p.Msg, on_reply: Callable[[p.Msg], None]) -> None:
        """Send a request without waiting: ``on_reply(reply)`` runs on the I/O
        thread; an ``Error`` reply or a lost connection arrives as an ``Error``."""
        msg.req_id = self._new_req_id()
        self._before(msg)
        self._post(msg, _Pending(on_reply))

    def _before(self, msg: p.Msg) -> None:
        if self.before_send is not None:
            self.before_send(msg)

    def tell(self, msg: p.Msg) -> None:
        """A worker's ack (``Mapped``, ``Unmapped``), on its page channel: read
        by the daemon's loop itself, with no ZMQ I/O thread on either side to
        wake. Otherwise (not registered, or the channel broke) it goes by
        ``send`` (and fails like it)."""
        if not self.write_lifeline(p.encode(msg)):
            self.send(msg)

    def write_lifeline(self, data: bytes, handshake: bool = False) -> bool:
        """One frame (``<u32 size>`` + ``data``) on the lifeline, in the
        daemon's socket when this returns True. Only once registered
        (``handshake``: the I/O thread, once the daemon answered the
        registration): a frame the daemon cannot attribute to a registration
        is refused. A write that fails (the daemon gone, or not reading for
        ``ACK_SEND_TIMEOUT``) may have left half a frame: the lifeline is shut
        so the daemon drops what it read of it, and this side reconnects."""
        lifeline = self.lifeline
        if lifeline is None or not (handshake or self.connected.is_set()):
            return False
        try:
            frame = len(data).to_bytes(4, "little") + data
            with self._tell_lock:
                # Holding the GIL while the socket has room (``nowait``): a
                # seal on the scheduler's thread must not hand it to the I/O thread.
                sent = send_now(lifeline.fileno(), frame)
                if sent < len(frame):
                    lifeline.sock.sendall(memoryview(frame)[sent:])
            return True
        except OSError as exc:
            log.warning("engine %s rank %d: writing to the daemon on the lifeline failed (%s); reconnecting",
                        self.engine_id, self.rank, exc)
            try:
                lifeline.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            return False

    def wake(self) -> None:
        """Run the I/O thread's loop (and its periodic work) now."""
        if self._wake_pending:
            return
        with self._wake_lock:
            if self._wake >= 0:
                self._wake_pending = True
                os.eventfd_write(self._wake, 1)

    def close(self) -> None:
        self._stop.set()
        self.wake()
        if self._thread.is_alive() and not self._on_io_thread():
            self._thread.join(5)
        if not self._thread.is_alive():
            with self._wake_lock:     # nobody polls it any more
                if self._wake >= 0:
                    os.close(self._wake)
                    self._wake = -1

    # ------------------------------------------------------------ internals
    def _on_io_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def _new_req_id(self) -> int:
        with self._req_lock:
            self._next_req += 1
            return self._next_req

    def _post(self, msg: p.Msg, pending: _Pending | None) -> None:
        """Hand ``msg`` to the socket's owner: written now on the I/O thread
        once registered, else queued (during the handshake too: registration
        is the first thing a daemon must hear) and the I/O thread woken."""
        if pending is not None:
            self._pending[msg.req_id] = pending
        if self._on_io_thread() and self.connected.is_set():
            self._write(msg)
        else:
            self._outbox.append((msg, pending))
            self.wake()

    def _write(self, msg: p.Msg) -> None:
        """I/O thread only. Once registered, what other threads queued goes first."""
        dealer = self._socket()
        if self.connected.is_set():
            self._flush_outbox()
        dealer.send(p.encode(msg))

    def _socket(self) -> zmq.Socket[bytes]:
        """The DEALER, on the I/O thread while connected."""
        if self._dealer is None:
            raise DaemonUnavailable("not connected to the daemon")
        return self._dealer

    def _flush_outbox(self) -> None:
        dealer = self._socket()
        while self._outbox:
            msg, _pending = self._outbox.popleft()
            dealer.send(p.encode(msg))

    def _call_here(self, msg: p.Msg, timeout: float) -> p.Msg:
        """``call`` on the I/O thread: poll the socket for the reply, keeping
        any other message in ``_read_ahead`` for the loop. It gives up at
        ``close`` too: a listener that accepts but never answers (a keeper
        holding a dead daemon's sockets) must not hold a closing engine for
        the whole timeout."""
        if self._dealer is None:
            raise DaemonUnavailable("not connected to the daemon")
        self._write(msg)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or self._stop.is_set():
                raise DaemonUnavailable(f"no answer to {type(msg).__name__} within {timeout:.1f} s")
            if not self._dealer.poll(max(1, min(CALL_POLL_MS, math.ceil(left * 1000)))):
                continue
            reply = p.decode(self._dealer.recv())
            if reply.req_id == msg.req_id:
                return reply
            self._read_ahead.append(reply)

    @staticmethod
    def _result(reply: p.Msg | None) -> p.Msg:
        if isinstance(reply, p.Error):
            raise DaemonError(reply.reason, reply.message)
        if reply is None:
            raise DaemonUnavailable("the daemon went away before answering")
        return reply

    def _connect(self) -> fdchannel.FdChannel | None:
        """Open the lifeline, check who listens on it, open the control
        socket and register: the lifeline once registered, None when that
        failed (``_fatal`` set when the listener is not a daemon to trust)."""
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        except OSError:
            return None
        try:
            sock.settimeout(2.0)
            sock.connect(p.fd_socket_path(self.socket_path))
            check_daemon(sock, self.socket_path)     # before the hello: it names us and shows our secret
            p.write_hello(sock, self.engine_id, self.rank, self.token)
            sock.settimeout(None)
            # An ack (``tell``) never blocks for long on a daemon that stopped reading.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", ACK_SEND_TIMEOUT, 0))
        except UntrustedDaemon as exc:
            sock.close()
            self._fatal = exc
            return None
        except OSError:
            sock.close()
            return None
        lifeline = self.lifeline = fdchannel.FdChannel(sock)
        self._dealer = self._ctx.socket(zmq.DEALER)
        self._dealer.setsockopt(zmq.LINGER, 0)
        self._dealer.connect(f"ipc://{self.socket_path}")
        try:
            self._handshake(self)
        except (KvelasticError, zmq.ZMQError) as exc:
            log.warning("engine %s: handshake with the daemon failed: %s", self.engine_id, exc)
            if isinstance(exc, DaemonError) and exc.reason in FATAL_REASONS:
                self._fatal = exc
            self._disconnect()
            return None
        return lifeline

    def _disconnect(self) -> None:
        self.connected.clear()
        self._read_ahead.clear()        # read off a socket that is gone: from a session that is over
        if self._dealer is not None:
            self._dealer.close(0)
            self._dealer = None
        if self.lifeline is not None:
            with self._tell_lock:       # never under a frame being written (its descriptor reused)
                self.lifeline.close()
                self.lifeline = None
        for req_id, pending in list(self._pending.items()):
            self._pending.pop(req_id, None)
            self._complete(pending, p.Error(req_id=req_id, reason="daemon_unavailable",
                                            message="connection to the daemon lost"))

    def _complete(self, pending: _Pending, reply: p.Msg) -> None:
        pending.reply = reply
        pending.event.set()
        if pending.callback is not None:
            try:
                pending.callback(reply)
            except Exception:
                log.exception("engine %s: reply handler failed", self.engine_id)

    def _deliver(self, msg: p.Msg) -> None:
        pending = self._pending.pop(msg.req_id, None)
        if pending is not None:
            self._complete(pending, msg)
        elif isinstance(msg, p.Error):
            self.errors += 1
            log.warning("engine %s: daemon rejected a message: %s (%s)", self.engine_id, msg.message, msg.reason)
            if self.on_error is not None:
                try:
                    self.on_error(msg)
                except Exception:
                    log.exception("engine %s: error handler failed", self.engine_id)
        else:
            try:
                self._on_command(msg)
            except Exception:
                log.exception("engine %s: handling %s failed", self.engine_id, type(msg).__name__)

    def _run(self) -> None:
        name_this_thread("kv-engine-io" if self.rank < 0 else "kv-worker-io")
        backoff = BACKOFF_MIN
        next_tick = 0.0
        while not self._stop.is_set():
            lifeline = self.lifeline
            if self._dealer is None or lifeline is None:   # set and cleared together
                lifeline = self._connect()
                if lifeline is not None:
                    backoff = BACKOFF_MIN
                    self._fatal = None       # a refusal of an earlier attempt is over
                    if self.reconnects or self.connected.is_set():
                        log.info("engine %s: reconnected to the daemon", self.engine_id)
                    self.connected.set()     # what the handshake read ahead: delivered on the first pass
                else:
                    if self._fatal is not None:
                        log.error("engine %s: %s: %s", self.engine_id, "refused to talk to the process on the "
                                  "daemon's socket" if isinstance(self._fatal, UntrustedDaemon) else
                                  "daemon refused us", self._fatal)
                        if not self.reconnects:
                            break  # never connected: start() reports it
                    self._drain_outbox_offline()
                    self._stop.wait(backoff)
                    backoff = min(backoff * 2, BACKOFF_MAX)
                    continue
            poller = zmq.Poller()
            poller.register(self._dealer, zmq.POLLIN)
            poller.register(self._wake, zmq.POLLIN)
            poller.register(lifeline.fileno(), zmq.POLLIN)
            while not self._stop.is_set():
                now = time.monotonic()
                # Rounded up: a wait rounded down to 0 ms would spin through the tick's last millisecond.
                wait = 0 if self._read_ahead else \
                    (max(0, math.ceil((next_tick - now) * 1000)) if self._on_tick else 100)
                events = dict(poller.poll(wait))
                if self._wake in events:
                    self._wake_pending = False
                    try:
                        os.eventfd_read(self._wake)
                    except BlockingIOError:
                        pass
                self._flush_outbox()
                if self._dealer in events or self._read_ahead:
                    self._receive()
                if lifeline.fileno() in events and not self._read_pages(lifeline):
                    log.warning("engine %s: lost the daemon; serving from held memory, reconnecting",
                                self.engine_id)
                    self.reconnects += 1
                    self._disconnect()
                    break
                now = time.monotonic()
                if self._on_tick is not None and now >= next_tick:
                    next_tick = now + self._tick_interval
                    try:
                        self._on_tick(now)
                    except Exception:
                        log.exception("engine %s: periodic work failed", self.engine_id)
        self._disconnect()

    def _receive(self) -> None:
        """Deliver what the daemon sent, in its order: what a ``call`` on this
        thread read ahead first, then the socket until it is empty."""
        dealer = self._socket()
        while True:
            if self._read_ahead:
                self._deliver(self._read_ahead.popleft())
                continue
            # Asked, not tried: a recv on an empty socket raises, and building
            # that exception costs more than the message (twice per grant).
            if not int(dealer.get(zmq.EVENTS)) & zmq.POLLIN:
                return
            try:
                data = dealer.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = p.decode(data)
            except msgspec.DecodeError as exc:   # ValidationError too (a subclass)
                log.warning("engine %s: undecodable message from the daemon: %s", self.engine_id, exc)
                continue
            self._deliver(msg)

    def _read_pages(self, lifeline: fdchannel.FdChannel) -> bool:
        """The lifeline was readable: page descriptors (read now, if a worker's)
        or EOF. False when the daemon is gone."""
        try:
            waiting = lifeline.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return True     # already read (a MapSlab delivered in this pass took its batch)
        except OSError:
            return False
        if not waiting:
            return False
        if self._on_pages is not None:
            try:
                self._on_pages(lifeline)
            except (OSError, fdchannel.FdChannelError) as exc:
                log.warning("engine %s rank %d: unreadable page descriptors: %s", self.engine_id, self.rank, exc)
                return False
        return True

    def _lifeline_closed(self) -> bool:
        """Readable may mean page descriptors waiting (a worker's channel) or EOF."""
        lifeline = self.lifeline
        if lifeline is None:
            return True
        try:
            return lifeline.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True

    def _drain_outbox_offline(self) -> None:
        """While disconnected, requests fail at once instead of queueing forever."""
        while self._outbox:
            msg, pending = self._outbox.popleft()
            if pending is not None:
                self._pending.pop(msg.req_id, None)
                self._complete(pending, p.Error(req_id=msg.req_id, reason="daemon_unavailable",
                                                message="no kvelastic daemon is running"))
