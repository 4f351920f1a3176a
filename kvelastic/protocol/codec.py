"""Frames of the control socket: one msgpack-encoded message (at most
``MAX_MESSAGE_BYTES``), decoded by one decoder over the ``Message`` union of
every message a peer may send, told apart by its tag (the class name).
``JournalFrame`` is send-only and in no union: it is a ``Journal`` on the
wire.
"""

from __future__ import annotations

import msgspec

from kvelastic.protocol.base import Error, Msg, Ok
from kvelastic.protocol.control import (
    Busy,
    ClearIndex,
    Diverge,
    Drain,
    Failed,
    Granted,
    Grow,
    Heartbeat,
    Mapped,
    MapSlab,
    Reclaim,
    ReclaimDone,
    Registered,
    RegisterEngine,
    RegisterWorker,
    Return,
    Unmapped,
    UnmapSlab,
    Unregister,
)
from kvelastic.protocol.journal import Journal
from kvelastic.protocol.operator import Invalidate, Invalidated, SetLimit, Status, StatusReply
from kvelastic.protocol.tier import TierCopied, TierData, TierFetch, TierLookup, TierPinned, TierRelease

# A message type missing here is a ``malformed`` frame to the daemon. The
# order is the fuzzer's (``kvelastic_tools/fuzz.py`` draws from it).
Message = (
    RegisterEngine | RegisterWorker | Grow | Return | Journal | Heartbeat | Unregister | Busy | Diverge
    | ReclaimDone | Mapped | Unmapped | Status | SetLimit | Invalidate | TierLookup | TierFetch | TierRelease
    | Ok | Error | Invalidated | Registered | Granted | Reclaim | Failed | ClearIndex | MapSlab | UnmapSlab
    | StatusReply | TierPinned | TierData | TierCopied | Drain
)

_encoder = msgspec.msgpack.Encoder()
_decoder: msgspec.msgpack.Decoder[Message] = msgspec.msgpack.Decoder(Message)


def encode(msg: Msg) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> Msg:
    """Raises ``msgspec.DecodeError``/``ValidationError`` on a malformed frame."""
    return _decoder.decode(data)
