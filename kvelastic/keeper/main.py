"""``kvelastic keeper``: configuration, signals, loop (``server.py``)."""

from __future__ import annotations

import logging
import signal
import sys

from kvelastic.errors import KvelasticError
from kvelastic.keeper.server import Keeper
from kvelastic.protocol import keeper_socket_path
from kvelastic.startup import configured, sd_notify

log = logging.getLogger("kvelastic.keeper")


def main() -> int:
    config = configured("kvelastic keeper")
    if config is None:
        return 2
    path = keeper_socket_path(config.socket)
    try:
        keeper = Keeper(path)
    except (KvelasticError, OSError) as exc:
        print(f"kvelastic keeper: {exc}", file=sys.stderr)
        return 1
    stopping: list[bool] = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    signal.signal(signal.SIGINT, lambda *_: stopping.append(True))
    log.info("kvelastic keeper ready on %s: up to %d pages", path, keeper.holdings.max_pages)
    sd_notify("READY=1")
    try:
        keeper.serve(lambda: bool(stopping))
    finally:
        log.info("kvelastic keeper stopping: %d pages let go", len(keeper.holdings.fds))
        keeper.close()
    return 0
