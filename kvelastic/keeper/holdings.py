"""What the keeper holds: page id -> descriptor. Decides each request's
answer; the descriptors it takes in, hands out and lets go are the shell's
to receive, send and close (``server.py``).

Invariants: a page id maps to at most one descriptor; the first descriptor
kept for an id stays (a page id names one page for life, so a second is a
duplicate the shell closes); a refused request changes nothing.
"""

from __future__ import annotations

import dataclasses

from kvelastic.keeper import messages as m


@dataclasses.dataclass
class Answer:
    reply: m.Reply
    send: list[tuple[int, int]] = dataclasses.field(default_factory=list)    # (page id, fd) to duplicate out
    close: list[int] = dataclasses.field(default_factory=list)               # fds the keeper lets go


class Holdings:
    def __init__(self, max_pages: int) -> None:
        self.max_pages = max_pages
        self.fds: dict[int, int] = {}
        self.refused: dict[str, int] = {}

    def refuse(self, reason: str, message: str, batch: list[tuple[int, int]]) -> Answer:
        self.refused[reason] = self.refused.get(reason, 0) + 1
        return Answer(m.Refused(reason=reason, message=message), close=[fd for _, fd in batch])

    def handle(self, request: m.Request, batch: list[tuple[int, int]]) -> Answer:
        """The answer to ``request`` that came with ``batch`` (page id, fd)."""
        if not isinstance(request, m.Keep) and batch:
            return self.refuse("bad_request", f"{type(request).__name__} carries no descriptors", batch)
        if isinstance(request, m.Keep):
            ids = [page_id for page_id, _ in batch]
            if len(set(ids)) != len(ids):
                return self.refuse("bad_request", "a page id twice in one batch", batch)
            new = [page_id for page_id in ids if page_id not in self.fds]
            if len(self.fds) + len(new) > self.max_pages:
                return self.refuse("full", f"{len(new)} more pages than the {self.max_pages} the keeper may "
                                           f"hold ({len(self.fds)} held)", batch)
            close = [fd for page_id, fd in batch if page_id in self.fds]
            self.fds.update((page_id, fd) for page_id, fd in batch if page_id not in self.fds)
            return Answer(m.Kept(page_ids=ids, held=len(self.fds)), close=close)
        if isinstance(request, m.Forget):
            gone = [page_id for page_id in dict.fromkeys(request.page_ids) if page_id in self.fds]
            close = [self.fds.pop(page_id) for page_id in gone]
            return Answer(m.Kept(page_ids=gone, held=len(self.fds)), close=close)
        if isinstance(request, m.Take):
            held = [page_id for page_id in dict.fromkeys(request.page_ids) if page_id in self.fds]
            return Answer(m.Kept(page_ids=held, held=len(self.fds)), send=[(i, self.fds[i]) for i in held])
        return Answer(m.KeeperStatus(page_ids=sorted(self.fds), bytes=0, refused=dict(self.refused)))
