"""``kvelastic keeper``: configuration, signals, loop (``server.py``)."""

from __future__ import annotations

import logging
import signal
import sys
import time

from kvelastic.errors import KvelasticError
from kvelastic.keeper.server import Keeper
from kvelastic.keeper.supervise import CONFIG_ERROR, DaemonChild
from kvelastic.protocol import keeper_socket_path
from kvelastic.startup import configured, sd_notify

log = logging.getLogger("kvelastic.keeper")


def main(linger: float | None = None, with_daemon: bool = False) -> int:
    """``linger``: exit this many seconds after the last daemon left (a keeper
    the daemon started); ``with_daemon``: run the daemon as a child, started
    again when it dies (``supervise.py``)."""
    config = configured("kvelastic keeper")
    if config is None:
        return 2
    path = keeper_socket_path(config.socket)
    try:
        keeper = Keeper(path, linger=linger)
    except (KvelasticError, OSError) as exc:
        print(f"kvelastic keeper: {exc}", file=sys.stderr)
        return 1
    stopping: list[bool] = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    signal.signal(signal.SIGINT, lambda *_: stopping.append(True))
    log.info("kvelastic keeper ready on %s: up to %d pages%s", path, keeper.holdings.max_pages,
             f", lingering {linger:g} s after the last daemon leaves" if linger is not None else "")
    sd_notify("READY=1")
    child = DaemonChild() if with_daemon else None
    why, status = "stopped", 0

    def stop() -> bool:
        nonlocal why, status
        if stopping:              # first: a Ctrl-C stops the daemon too, which must not be restarted
            return True
        if child is not None and child.tick(time.monotonic()):
            why, status = "the daemon cannot start", CONFIG_ERROR
            return True
        return False

    try:
        if keeper.serve(stop):
            why = f"no daemon for {linger:g} s"
    finally:
        if child is not None:
            child.stop()          # first: its graceful stop hands its pages back here
        log.info("kvelastic keeper stopping (%s): %d pages let go", why, len(keeper.holdings.fds))
        keeper.close()
    return status
