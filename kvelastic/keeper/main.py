"""``kvelastic keeper``: configuration, signals, loop (``server.py``)."""

from __future__ import annotations

import logging
import signal
import sys

from kvelastic.config import Config
from kvelastic.errors import ConfigError, KvelasticError
from kvelastic.keeper.server import Keeper
from kvelastic.protocol import keeper_socket_path

log = logging.getLogger("kvelastic.keeper")


def main() -> int:
    try:
        config = Config.from_env()
    except ConfigError as exc:
        print(f"kvelastic keeper: configuration error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
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
    try:
        keeper.serve(lambda: bool(stopping))
    finally:
        log.info("kvelastic keeper stopping: %d pages let go", len(keeper.holdings.fds))
        keeper.close()
    return 0
