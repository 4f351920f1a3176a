"""The daemon's side of the keeper (``server.py``): deposit pages, forget
them, take them back after a restart.

The keeper must be the daemon's own: a process of another user listening
on the path would be handed every page of the node, so the listener's uid
(``SO_PEERCRED``) must be the caller's or root's.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from kvelastic.client.trust import peer_uid
from kvelastic.errors import KvelasticError
from kvelastic.keeper import messages as m
from kvelastic.vmm.fdchannel import FdChannel

TIMEOUT = 10.0


class KeeperRefused(KvelasticError):
    reason = "keeper_refused"


class KeeperClient:
    def __init__(self, path: str, timeout: float = TIMEOUT) -> None:
        self.chan = FdChannel.connect(path)
        self.chan.sock.settimeout(timeout)
        uid = peer_uid(self.chan.sock)
        if uid not in (0, os.geteuid()):
            self.chan.close()
            raise KeeperRefused(f"the keeper on {path} runs as uid {uid}, not as this user or root: "
                                "no page is handed to it")

    def _ask(self, request: m.Request, items: Sequence[tuple[int, int]] = ()) -> tuple[m.Reply, list]:
        self.chan.send(items, m.encode(request))
        batch, command = self.chan.recv_batch()
        reply = m.decode_reply(command)
        if isinstance(reply, m.Refused):
            for _, fd in batch:
                os.close(fd)
            raise KeeperRefused(f"the keeper refused {type(request).__name__} ({reply.reason}): {reply.message}")
        return reply, batch

    def keep(self, items: Sequence[tuple[int, int]]) -> int:
        """Deposit ``(page id, fd)`` pairs (the caller keeps its fds); pages held in all."""
        reply, _ = self._ask(m.Keep(), items)
        assert isinstance(reply, m.Kept)
        return reply.held

    def forget(self, page_ids: Sequence[int]) -> list[int]:
        """The keeper closes these pages' descriptors; the ids it held."""
        reply, _ = self._ask(m.Forget(page_ids=list(page_ids)))
        assert isinstance(reply, m.Kept)
        return reply.page_ids

    def take(self, page_ids: Sequence[int]) -> list[tuple[int, int]]:
        """``(page id, fd)`` for the held ones among ``page_ids``: new descriptors, the caller's to close."""
        reply, batch = self._ask(m.Take(page_ids=list(page_ids)))
        return batch

    def status(self) -> m.KeeperStatus:
        reply, _ = self._ask(m.Query())
        assert isinstance(reply, m.KeeperStatus)
        return reply

    def close(self) -> None:
        self.chan.close()

    def __enter__(self) -> KeeperClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
