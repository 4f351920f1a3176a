"""A client error inside the allocator: answered with ``Error(reason, message)``,
counted, and logged once per kind (``RefusalLog``)."""

from __future__ import annotations

import logging

from kvelastic import protocol as p

log = logging.getLogger("kvelastic.daemon")


class Rejected(Exception):
    """A client error: reply ``Error(reason, message)``; nothing was changed."""

    def __init__(self, reason: p.Reason, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class RefusalLog:
    """One line per kind of refusal, engine and sender: a flood does not
    flood the log (every refusal is still counted in the metric)."""

    LIMIT = 4096        # kinds remembered before forgetting them all

    def __init__(self) -> None:
        self._seen: set[tuple[p.Reason, str, bytes]] = set()

    def warn(self, reason: p.Reason, engine_id: str, identity: bytes, fmt: str, *args: object) -> None:
        seen = (reason, engine_id, identity)
        if seen in self._seen:
            return
        if len(self._seen) > self.LIMIT:
            self._seen.clear()
        self._seen.add(seen)
        log.warning(fmt, *args)
