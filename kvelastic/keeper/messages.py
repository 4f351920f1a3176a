"""The keeper's protocol: one request, one reply, on a page channel
(``kvelastic/vmm/fdchannel.py``: descriptors ride with a batch, the message
is the batch's command). Only the daemon's user (or root) may connect.

    Keep (+ the pages' descriptors)  -> Kept       the keeper holds them
    Forget(page_ids)                 -> Kept       it closes them
    Take(page_ids)                   -> Kept (+ duplicates of the descriptors, in the reply's batch)
    Query                            -> KeeperStatus
    anything malformed               -> Refused(reason), nothing changed
"""

from __future__ import annotations

from typing import Annotated

import msgspec

MAX_IDS = 1 << 20                                  # page ids one request may name
PageIds = Annotated[list[Annotated[int, msgspec.Meta(ge=0)]], msgspec.Meta(max_length=MAX_IDS)]


class KeeperMsg(msgspec.Struct, tag=True, kw_only=True, forbid_unknown_fields=True):
    pass


class Keep(KeeperMsg):
    """Hold the batch's descriptors under their page ids (an id held already
    keeps its first descriptor: a page id names one page for life)."""


class Forget(KeeperMsg):
    """Close the descriptors of ``page_ids`` (released pages); unknown ids are ignored."""
    page_ids: PageIds


class Take(KeeperMsg):
    """Duplicates of the descriptors of ``page_ids`` (held ones; the keeper
    keeps its own until ``Forget``): a new daemon recovering its pages."""
    page_ids: PageIds


class Query(KeeperMsg):
    """What the keeper holds."""


class Kept(KeeperMsg):
    """The page ids a request concerned that the keeper holds now (for
    ``Take``: those whose duplicates ride in the reply's batch, in order)."""
    page_ids: list[int]
    held: int                     # pages held in all


class KeeperStatus(KeeperMsg):
    page_ids: list[int]           # every page held, ascending
    bytes: int                    # their size
    refused: dict[str, int]       # requests refused, by reason


class Refused(KeeperMsg):
    reason: str                   # bad_request, not_allowed, full
    message: str


Request = Keep | Forget | Take | Query
Reply = Kept | KeeperStatus | Refused

_encoder = msgspec.msgpack.Encoder()
_requests = msgspec.msgpack.Decoder(Request)
_replies = msgspec.msgpack.Decoder(Reply)


def encode(msg: KeeperMsg) -> bytes:
    return _encoder.encode(msg)


def decode_request(data: bytes) -> Request:
    """A request, or ``msgspec.ValidationError``/``DecodeError`` for anything else."""
    return _requests.decode(data)


def decode_reply(data: bytes) -> Reply:
    return _replies.decode(data)
