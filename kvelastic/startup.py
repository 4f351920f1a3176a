"""What every long-running kvelastic process does first: read its
configuration, saying what is wrong with it, and set up the operators' log."""

from __future__ import annotations

import logging
import os
import socket
import sys

from kvelastic.config import Config
from kvelastic.errors import ConfigError

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configured(program: str) -> Config | None:
    """The configuration from ``KVELASTIC_*`` with logging set to its level on
    stderr; None (the error printed, naming ``program``) when a value is bad."""
    try:
        config = Config.from_env()
    except ConfigError as exc:
        print(f"{program}: configuration error: {exc}", file=sys.stderr)
        return None
    logging.basicConfig(level=config.log_level.upper(), stream=sys.stderr, format=LOG_FORMAT)
    return config


def sd_notify(state: str) -> None:
    """systemd's readiness protocol (Type=notify), without a dependency."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.connect(addr)
        sock.sendall(state.encode())
