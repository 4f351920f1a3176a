"""A demand grow's answer, between the thread that asked and the I/O thread.

The scheduler asks for memory and waits at most a short ``wait`` for the
answer. A daemon that must first reclaim from another engine takes longer:
unless the slabs it gives are settled (no step can still write them), that
engine's step must end before their pages are unmapped (invariant 5),
hundreds of milliseconds on a loaded CPU. Past the wait the scheduler goes
on, and its running requests with it; the answer, when it comes, joins the
engine's grants like any late grant, and the request that asked is admitted
at a later step. Exactly one side takes the answer: the caller if it comes
in time, else ``late``. No I/O here: the client posts the request."""

from __future__ import annotations

import threading
from collections.abc import Callable

from kvelastic import protocol as p


class DemandAnswer:
    def __init__(self, late: Callable[[p.Msg], None]) -> None:
        self._late = late
        self._lock = threading.Lock()
        self._reply: p.Msg | None = None
        self._abandoned = False
        self.settled = threading.Event()      # answered, whoever took it

    def on_reply(self, reply: p.Msg) -> None:
        """The I/O thread: the daemon answered (or the connection was lost: an ``Error``)."""
        with self._lock:
            late = self._abandoned
            if not late:
                self._reply = reply
        self.settled.set()
        if late:
            self._late(reply)

    def take(self, wait: float) -> p.Msg | None:
        """The answer if it comes within ``wait``; None: it goes to ``late``."""
        self.settled.wait(wait)
        with self._lock:
            if self._reply is None:
                self._abandoned = True
            return self._reply
