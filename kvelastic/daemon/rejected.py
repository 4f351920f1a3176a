"""A client error inside the allocator: answered with ``Error(reason, message)``."""

from __future__ import annotations

from kvelastic import protocol as p


class Rejected(Exception):
    """A client error: reply ``Error(reason, message)``; nothing was changed."""

    def __init__(self, reason: p.Reason, message: str) -> None:
        super().__init__(message)
        self.reason = reason
