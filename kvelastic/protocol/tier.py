"""An engine with the node's tier (docs/tier.md): a lookup pins blocks under
a lease, their bytes come back in chunks over the control socket, and the
daemon tells an engine how far it copied the blocks it demoted. The
namespace is always the engine's registration's: a message never names one.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from kvelastic.names import Name
from kvelastic.protocol.base import Key, Msg

MAX_TIER_KEYS = 4096         # keys of one TierLookup


# ----------------------------------------------------------- engine -> daemon
class TierLookup(Msg):
    """Pin the longest run of ``keys`` (from the first) the tier holds for the
    engine's namespace (its registration's, never named here) under a lease."""
    engine_id: Name
    keys: Annotated[list[Key], msgspec.Meta(max_length=MAX_TIER_KEYS)]


class TierFetch(Msg):
    """Bytes of block ``block`` of a lease, from ``offset`` (a ``TierData``)."""
    engine_id: Name
    lease: Annotated[int, msgspec.Meta(ge=0)]
    block: Annotated[int, msgspec.Meta(ge=0, lt=MAX_TIER_KEYS)]
    offset: Annotated[int, msgspec.Meta(ge=0)] = 0


class TierRelease(Msg):
    """The lease's blocks not fetched yet are not wanted: unpinned."""
    engine_id: Name
    lease: Annotated[int, msgspec.Meta(ge=0)]


# ----------------------------------------------------------- daemon -> engine
class TierPinned(Msg):
    """The answer to ``TierLookup``: the lease (0: nothing found) and the size
    of each block pinned, the first keys' in order."""
    lease: int
    nbytes: list[int]


class TierData(Msg):
    """Bytes ``offset`` on of a block of ``size`` bytes (the last chunk ends
    at ``size``); ``size`` -1: not served (it failed its check and was
    dropped, or its namespace was invalidated since the lookup)."""
    lease: int
    block: int
    offset: int
    size: int
    data: bytes


class TierCopied(Msg):
    """To an engine: the daemon copied the blocks that its journals marked
    ``DEMOTE``, up to this ``ticket``, into the tier's staging. Its next
    journal carries the ticket back (``Journal.tier_ack``); a copied block
    that journal or an earlier one drops may have been rewritten while it was
    read, and is discarded; the others are written to the tier."""
    ticket: int
